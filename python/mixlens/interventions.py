"""nnterp's ``nnterp.interventions`` helpers on mixlens models: :func:`logit_lens`, :func:`patchscope_lens`,
:func:`patchscope_generate` (same arguments and result shapes as nnterp 1.3; docs/nnterp.md states the
differences). Results are torch tensors or numpy arrays by the model's output format.

They compose the core's primitives: pre-registered saves of ``layers.{i}.layer_output``, writes of it
inside a trace, and ``Model::project_on_vocab`` (final norm + LM head, in C++).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable
from typing import Optional, Sequence, Union

import numpy as np

from ._args import IndexInputError, as_index, check_bool, check_int, check_model, check_str, layer_list
from ._convert import as_float32, to_plain
from .errors import InputError

__all__ = ["logit_lens", "patchscope_lens", "patchscope_generate", "get_token_activations", "TargetPrompt",
           "TargetPromptBatch", "repeat_prompt"]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _prompts(prompts) -> list:
    """One prompt or a list of them (texts or token-id lists)."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
        raise InputError(f"prompts must be a string or a list of prompts, got {prompts!r} ({type(prompts).__name__})")
    return list(prompts)


def _layers(model, layers) -> list[int]:
    return layer_list("layers", layers, _model_of(model).num_layers)


def _model_of(model):
    check_model("model", model)
    return model


def get_token_activations(model, prompts, layers=None, idx: int = -1) -> np.ndarray:
    """The residual stream leaving each of `layers` (default: all) at token `idx` of each prompt (left-padded, so
    -1 is each prompt's last token): float32 numpy ``[num_layers, num_prompts, hidden]`` (nnterp's
    ``get_token_activations``, as a stacked array)."""
    layers = _layers(model, layers)
    prompts = _prompts(prompts)
    saved = model.run(prompts, saves=[f"layers.{l}.layer_output" for l in layers])
    outs = [as_float32(saved[f"layers.{l}.layer_output"], "layer_output") for l in layers]
    seq = outs[0].shape[1]
    idx = check_int("get_token_activations: idx", idx, -seq, seq - 1)
    return np.stack([o[:, idx] for o in outs])


def logit_lens(model, prompts: Union[str, Sequence[str]], return_inv_logits: bool = False):
    """nnterp's ``logit_lens``: next-token probabilities ``softmax(lm_head(ln_final(h_l)))`` of each prompt's last
    token read from every layer's output: ``[num_prompts, num_layers, vocab]``. With `return_inv_logits`,
    also the probabilities of ``lm_head(-ln_final(h_l))`` (nnterp's inverse logits)."""
    return_inv_logits = check_bool("return_inv_logits", return_inv_logits)
    hiddens = get_token_activations(model, prompts)  # [L, P, D]
    logits = as_float32(model.project_on_vocab(hiddens), "logits")  # [L, P, V]
    probs = to_plain(np.ascontiguousarray(_softmax(logits).transpose(1, 0, 2)), model.output_format)
    if not return_inv_logits:
        return probs
    # lm_head(-norm(h)) = -lm_head(norm(h)): the head is linear without bias.
    inv = to_plain(np.ascontiguousarray(_softmax(-logits).transpose(1, 0, 2)), model.output_format)
    return probs, inv


@dataclass
class TargetPrompt:
    """A prompt to patch and the (left-padded batch) index of the token whose hidden state is replaced."""

    prompt: str
    index_to_patch: int

    def __post_init__(self):
        check_str("TargetPrompt: prompt", self.prompt)
        try:
            self.index_to_patch = as_index(self.index_to_patch)
        except TypeError:
            raise InputError(f"TargetPrompt: index_to_patch must be an integer, got {self.index_to_patch!r}") from None


@dataclass
class TargetPromptBatch:
    prompts: list
    index_to_patch: np.ndarray

    @classmethod
    def from_target_prompts(cls, prompts: Sequence[TargetPrompt]) -> "TargetPromptBatch":
        return cls([p.prompt for p in prompts], np.array([int(p.index_to_patch) for p in prompts]))

    @classmethod
    def from_target_prompt(cls, prompt: TargetPrompt, batch_size: int) -> "TargetPromptBatch":
        return cls([prompt.prompt] * batch_size, np.array([int(prompt.index_to_patch)] * batch_size))

    @classmethod
    def from_prompts(cls, prompts, index_to_patch) -> "TargetPromptBatch":
        prompts = _prompts(prompts)
        idx = np.broadcast_to(np.asarray(index_to_patch, dtype=np.int64), (len(prompts),)).copy()
        return cls(prompts, idx)

    def __len__(self) -> int:
        return len(self.prompts)

    @staticmethod
    def auto(target, batch_size: int) -> "TargetPromptBatch":
        if isinstance(target, TargetPrompt):
            return TargetPromptBatch.from_target_prompt(target, batch_size)
        if isinstance(target, list):
            return TargetPromptBatch.from_target_prompts(target)
        if isinstance(target, TargetPromptBatch):
            return target
        raise InputError(f"target_patch_prompts must be a TargetPrompt, a list of them or a TargetPromptBatch, got "
                         f"{type(target).__name__}")


