"""mixlens: read and write every value of recurrent language models (Mamba-2, ...), natively in C++.

The API follows nnsight / nnterp::

    import mixlens
    model = mixlens.StandardizedTransformer("models/mamba2-tinystories")   # folder or cached hub id

    with model.trace("Once upon a time") as tracer:      # or a list of prompts, or token ids
        b = model.layers[1].linear_attn.betas             # torch [B,T,heads], read as the forward gets there
        model.layers[1].linear_attn.betas = b * 0.5       # consumed by the rest of the forward
        s = model.layers[1].linear_attn.states.save()     # [B,T,heads,state,head_dim]; .save() is optional
        out = model.logits.save()                         # [B,T,vocab]

    with model.generate("Once upon a time", max_new_tokens=5) as tracer:
        for step in tracer.iter[:]:                       # step 0 = prompt, then one token per step
            so = model.layers[0].linear_attn.state_output
    tracer.tokens, tracer.text

The forward runs on a C++ worker thread and pauses only where the block reads or writes, so values
are real tensors (copies; ``torch.Tensor`` when torch is installed, numpy otherwise: ``output=``) and
must be visited in forward order (``model.values()``); asking for a value the forward has passed
raises :class:`OutOfOrderError`. An in-place edit of the value read last is a write, consumed when
the block moves on; editing a value the forward has passed raises :class:`WriteError`.
``with model.trace() as tracer: with tracer.invoke(prompt): ...`` batches several prompts into one
forward (nnsight's invokes). nnterp's accessors and helpers: ``model.layers_output[i]``,
``attentions_output``, ``mlps_output``, ``attention_probabilities``, ``next_token_probs``, ``steer``,
``skip_layer(s)``, ``project_on_vocab``, :mod:`mixlens.interventions` (``logit_lens``,
``patchscope_lens``, ``patchscope_generate``); docs/nnterp.md maps every call. ``model.run(prompts, saves=[...], edits={...})``
is the non-interleaved form. Value names and their reference quantities: ``docs/values.md`` in the
repository; ``model.values()`` lists them with shapes and meanings, and
``model.support()`` says which exist where.

``mixlens.load()`` / ``StandardizedTransformer()`` with no path load :func:`default_model_path`:
``$MIXLENS_MODEL`` when set, else the Mamba-2 shipped in the repository (``models/mamba2-tinystories``).

Datasets: :func:`extract` / ``model.extract(prompts_or_file_or_dataset, values=..., out=DIR)`` writes
values of many prompts to sharded safetensors + index.json (resumable; ``ray=True`` on a Ray cluster),
:func:`open_extraction` reads them back (docs/extract.md).

Also: :func:`route_kernels` (force the chunked / recurrent algorithm per family),
:func:`chunk_per_token`, :mod:`mixlens.hub` (hub ids in the local cache, the C++ resolver), and the exception
classes (all :class:`MixlensError`).
"""

from __future__ import annotations

from .errors import (
    CheckpointError,
    ConfigError,
    InputError,
    InterruptedRunError,
    MixlensError,
    NumericError,
    OutOfOrderError,
    ResourceError,
    TokenizerError,
    UnknownAttributeError,
    UnknownValueError,
    UnsupportedError,
    WriteError,
)
from . import _core  # noqa: E402  (imports mixlens.errors itself)
from . import hub
from . import interventions
from . import metrics
from ._model import Cache, StandardizedTransformer, Tokenizer, Tracer, ValueArray, default_model_path, load
from ._args import check_bool as _check_bool, check_model as _check_model, check_str as _check_str
from ._extract import Extraction, extract, extract_ray, open_extraction
from ._attribution import AtpResult, ResidStack

# One source: CMakeLists.txt's project(VERSION), compiled into the core (and read by the package metadata).
__version__: str = _core.version()

LanguageModel = StandardizedTransformer  # nnsight spelling

__all__ = [
    "StandardizedTransformer",
    "LanguageModel",
    "load",
    "default_model_path",
    "Tracer",
    "ValueArray",
    "Cache",
    "Tokenizer",
    "extract",
    "extract_ray",
    "open_extraction",
    "Extraction",
    "ResidStack",
    "AtpResult",
    "route_kernels",
    "chunk_per_token",
    "convert",
    "hub",
    "interventions",
    "MixlensError",
    "CheckpointError",
    "ConfigError",
    "TokenizerError",
    "UnknownValueError",
    "UnknownAttributeError",
    "WriteError",
    "UnsupportedError",
    "ResourceError",
    "NumericError",
    "InputError",
    "OutOfOrderError",
    "InterruptedRunError",
]


def __getattr__(name: str):
    # mixlens.ValueTensor: a torch.Tensor subclass, defined on first use so that importing mixlens does
    # not import torch.
    if name == "ValueTensor":
        from ._convert import value_tensor_class

        return value_tensor_class()
    raise AttributeError(f"module 'mixlens' has no attribute {name!r}")


def route_kernels(family: str, route: str) -> None:
    """Force one recurrent-mixer algorithm for a family, process-wide (like the reference's routing):
    ``route_kernels("mamba2", "recurrent" | "chunked" | "default")``. Optional in mixlens: per-token
    states are served on every path; use it for parity work and speed measurements.
    InputError for another route name or family."""
    _core.route_kernels(_check_str("route_kernels: family", family), _check_str("route_kernels: route", route))


def convert(path: str, out_dir, dtype="bfloat16") -> dict:
    """Write `out_dir`, a copy of the checkpoint `path` (folder or hub id in the local cache) whose
    matmul weights (projections, embeddings, lm_head, experts: ``model.info["matmul_weights"]``) are
    stored in `dtype` ("bfloat16" or "float16", or the torch dtype), rounded to nearest even from
    float32 exactly as ``load(path, dtype=dtype)`` rounds them; every other tensor keeps its own dtype,
    and config / tokenizer files are copied. ``load(out_dir, dtype="auto")`` then gives bitwise the
    numbers of ``load(path, dtype=dtype)`` without converting at every load (CLI: ``mixlens convert``).

    Returns ``{out_dir, converted, kept, bytes_before, bytes_after, copied_files}``. Errors: those of
    :func:`load`; InputError for another dtype or an `out_dir` that exists and is not an empty folder
    (or is the source); CheckpointError when writing fails (the partial folder is removed)."""
    import os

    from ._inputs import _dtype_name

    return _core.convert_checkpoint(_check_str("convert: path", os.fspath(path)), os.fspath(out_dir),
                                    _dtype_name(dtype))


def kernel_route(family: str) -> str:
    """The route set by :func:`route_kernels` for `family` ("default" when none); InputError for an unknown
    family."""
    return _core.kernel_route(_check_str("kernel_route: family", family))


def chunk_per_token(model: StandardizedTransformer, enabled: bool = True) -> None:
    """Run the chunked kernel with chunks of one token (``enabled``) or back to the default: every Mamba-2
    mixer (Mamba-2, Nemotron-H, Bamba, Falcon-H1: config.chunk_size) and Mamba-1's chunked scan (64).
    Optional in mixlens (per-token states are produced on any chunk size); values agree either way.
    UnsupportedError for ``enabled=True`` on Qwen3.5 / Qwen3-Next, whose gated delta rule runs fixed
    chunks of 64 (as transformers'); InputError for a model that is not a mixlens model or an ``enabled``
    that is not True / False."""
    _check_model("chunk_per_token: model", model)
    model._core.set_chunk_size(1 if _check_bool("enabled", enabled) else 0)
