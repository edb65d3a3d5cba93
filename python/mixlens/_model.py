"""The nnsight / nnterp-style front end over the C++ Session (see the package docstring): the model class
and ``load``. Inputs are normalised in mixlens._inputs, values reached through the envoys of
mixlens._envoy, and a run's block is a mixlens._tracer.Tracer."""

from __future__ import annotations

import os
import re
import threading
import weakref
from typing import Any, Optional

import numpy as np

from . import _attribution, _core, _extract, _invoke, _nnterp, hub
from ._args import ModelBase, check_bool as _check_bool, check_float as _check_float, check_int as _check_int
from ._cache import Cache
from ._convert import ValueArray, resolve_output, to_plain
from ._envoy import _Envoy, _Layers, _LayerValue, _TlBlocks
from ._inputs import (_INT32_MAX, _NO_MASK_WITH_CACHE, _STEP_KEY, _UINT64_MAX, Prompt, _all_logits, _check_rows,
                      _check_saved_steps, _check_steps_reachable, _dtype_name, _edit_specs, _embeds_input,
                      _ids_input, _save_specs)
from ._tokenizer import Tokenizer
from ._tracer import _OPENED, Tracer
from .errors import InputError, MixlensError, UnsupportedError

__all__ = ["StandardizedTransformer", "Tracer", "ValueArray", "Cache", "Tokenizer", "load", "default_model_path"]


def _generic_reason(reason: str, layer: int) -> str:
    """'block 3 ... layers.3.x' -> 'block {i} ... layers.{i}.x' so per-block reasons can be compared."""
    return re.sub(rf"(?<![\w.]){layer}(?![\w])|(?<=layers\.){layer}(?=\.)", "{i}", reason)