def repeat_prompt(words=None, rel: str = " ", sep: str = "\n", placeholder: str = "?", index_to_patch: int = -1):
    """The patchscopes paper's identity prompt (nnterp's ``repeat_prompt``): "king king\\n1135 1135\\nhello hello\\n?"."""
    if words is None:
        words = ["king", "1135", "hello"]
    if isinstance(words, (str, bytes)) or not isinstance(words, Iterable) or not all(isinstance(w, str) for w in words):
        raise InputError(f"repeat_prompt: words must be a list of strings, got {words!r}")
    return TargetPrompt(sep.join(w + rel + w for w in words) + sep + placeholder, index_to_patch)


def patchscope_lens(model, source_prompts=None, target_patch_prompts=None, layers=None, latents=None):
    """nnterp's ``patchscope_lens``: for each layer l, run the target prompts with the hidden state of token
    ``index_to_patch`` leaving layer l replaced by the last-token hidden state of the matching source prompt
    at layer l (or `latents[l_idx]`, ``[num_layers, num_sources, hidden]``); returns the next-token
    probabilities ``[num_sources, num_layers, vocab]``."""
    if target_patch_prompts is None:
        target_patch_prompts = repeat_prompt()
    if latents is not None:
        if source_prompts is not None:
            raise InputError("patchscope_lens: give source_prompts or latents, not both")
        latents = as_float32(latents, "latents")
        num_sources = latents.shape[1]
    elif source_prompts is None:
        raise InputError("patchscope_lens: either source_prompts or latents must be given")
    else:
        source_prompts = _prompts(source_prompts)
        num_sources = len(source_prompts)
    target = TargetPromptBatch.auto(target_patch_prompts, num_sources)
    layers = _layers(model, layers)
    if len(target) != num_sources:
        raise InputError(f"number of sources ({num_sources}) does not match number of patch prompts ({len(target)})")
    if latents is None:
        latents = get_token_activations(model, source_prompts, layers=layers)
    probs = []
    rows = np.arange(num_sources)
    for k, layer in enumerate(layers):
        with model.trace(target.prompts):
            h = as_float32(model.layers_output[layer], "layer_output").copy()
            seq = h.shape[1]
            bad = [int(i) for i in np.atleast_1d(target.index_to_patch) if not -seq <= int(i) < seq]
            if bad:
                raise IndexInputError(f"patchscope_lens: index_to_patch {bad[0]} is out of range for target prompts "
                                      f"of {seq} tokens")
            h[rows, target.index_to_patch] = latents[k]
            model.layers_output[layer] = h
            probs.append(as_float32(model.next_token_probs, "probs"))
    out = np.ascontiguousarray(np.stack(probs).transpose(1, 0, 2))  # [sources, layers, vocab]
    return to_plain(out, model.output_format)


def patchscope_generate(model, prompts, target_patch_prompt: TargetPrompt, max_length: int = 50, layers=None,
                        max_batch_size: int = 32, eos_token_id: Optional[int] = None) -> dict:
    """nnterp's ``patchscope_generate``: for each layer, generate `max_length` tokens from the target prompt (one row
    per source prompt) with the hidden state of ``index_to_patch`` leaving that layer (prompt step only)
    replaced by the source's last-token hidden state. Returns ``{layer: [num_prompts, prompt_len + new]}``
    token ids (prompt then generated tokens; rows that stop at EOS are right-padded with the pad id, as
    transformers' generate does). Several layers run in one batched generation (``max_batch_size`` rows)."""
    prompts = _prompts(prompts)
    layers = _layers(model, layers)
    hiddens = get_token_activations(model, prompts, layers=layers)  # [L, P, D]
    pad = model._core.pad_token_id
    n = len(prompts)
    per_call = max(check_int("max_batch_size", max_batch_size, 1, 1 << 30) // n, 1)
    target_ids = model.tokenizer.encode(target_patch_prompt.prompt)
    out: dict = {}
    for start in range(0, len(layers), per_call):
        chunk = list(range(start, min(start + per_call, len(layers))))
        with model.generate([target_patch_prompt.prompt] * (n * len(chunk)), max_new_tokens=max_length,
                            eos_token_id=eos_token_id) as tracer:
            for j, k in enumerate(sorted(chunk, key=lambda k: layers[k])):
                slot = chunk.index(k)
                layer = layers[k]
                h = as_float32(model.layers_output[layer], "layer_output").copy()
                h[slot * n:(slot + 1) * n, target_patch_prompt.index_to_patch] = hiddens[k]
                model.layers_output[layer] = h
        toks = tracer.tokens
        width = max(len(t) for t in toks)
        for slot, k in enumerate(chunk):
            rows = [target_ids + list(t) + [pad] * (width - len(t)) for t in toks[slot * n:(slot + 1) * n]]
            out[layers[k]] = to_plain(np.array(rows, dtype=np.int64), model.output_format)
    return out