class StandardizedTransformer(ModelBase, _nnterp.NnterpMixin, _attribution.AttributionMixin):
    """A recurrent LM (Mamba-2, ...) loaded natively, with nnterp's standardized names.

    ``StandardizedTransformer(path_or_hub_id)`` loads a checkpoint folder (config.json, *.safetensors,
    tokenizer.json) or a hub id from the local HuggingFace cache (never the network). With ``cache_dir`` /
    ``revision`` / ``use_hub=True`` the id is resolved by :func:`mixlens.hub.resolve` (the C++ resolver, in that cache).
    With no path, the model is :func:`default_model_path`: ``$MIXLENS_MODEL``, else the small Mamba-2
    shipped in the repository (``models/mamba2-tinystories``), as the ``mixlens`` CLI does.

    Values (read inside ``with model.trace(...)``; shapes for Mamba-2, ``B`` prompts, ``T`` tokens):

    ==========================================  ====================================================
    ``model.embed_tokens.output``               ``[B,T,hidden]`` token embeddings
    ``model.layers[i].layer_input / output``    ``[B,T,hidden]`` residual stream entering / leaving block i
    ``model.layers[i].linear_attn.<value>``     the recurrent mixer (docs/values.md): ``attention_queries`` (C,
                                                ``[B,T,G,N]``), ``attention_keys`` (B), ``attention_values`` (x,
                                                ``[B,T,H,P]``), ``betas`` (dt, ``[B,T,H]``, >= 0), ``decays`` (A*dt,
                                                <= 0), ``state_input`` (``[B,H,N,P]``, None on a fresh prompt),
                                                ``state_output``, ``states`` (``[B,T,H,N,P]``, read-only),
                                                ``attention_head_outputs`` (y, ``[B,T,H,P]``), ``attention_output``
    ``model.layers[i].self_attn.*`` / ``.mlp``  attention / MLP of hybrid blocks (an error naming the block's
                                                kind where a block has none)
    ``model.ln_final.output``, ``model.logits`` ``[B,T,hidden]``, ``[B,T,vocab]``
    ==========================================  ====================================================

    Values are float32 copies handed out as ``torch.Tensor`` or numpy arrays by ``output=`` ("auto":
    torch when installed; ``$MIXLENS_OUTPUT`` sets the default). An in-place edit of the value read last
    reaches the forward when the block moves on; see :mod:`mixlens._inplace`. nnterp's surface
    (``layers_output``, ``attentions_output``, ``mlps_output``, ``next_token_probs``, ``steer``,
    ``skip_layer(s)``, ``project_on_vocab``, head weights) is in :class:`mixlens._nnterp.NnterpMixin`.
    The numerical reference is HF transformers' pure-torch implementation; ``model.values()`` lists
    every path with its shape and meaning.
    """

    def __init__(self, path_or_hub_id: Optional[str] = None, *, cache_dir: Optional[str] = None,
                 revision: Optional[str] = None, use_hub: bool = False, output: Optional[str] = None,
                 dtype: Any = "float32", deterministic: Optional[bool] = None):
        """``dtype``: the dtype the matmul weights (projections, embeddings, lm_head, experts) are kept
        in and multiplied as, with float32 accumulation: ``"float32"`` (default, widened at load: exact
        parity with transformers in float32), ``"bfloat16"``, ``"float16"``, ``"int8"`` (quantized at load:
        blocks of 32 weights along the input axis, each a float32 scale max|w| / 127 and 32 int8 values,
        as llama.cpp's Q8_0; about half the bytes of bfloat16; products of 1-4 token rows (decode steps),
        or all under ``deterministic``, also round the activations to int16 per block of 32; fidelity in
        docs/values.md "int8 weights"),
        or ``"auto"`` (each weight's checkpoint dtype); ``torch.float32`` / ``torch.bfloat16`` /
        ``torch.float16`` / ``torch.int8`` are accepted too.
        States, gates, decays, norms and every value served stay float32. ValueError otherwise.
        ``deterministic``: batch-invariant numerics (README "Batch invariance"): a row's values are bitwise
        the same alone or in any left-padded batch and on any thread count; prompts run slower. None
        (default): ``$MIXLENS_DETERMINISTIC`` (``1`` on, ``0`` off, InputError for anything else), else
        False; True / False win over the variable."""
        self._output = resolve_output(output)
        dtype = _dtype_name(dtype)
        path = default_model_path() if path_or_hub_id is None else os.fspath(path_or_hub_id)
        if use_hub or cache_dir is not None or revision is not None:
            path = hub.resolve(path, revision=revision, cache_dir=cache_dir)
        try:
            self._core = _core.Model.load(
                path, dtype, None if deterministic is None else _check_bool("deterministic", deterministic))
        except MixlensError as e:
            if path_or_hub_id is None and os.environ.get("MIXLENS_MODEL"):
                # Otherwise a stale variable reads as if the shipped model were broken.
                raise type(e)(f"{e} (the path came from $MIXLENS_MODEL; unset it for the shipped model)") from None
            raise
        self._open: Optional[weakref.ref] = None  # the open tracer (any thread's)
        self._trace_lock = threading.Lock()       # held while a trace is open: one at a time per model
        self._value_paths: Optional[frozenset] = None
        self._num_layers: int = self._core.info["num_layers"]  # info builds a dict: not per read
        self.layers = _Layers(self)
        self.blocks = _TlBlocks(self)  # TransformerLens 4 names (docs/transformer_lens.md)
        self.embed_tokens = _Envoy(self, "embed_tokens.")
        self.ln_final = _Envoy(self, "ln_final.")
        self.layers_input = _LayerValue(self, "layer_input")
        self.layers_output = _LayerValue(self, "layer_output")
        self.tokenizer = Tokenizer(self._core)
        _nnterp.attach(self)

    # -- description ------------------------------------------------------------------------
    @property
    def info(self) -> dict:
        """family, model_type, path, num_layers, hidden_size, vocab_size, layer_kinds, dtype (the load option) and
        weight_dtypes (what the matmul weights are kept in: what dtype="auto" resolved to)."""
        return self._core.info

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def hidden_size(self) -> int:
        return self._core.info["hidden_size"]

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding / LM head (config.vocab_size; may exceed the tokenizer's vocabulary)."""
        return self._core.info["vocab_size"]

    @property
    def prefill_chunk(self) -> int:
        """Chunked prefill length in tokens (default 512; 0 = off). A call longer than this that nobody observes
        (no save, edit or read of any of its values; no left padding) runs as pieces of this many tokens carrying
        the cache, so a long prompt needs the memory of one piece beyond the cache. Same numbers up to float
        rounding at the piece boundaries; still one step. InputError when negative."""
        return self._core.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, tokens: int) -> None:
        self._core.prefill_chunk = _check_int("prefill_chunk", tokens, 0, _INT32_MAX)

    @property
    def output_format(self) -> str:
        """'torch' or 'numpy': the type of every value this model hands out (``output=`` at load; settable)."""
        return self._output

    @output_format.setter
    def output_format(self, output: str) -> None:
        if self._open_tracer() is not None:
            raise InputError("output_format cannot change while a trace is open")
        self._output = resolve_output(output)

    def values(self, batch: int = 1, seq: int = 1) -> list[dict]:
        """Every value in forward order for a call of `batch` rows and `seq` tokens: path, layer, shape,
        writable, per_token, meaning (the reference quantity it equals)."""
        return self._core.values(_check_int("batch", batch, 1, _INT32_MAX), _check_int("seq", seq, 1, _INT32_MAX))

    def _paths(self) -> frozenset:
        """Every value path of this model (``model.values()``), computed once."""
        if self._value_paths is None:
            self._value_paths = frozenset(v["path"] for v in self._core.values())
        return self._value_paths

    def _paths_under(self, prefix: str) -> dict:
        """{name: path} of the values named ``<prefix><name>`` (no further dot): an envoy's value properties."""
        groups = getattr(self, "_path_groups", None)
        if groups is None:  # one pass over every path, not one per envoy
            groups = {}
            for p in self._paths():
                head, _, name = p.rpartition(".")
                groups.setdefault(head + "." if head else "", {})[name] = p
            self._path_groups = groups
        return dict(groups.get(prefix, {}))

    def _order(self) -> dict:
        """Value path -> its index in forward order (``model.values()``)."""
        if getattr(self, "_value_order", None) is None:
            self._value_order = {v["path"]: k for k, v in enumerate(self._core.values())}
        return self._value_order

    def _known(self, path: str) -> bool:
        return path in self._paths()

    def support(self, layer: Optional[int] = None) -> dict:
        """docs/values.md ``support()``: value name (``"linear_attn.states"``) -> None when available, else the
        reason (a sentence naming the cause and what to use instead). Where every block answers alike
        the entry is one value, the reason's block index written ``{i}``; where blocks differ (hybrids)
        it is a per-layer ``{layer: None | reason}`` mapping. The per-token state methods are listed
        too (``linear_attn.state``, ``linear_attn.state_after``, ``linear_attn.set_state_after``).
        ``support(layer=i)``: the answers for block i alone (negative counts from the end), one value each."""
        if layer is not None:
            n = self.num_layers
            i = _check_int("layer", layer, -n, n - 1)
            i = i + n if i < 0 else i
            return {name: (per_layer.get(i, per_layer.get(-1, "")) or None)
                    for name, per_layer in self._core.support().items()
                    if i in per_layer or -1 in per_layer}
        out = {}
        for name, per_layer in self._core.support().items():
            reasons = {layer: (r or None) for layer, r in per_layer.items()}
            generic = {r if r is None or layer < 0 else _generic_reason(r, layer) for layer, r in reasons.items()}
            out[name] = next(iter(generic)) if len(generic) == 1 else reasons
        return out

    def __repr__(self) -> str:
        i = self.info
        return f"mixlens.StandardizedTransformer({i['family']}, {i['num_layers']} layers, path={i['path']!r})"

    # -- inputs -----------------------------------------------------------------------------
    def _rows(self, inputs: Prompt) -> tuple[list[list[int]], bool]:
        """Token rows and whether the input was a single prompt."""
        if isinstance(inputs, str):
            return [self.tokenizer.encode(inputs)], True
        if hasattr(inputs, "__array__") and not isinstance(inputs, (list, tuple)):
            arr = np.asarray(inputs)
            if arr.dtype.kind not in "iu" or arr.ndim not in (1, 2):
                raise InputError(f"token ids must be a 1-D or 2-D integer array, got {arr.dtype} {arr.shape}")
            return (_check_rows([arr.tolist()]), True) if arr.ndim == 1 else (_check_rows(arr.tolist()), False)
        if not isinstance(inputs, (list, tuple)) or len(inputs) == 0:
            raise InputError("inputs must be a prompt string, a list of prompts, or token ids")
        if all(isinstance(x, str) for x in inputs):
            return [self.tokenizer.encode(x) for x in inputs], False
        if all(isinstance(x, (int, np.integer)) for x in inputs):
            return _check_rows([list(inputs)]), True
        if all(isinstance(x, (list, tuple, np.ndarray)) for x in inputs):
            return _check_rows([list(row) for row in inputs]), False
        raise InputError("inputs must be a prompt string, a list of prompts, token ids, or a list of token-id rows")

    # -- value access through the open tracer ----------------------------------------------
    def _open_tracer(self) -> Optional[Tracer]:
        """The model's open tracer, whichever thread opened it (None when no trace is open)."""
        ref = self._open
        t = ref() if ref is not None else None
        return t if t is not None and t._session is not None else None

    def _tracer_for(self, path: str, verb: str = "read") -> Tracer:
        t = self._open_tracer()
        if t is None:
            d = getattr(self, "_deferred_tracer", None)
            if d is not None and d() is not None and d()._deferred_open:
                raise InputError(f"'{path}': this trace batches tracer.invoke(...) blocks: read and write values inside "
                                 "an invoke")
            raise InputError(f"'{path}' can only be {verb} inside a `with model.trace(...)` or `with "
                             "model.generate(...)` block, and no trace is open on this model (a block that ended "
                             "keeps its values: use the ones read in it, or tracer.saved)")
        if not t._opened_here():
            t._refuse_foreign(path)
        return t

    def _fast_tracer(self) -> Optional[Tracer]:
        """The open tracer when this thread / context entered it and it is running (the per-value path's
        one check), else None: other cases (an invoke body's thread, whose context is a fresh one; another
        thread; a closed trace) take _read's full path, which raises or routes them."""
        ref = self._open
        if ref is not None:
            t = ref()
            if t is not None and t._session is not None and t._ctx is _OPENED.get():
                return t
        return None

    def _read(self, path: str):
        t = self._fast_tracer()
        if t is not None:  # the common case, inlined
            return t._read_here(path)
        inv = _invoke.current()
        if inv is not None:  # an invoke body's thread: its trace was opened by the caller's thread
            return inv.tracer._read(path)
        ref = self._open
        t = ref() if ref is not None else None
        if t is not None and t._session is not None and t._opened_here():
            return t._read_here(path)
        return self._tracer_for(path)._read_here(path)

    def _write(self, path: str, value) -> None:
        inv = _invoke.current()
        if inv is not None:
            return inv.tracer._write(path, value)
        self._tracer_for(path, "written")._write(path, value)

    @property
    def logits(self) -> ValueArray:
        """``[B,T,vocab]`` float32 logits of the current step (read inside a trace)."""
        return self._read("logits")

    @logits.setter
    def logits(self, value) -> None:
        self._write("logits", value)

    # -- runs ---------------------------------------------------------------------------------
    def trace(self, inputs: Optional[Prompt] = None, *, cache: Optional[Cache] = None, saves=None, edits=None,
              inputs_embeds=None, attention_mask=None, grad: bool = False, logits: str = "all") -> Tracer:
        """One forward call over `inputs` (a prompt, a list of prompts as one left-padded batch, or token
        ids); with `cache`, a continuation of it (rows of equal length). Token ids ``[B,T]`` the caller padded
        take their 0/1 ``attention_mask`` (left padding only: right padding raises InputError, tokenize with
        ``padding_side="left"``); a tokenizer's output dict (``input_ids``, ``attention_mask``) is taken whole. `saves`: value paths (``*`` for
        every layer, ``@stepK`` suffix for one step) collected into ``tracer.saved``; `edits`:
        ``{path: array | fn(array) -> array}`` applied before the block sees the value.

        Instead of `inputs`, ``inputs_embeds`` (transformers' argument): float ``[B,T,hidden]`` (or ``[T,hidden]``),
        numpy or torch, with an optional 0/1 ``attention_mask [B,T]`` marking left padding (first calls only);
        ``embed_tokens.output`` then serves them. Embeddings equal to the table rows of some ids give exactly
        the ids' results.

        ``logits="last"``: ``tracer.logits`` is ``[B,1,vocab]`` (the last position) and the LM head runs on that
        position only (a long prompt never builds ``[B,T,vocab]``); reading or saving ``logits`` still gets every
        position. Default ``"all"``: ``[B,T,vocab]``.

        Threads: one trace is open per model at a time. A trace opened in another thread waits until this one
        ends; a thread (or asyncio task) reading ``model.<value>`` while another one's trace is open gets
        InputError, never that trace's values. An edit function that reads through the open tracer raises
        InputError (it would wait on itself). A tracer entered and never exited is aborted, with a
        RuntimeWarning, when garbage-collected. Ctrl-C raises KeyboardInterrupt within about 50 ms (the forward
        stops at its next layer).

        ``grad=True`` records what :meth:`Tracer.backward` needs (each block's input and every write: one copy
        of the residual stream per block); after the block, ``tracer.backward(metric)`` computes gradients
        natively (docs/gradients.md)."""
        return Tracer(self, "trace", inputs, cache=cache, saves=saves, edits=edits, inputs_embeds=inputs_embeds,
                      attention_mask=attention_mask, grad=_check_bool("grad", grad), logits=logits)

    def generate(self, inputs: Optional[Prompt] = None, max_new_tokens: int = 20, *, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 eos_token_id: Optional[int] = None, forced_tokens=None, saves=None, edits=None,
                 inputs_embeds=None, attention_mask=None, grad: bool = False) -> Tracer:
        """Generation: step 0 runs the prompt, steps 1..max_new_tokens-1 one token each; greedy unless
        `do_sample` (temperature / top_k / top_p / seed as transformers). Stops a row at EOS
        (config.eos_token_id, or `eos_token_id`; -1 disables). `forced_tokens` (one row per prompt)
        teacher-forces the tokens fed after each step instead (``tracer.tokens`` then holds each step's
        greedy prediction and ``tracer.logits`` every step's logits). Use as ``with ... as tracer`` and
        ``tracer.iter``, or ``.run()``. ``inputs_embeds`` / ``attention_mask`` as in :meth:`trace` feed step 0;
        later steps feed the generated ids (as transformers: ``tracer.tokens`` holds only new tokens).
        ``grad=True`` raises UnsupportedError: gradients are taken through one call (docs/gradients.md)."""
        do_sample = _check_bool("do_sample", do_sample)
        if _check_bool("grad", grad):
            raise UnsupportedError("generate(grad=True): gradients are taken through one forward call, not across "
                                   "generation steps; use `with model.trace(prompt, grad=True)` (a continuation "
                                   "`trace(ids, cache=cache, grad=True)` differentiates one decode step)")
        gen = dict(max_new_tokens=_check_int("max_new_tokens", max_new_tokens, 1, _INT32_MAX),
                   greedy=not do_sample, temperature=_check_float("temperature", temperature),
                   top_k=_check_int("top_k", top_k, 0, _INT32_MAX), top_p=_check_float("top_p", top_p),
                   seed=_check_int("seed", seed, 0, _UINT64_MAX),
                   eos_token_id=None if eos_token_id is None else _check_int("eos_token_id", eos_token_id, -1, _INT32_MAX))
        if forced_tokens is not None:
            forced = np.asarray(forced_tokens, dtype=object)
            rows = forced.tolist() if forced.ndim == 2 else [list(forced_tokens)]
            forced_tokens = _check_rows(rows, "forced token id")
        tracer = Tracer(self, "generate", inputs, saves=saves, edits=edits, forced_tokens=forced_tokens,
                        inputs_embeds=inputs_embeds, attention_mask=attention_mask, **gen)
        if forced_tokens is None:  # teacher forcing runs as many steps as there are forced tokens
            _check_steps_reachable(tracer._saves, gen["max_new_tokens"], "save")
            _check_steps_reachable(tracer._edits, gen["max_new_tokens"], "edit")
        return tracer

    def _input_args(self, inputs, inputs_embeds, attention_mask, continuation: bool = False) -> tuple:
        """(token rows, embeds or None, mask list) for the core's run / forward."""
        if inputs_embeds is None:
            if inputs is None:
                raise InputError("give inputs (a prompt, prompts or token ids) or inputs_embeds")
            rows, mask, _ = _ids_input(self, inputs, attention_mask)
            if continuation and mask:
                raise InputError(_NO_MASK_WITH_CACHE)
            return rows, None, mask
        if inputs is not None:
            raise InputError("give inputs (text / token ids) or inputs_embeds, not both")
        arr, mask, _ = _embeds_input(inputs_embeds, attention_mask)
        if continuation and mask:
            raise InputError(_NO_MASK_WITH_CACHE)
        return [], arr, mask

    def run(self, inputs: Optional[Prompt] = None, saves=None, edits=None, *, inputs_embeds=None,
            attention_mask=None, logits: str = "all") -> dict:
        """One forward with pre-registered saves / edits (no block): {"logits": [B,T,vocab], path: array}.
        ``inputs_embeds`` / ``attention_mask`` as in :meth:`trace`. ``logits="last"``: ``[B,1,vocab]``, the LM head
        run on the last position only (a saved ``logits`` still gets every position). Ctrl-C stops it between
        layers."""
        specs = _save_specs(saves)
        all_logits = _all_logits(logits)
        rows, embeds, mask = self._input_args(inputs, inputs_embeds, attention_mask)
        edit_specs = _edit_specs(edits, self._output)
        # A save or edit of a step other than 0 is refused by the core before it runs.
        logits, saved = self._core.run(rows, specs, edit_specs, embeds, mask, all_logits)
        out = {"logits": to_plain(logits, self._output)}
        out.update({_STEP_KEY.match(k).group("path"): to_plain(v, self._output) for k, v in saved.items()})
        return out

    def token_mixing(self, inputs: Prompt, layer: int, *, rows=None, cols=None, heads=None,
                     attention_mask=None) -> dict:
        """Exact token-to-token mixing of ``layers[layer].linear_attn`` over a fresh prompt, by block
        (docs/values.md "token_mixing"; the C++ ``mixlens::token_mixing``): ``{"mixing": [B,h,r,c], "skip":
        [B,r,h,P], "skip_meaning": str}`` with ``attention_head_outputs[:, rows, heads] = mixing @ values +
        skip`` (all columns). ``rows`` / ``cols`` (tokens) and ``heads``: a ``slice`` (step 1), an int, or
        None (all), so a long prompt never holds ``[B,H,T,T]`` at once. Per-channel kinds (Mamba-1, RG-LRU,
        short conv, RWKV-4): heads are channels, values ``[B,T,channels]`` read as ``[B,T,channels,1]``.
        UnsupportedError for a block without a recurrent mixer (``support()`` says why)."""
        rows_, mask, _ = _ids_input(self, inputs, attention_mask)
        m, skip, meaning = self._core.token_mixing(rows_, mask, _check_int("layer", layer, 0, self._num_layers - 1),
                                                   _span("rows", rows), _span("cols", cols), _span("heads", heads))
        return {"mixing": to_plain(m, self._output), "skip": to_plain(skip, self._output), "skip_meaning": meaning}

    def state_contributions(self, inputs: Prompt, layer: int, t: int, *, cols=None, heads=None,
                            attention_mask=None):
        """``state_after(t)`` of ``layers[layer].linear_attn`` split by source token over a fresh prompt:
        ``[B, h, c, *state]`` (served state layout), entry s what token s wrote that survives to t (0 after
        t and on padding); summed over every s it is the state after t (RG-LRU: its h; RWKV-4: num, den;
        mLSTM: C | n; docs/values.md "Token mixing"). ``cols`` / ``heads`` as in :meth:`token_mixing`; ``t``
        negative counts from the end."""
        rows_, mask, _ = _ids_input(self, inputs, attention_mask)
        return to_plain(self._core.state_contributions(rows_, mask, _check_int("layer", layer, 0, self._num_layers - 1),
                                                       int(t), _span("cols", cols), _span("heads", heads)),
                        self._output)

    def extract(self, inputs, values, out, **kwargs) -> dict:
        """Dataset-scale extraction to sharded safetensors + index.json (resumable; ``ray=True`` for a Ray
        cluster): see :func:`mixlens.extract` for the arguments, docs/extract.md for the layout."""
        return _extract.extract(self, inputs, values, out, **kwargs)

    def new_cache(self, batch: int = 1) -> Cache:
        """An empty cache for `batch` rows, for ``forward`` / ``trace(..., cache=)`` continuations."""
        return Cache(self._core.new_cache(_check_int("batch", batch, 1, _INT32_MAX)))

    def forward(self, inputs: Optional[Prompt] = None, cache: Optional[Cache] = None, saves=None, edits=None, *,
                inputs_embeds=None, logits: str = "all") -> dict:
        """One forward call continuing `cache` (updated in place): {"logits": [B,T,vocab], path: array}.
        Several new tokens over a cached state run the chunked kernel from that state. ``inputs_embeds``
        ``[B,T,hidden]`` instead of ids as in :meth:`trace`. Ctrl-C stops it between layers (the cache is
        then :attr:`Cache.broken` until ``cache.restore(snapshot)`` rolls it back). ``logits="last"`` as in :meth:`run`."""
        all_logits = _all_logits(logits)
        if not isinstance(cache, Cache):
            raise InputError("forward needs cache= (a mixlens Cache from model.new_cache)")
        if cache._busy:
            raise InputError("this cache is in use by an open trace")
        specs, step = _save_specs(saves), cache.steps
        rows, embeds, _ = self._input_args(inputs, inputs_embeds, None, continuation=True)
        edit_specs = _edit_specs(edits, self._output)
        logits, saved = self._core.forward(rows, cache._core, specs, edit_specs, all_logits, embeds)
        _check_saved_steps(specs, [step])
        _check_saved_steps(edit_specs, [step], "edit")
        out = {"logits": to_plain(logits, self._output)}
        out.update({_STEP_KEY.match(k).group("path"): to_plain(v, self._output) for k, v in saved.items()})
        return out


def _span(name: str, s) -> tuple:
    """A slice / int / None as the core's (begin, end) range (end 2**63 - 1: to the end, mixlens::kSpanEnd)."""
    end = 2**63 - 1
    if s is None:
        return (0, end)
    if isinstance(s, (int, np.integer)) and not isinstance(s, bool):
        return (int(s), end if int(s) == -1 else int(s) + 1)
    if isinstance(s, slice) and s.step in (None, 1):
        return (0 if s.start is None else int(s.start), end if s.stop is None else int(s.stop))
    raise InputError(f"{name}: give a slice with step 1, an int or None, got {s!r}")


def default_model_path() -> str:
    """The model loaded when no path is given (same rule as the ``mixlens`` CLI and the C++
    ``mixlens::default_model_path()``): ``$MIXLENS_MODEL`` when set, else the Mamba-2 shipped in the
    installed package (``mixlens/models/mamba2-tinystories``, package data of the wheel), else the one in
    the repository mixlens was built from (``<repo>/models/mamba2-tinystories``). InputError when none
    exists."""
    env = os.environ.get("MIXLENS_MODEL")
    if env:
        return env
    # Installed from a wheel: the model ships as package data (mixlens/models/mamba2-tinystories).
    candidates = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "mamba2-tinystories")]
    if hasattr(_core, "default_model_path"):
        candidates.append(_core.default_model_path())  # $MIXLENS_MODEL unset: the compiled-in repo path
    # A source checkout on sys.path (python/mixlens -> <repo>/models/...).
    candidates.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models",
                                   "mamba2-tinystories"))
    for c in candidates:
        if os.path.isdir(c):
            return os.path.normpath(c)
    raise InputError("no model given and no default: pass a checkpoint folder or hub id, or set $MIXLENS_MODEL "
                     f"(the shipped model was looked for at {', '.join(map(os.path.normpath, candidates))})")


def load(path_or_hub_id: Optional[str] = None, **kwargs) -> StandardizedTransformer:
    """Same as ``StandardizedTransformer(path_or_hub_id, **kwargs)``; with no path,
    :func:`default_model_path` (``$MIXLENS_MODEL``, else the shipped ``models/mamba2-tinystories``)."""
    return StandardizedTransformer(path_or_hub_id, **kwargs)
