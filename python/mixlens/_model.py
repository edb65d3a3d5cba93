"""The nnsight / nnterp-style front end over the C++ Session (see the package docstring)."""

from __future__ import annotations

import contextvars
import os
import re
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np

from . import _core, hub
from ._convert import (ValueArray, as_float32, is_torch, released_error, resolve_output, to_output, to_plain,
                       value_tensor_class, mount_tensor_save, unmount_tensor_save)
from . import _inplace
from ._inplace import _Live, released_value_tensor_class
from . import _invoke, _nnterp
from ._args import IndexInputError, as_index as _as_index, check_bool as _check_bool, check_float as _check_float
from ._args import index_list as _index_list, index_slice as _index_slice
from ._args import check_int as _check_int, check_strs as _check_strs
from .errors import InputError, MixlensError, UnknownAttributeError, UnknownValueError, UnsupportedError, WriteError

__all__ = ["StandardizedTransformer", "Tracer", "ValueArray", "Cache", "Tokenizer", "load", "default_model_path"]

_ALL_STEPS = (0, 2**31 - 1)
_INT32_MAX = 2**31 - 1
_UINT64_MAX = 2**64 - 1
_STEP_KEY = re.compile(r"^(?P<path>.+)@step(?P<step>\d+)$")

Prompt = Union[str, Sequence[int], Sequence[str], Sequence[Sequence[int]], np.ndarray]

# The tracers this thread / asyncio context opened (weak references): a read goes to the model's open
# trace only from the context that opened it. New threads start with an empty context.
_OPENED: contextvars.ContextVar[tuple] = contextvars.ContextVar("mixlens_opened_tracers", default=())
_core.value_attr_env(_OPENED, UnknownValueError, UnknownAttributeError)  # what envoy reads check in C


def _to_numpy(x: Any) -> np.ndarray:
    """numpy view of an array-like; torch tensors (any device, requires_grad) are detached to CPU first."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu()
        if hasattr(x, "float") and getattr(x, "is_floating_point", lambda: False)():
            x = x.float()
        x = x.numpy()
    return np.asarray(x)


def _embeds_input(inputs_embeds: Any, attention_mask: Any) -> tuple[np.ndarray, list, bool]:
    """inputs_embeds as a C-contiguous float32 [B,T,hidden] array (a [T,hidden] array is one prompt), the
    attention mask flattened to 0/1 ints ([] = all ones), and whether the input was a single prompt."""
    try:
        arr = _to_numpy(inputs_embeds)
    except ValueError as e:
        raise InputError(f"inputs_embeds is not a rectangular array ({e})") from None
    if arr.dtype.kind not in "fiu":
        raise InputError(f"inputs_embeds must be a float array [batch, seq, hidden], got dtype {arr.dtype}")
    single = arr.ndim == 2
    if single:
        arr = arr[None]
    if arr.ndim != 3:
        raise InputError(f"inputs_embeds must be [batch, seq, hidden] (or [seq, hidden]), got shape {arr.shape}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    mask = [] if attention_mask is None else _mask_list(
        attention_mask, arr.shape[:2], single, f"inputs_embeds {arr.shape} needs {arr.shape[:2]}")
    return arr, mask, single


def _mask_list(attention_mask: Any, shape: tuple, single: bool, needs: str) -> list:
    """A 0/1 attention mask of `shape` ([B,T]; [T] too for a single prompt) flattened to ints, checked before
    the uint8 conversion (which would wrap 256 to 0). `needs` ends the wrong-shape message."""
    m = _to_numpy(attention_mask)
    if single and m.ndim == 1:
        m = m[None]
    if m.shape != tuple(shape):
        raise InputError(f"attention_mask has shape {m.shape}; {needs}")
    if not np.isin(m, (0, 1)).all():
        raise InputError("attention_mask entries must be 0 or 1")
    return m.astype(np.uint8).ravel().tolist()


def _ids_input(model: "StandardizedTransformer", inputs: Any, attention_mask: Any) -> tuple[list, list, bool]:
    """Token rows, the flattened 0/1 attention mask ([] = the rows are padded here) and whether the input was
    a single prompt. `inputs` may be a tokenizer's output (a dict / BatchEncoding with ``input_ids`` and
    optionally ``attention_mask``); an `attention_mask` marks a batch the caller already left-padded, whose ids
    at padded positions are kept (transformers' ``input_ids`` + ``attention_mask``)."""
    if isinstance(inputs, Mapping):
        extra = sorted(set(inputs) - {"input_ids", "attention_mask"})
        if "input_ids" not in inputs or extra:
            raise InputError("a dict input takes a tokenizer's input_ids and optionally attention_mask; got keys "
                             f"{sorted(inputs)}")
        if attention_mask is not None and "attention_mask" in inputs:
            raise InputError("attention_mask given twice: in the input dict and as an argument")
        if attention_mask is None:
            attention_mask = inputs.get("attention_mask")
        inputs = inputs["input_ids"]
    rows, single = model._rows(inputs)
    if attention_mask is None:
        return rows, [], single
    if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], str)):
        raise InputError("attention_mask goes with token ids: text is tokenized and left-padded for you")
    lengths = sorted({len(r) for r in rows})
    # Ragged rows match no [B,T] shape: (B, -1) makes the mask check say so.
    shape = (len(rows), lengths[0] if len(lengths) == 1 else -1)
    return rows, _mask_list(attention_mask, shape, single, "token ids of a padded batch need one [B,T] mask of the "
                            f"ids' shape (rows of lengths {lengths})"), single


def _all_logits(logits: Any) -> bool:
    """``logits="all"`` (every position, [B,T,vocab]: the default) or ``"last"`` ([B,1,vocab]: the LM head runs
    on the last position only, unless ``logits`` is saved or read, which still get every position)."""
    if logits == "all":
        return True
    if logits == "last":
        return False
    raise InputError(f"logits={logits!r}: use 'all' (every position, [B,T,vocab]) or 'last' ([B,1,vocab])")


def _check_rows(rows: list, what: str = "token id") -> list:
    """Token-id rows as lists of ints within int32 (ids beyond the vocabulary are reported by the core,
    which knows it)."""
    out = []
    for r, row in enumerate(rows):
        ids = []
        for k, t in enumerate(row):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise InputError(f"{what} at row {r}, position {k} must be an integer, got {t!r} ({type(t).__name__})")
            v = int(t)
            if not 0 <= v <= _INT32_MAX:
                raise InputError(f"{what} {v} at row {r}, position {k} is out of range: ids are in [0, vocab_size)")
            ids.append(v)
        out.append(ids)
    return out


def _released_error(step: int, path: str):
    return released_error((step, path))


def _torch_from_dlpack():
    """DLPack capsule -> torch tensor: torch's C entry point (no Python frame per value), else its public
    wrapper (which takes capsules too)."""
    import torch

    fn = getattr(torch._C, "_from_dlpack", None)
    if fn is None:
        from torch.utils.dlpack import from_dlpack as fn
    return fn


def _as_value(arr: Optional[np.ndarray], fmt: str = "numpy"):
    return to_output(arr, fmt)


_as_float32 = as_float32  # the write conversion (torch / numpy / scalars): mixlens._convert


def _steps_of(key: str) -> tuple[str, int, int]:
    """'path' -> every step; 'path@step3' -> step 3 only."""
    m = _STEP_KEY.match(key)
    if m:
        step = int(m.group("step"))
        return m.group("path"), step, step
    return key, *_ALL_STEPS


def _save_specs(saves: Optional[Iterable[str]]) -> list:
    return [_steps_of(s) for s in _check_strs("saves", saves, allow_none=True) or []]


def _check_saved_steps(specs: list, ran: Iterable[int], what: str = "save") -> None:
    """InputError for a save or edit of one step (``path@stepK``) the run never made: the save would
    silently be absent, the edit silently not applied. `specs`: (path, first, last, ...) tuples."""
    ran = sorted(set(ran))
    for path, first, last, *_ in specs:
        if (first, last) != _ALL_STEPS and first not in ran:
            if not ran:
                made = "no step"
            elif len(ran) > 1 and ran == list(range(ran[0], ran[-1] + 1)):
                made = f"steps {ran[0]}..{ran[-1]}"
            else:
                made = ("steps " if len(ran) > 1 else "step ") + ", ".join(map(str, ran))
            raise InputError(f"{what} '{path}@step{first}': the run never made step {first} (it ran {made})")


def _check_steps_reachable(specs: list, max_new_tokens: int, what: str) -> None:
    """Before generating: a save or edit at a step past the last one max_new_tokens allows is refused now
    rather than after the whole generation."""
    for path, first, last, *_ in specs:
        if (first, last) != _ALL_STEPS and first >= max_new_tokens:
            raise InputError(f"{what} '{path}@step{first}': generate(max_new_tokens={max_new_tokens}) never makes step "
                             f"{first} (it runs steps 0..{max_new_tokens - 1}; step 0 is the prompt)")


def _edit_specs(edits: Union[None, Mapping[str, Any], Iterable[tuple]], fmt: str = "numpy") -> list:
    """{path[@stepK]: array or callable(value) -> value | None} or [(path, value), ...]. A callable gets the
    value in the model's output format; editing it in place and returning None applies the edit."""
    if edits is None:
        return []
    if isinstance(edits, (str, bytes)) or not isinstance(edits, (Mapping, Iterable)):
        raise InputError(f"edits must be a dict {{path: value or function}}, got {type(edits).__name__}")
    items = edits.items() if isinstance(edits, Mapping) else edits
    specs = []
    for item in items:
        if isinstance(item, (str, bytes)) or not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InputError(f"edits must be a dict {{path: value or function}} or (path, value) pairs, got the "
                             f"entry {item!r}")
        key, value = item
        if not isinstance(key, str):
            raise InputError(f"an edit's path must be a string, got {key!r} ({type(key).__name__})")
        path, first, last = _steps_of(key)
        if callable(value):
            fn = value

            def call(v, fn=fn, path=path):
                val = to_output(v, fmt)
                rec = None if val is None else _Live(0, path, val, fmt == "torch")
                out = fn(val)
                if out is None:
                    return None if rec is None or not rec.modified() else as_float32(val, path)
                return as_float32(out, path)

            specs.append((path, first, last, call))
        else:
            arr = as_float32(value, path)
            if np.ndim(value) == 0:  # a scalar fills the value, as an assignment in the `with` block does
                specs.append((path, first, last,
                              lambda v, x=float(arr[0]): None if v is None else np.full(np.shape(v), x, np.float32)))
            else:
                specs.append((path, first, last, arr))
    return specs


def _generic_reason(reason: str, layer: int) -> str:
    """'block 3 ... layers.3.x' -> 'block {i} ... layers.{i}.x' so per-block reasons can be compared."""
    return re.sub(rf"(?<![\w.]){layer}(?![\w])|(?<=layers\.){layer}(?=\.)", "{i}", reason)


class Tokenizer:
    """The checkpoint's tokenizer.json, run natively (matches HF ``tokenizers``)."""

    def __init__(self, core: "_core.Model"):
        self._core = core

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (HF ``Tokenizer.encode(text).ids``). TokenizerError without tokenizer.json;
        InputError for text that is not valid Unicode (a lone surrogate such as '\\ud800') or not a string."""
        if not isinstance(text, str):
            raise InputError(f"encode takes one string, got {text!r} ({type(text).__name__})")
        add_special_tokens = _check_bool("add_special_tokens", add_special_tokens)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            # nanobind cannot convert it and would raise a TypeError about the argument types.
            raise InputError(f"text is not valid Unicode: {e.reason} at character {e.start} "
                             f"({text[e.start:e.end]!r}); it cannot be encoded as UTF-8") from None
        return self._core.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids: a list / array / 1-d tensor of ids, or one id (as HF's tokenizers)."""
        try:
            ids = [_as_index(ids)]
        except TypeError:
            if is_torch(ids) or isinstance(ids, np.ndarray):
                ids = ids.tolist()
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
                raise InputError(f"decode takes token ids (a list of ints, or one int), got {type(ids).__name__}") from None
        return self._core.decode(_check_rows([list(ids)])[0], _check_bool("skip_special_tokens", skip_special_tokens))

    def token_to_id(self, token: str) -> Optional[int]:
        if not isinstance(token, str):
            raise InputError(f"token_to_id takes a token string, got {token!r} ({type(token).__name__})")
        return self._core.token_to_id(token)

    def id_to_token(self, id: int) -> str:
        return self._core.id_to_token(_check_int("token id", id, 0, _INT32_MAX))

    @property
    def vocab_size(self) -> int:
        return self._core.tokenizer_vocab_size


class Cache:
    """Recurrent state of a batch between forward calls (``model.new_cache``): conv windows and SSM
    states per layer. ``model.forward(ids, cache=...)`` and ``model.trace(ids, cache=...)`` continue it."""

    def __init__(self, core_cache: "_core.Cache"):
        self._core = core_cache
        self._busy = False

    @property
    def batch(self) -> int:
        return self._core.batch

    @property
    def seen_tokens(self) -> int:
        return self._core.seen_tokens

    @property
    def steps(self) -> int:
        """Forward calls made with this cache: the step index of the next call."""
        return self._core.steps

    @property
    def broken(self) -> str:
        """``''`` while the cache is consistent; otherwise why not: a call over it stopped midway (an exception
        in its ``with`` block, ``tracer.stop()``, a WriteError / NumericError raised mid-forward, Ctrl-C), so
        the layers it reached hold tokens that ``seen_tokens`` / ``steps`` do not count. Such a cache refuses
        to be continued or copied (InputError) until ``restore(snapshot)``. Inputs refused before the
        forward starts leave it consistent. (C++ ``Cache::broken``.)"""
        return self._core.broken

    def copy(self) -> "Cache":
        """A snapshot: an independent deep copy of everything the next call reads (conv windows, recurrent
        states, attention KV entries, position and step counters), bitwise. ``copy.copy(cache)`` and
        ``copy.deepcopy(cache)`` do the same (a cache is never aliased). InputError while an open trace
        is running over this cache, or when it is :attr:`broken`."""
        if self._busy:
            raise InputError("cannot copy this cache: an open trace is running over it (copy it before or after the block)")
        return Cache(self._core.copy())

    __copy__ = copy

    def __deepcopy__(self, memo) -> "Cache":
        return self.copy()

    def restore(self, snapshot: "Cache") -> None:
        """Rollback: make this cache bitwise equal to `snapshot` (a :meth:`copy` of a cache of the same model
        and batch size); the snapshot is unchanged and can be restored again. Decoding a wrong tail,
        restoring, then decoding the right tail equals never having seen the wrong tail. Clears
        :attr:`broken`; InputError when the snapshot is itself broken."""
        if not isinstance(snapshot, Cache):
            raise InputError(f"restore takes a mixlens Cache (from cache.copy()), got {type(snapshot).__name__}")
        if self._busy:
            raise InputError("cannot restore this cache: an open trace is running over it")
        self._core.restore(snapshot._core)

    def __repr__(self) -> str:
        return f"mixlens.Cache(batch={self.batch}, seen_tokens={self.seen_tokens}, steps={self.steps})"


# ---- envoys: attribute access that reads / writes through the active tracer -------------------


# A call over a cache (even a fresh one) continues every row's stream token for token: no padding.
_NO_MASK_WITH_CACHE = ("attention_mask cannot pad a call over a cache (cache=...): each row of a cache, a fresh one "
                       "included, continues its own stream token for token. Run prompts of different lengths "
                       "without cache= (trace / generate left-pad them), or give each prompt its own cache "
                       "(model.new_cache(1))")
_STATE_METHODS = ("state", "state_after", "set_state_after")


def _envoy_fallback(envoy, name: str):
    return _Envoy.__getattr__(envoy, name)


def _value_attr(name: str):
    """``envoy.<name>`` for a value of the envoy's prefix: the per-value path of a `with` block (issue 9
    item 5). A class attribute rather than ``__getattr__``, whose failed lookup first builds an
    AttributeError (~1.5 us a read), and a descriptor in C (``_core.value_attr``, no Python frame): when
    the model's open tracer was entered in this very context, is running and keeps no grad record, it
    calls the session's read_value with the envoy's ``_paths[name]``; anything else goes to
    ``_Envoy.__getattr__``'s full path (which raises or routes it)."""
    return _core.value_attr(name, _envoy_fallback)


# (envoy class, value names) -> its subclass with one descriptor per value name.
_ENVOY_CLASSES: dict = {}


def _envoy_class(cls: type, names: tuple) -> type:
    key = (cls, names)
    sub = _ENVOY_CLASSES.get(key)
    if sub is None:
        attrs: dict = {"__slots__": (), "__module__": cls.__module__, "__doc__": cls.__doc__}
        for n in names:
            if not hasattr(cls, n):  # never shadow a method or property of the envoy itself
                attrs[n] = _value_attr(n)
        sub = _ENVOY_CLASSES[key] = type(cls.__name__, (cls,), attrs)
    return sub


class _Envoy:
    """Reads and writes ``<prefix><name>`` through the model's open tracer. An instance's class is a
    subclass (``_envoy_class``) with a descriptor per value name of its prefix (``_value_attr``), and
    ``_paths`` holds each name's full path, so a read does no string work."""

    __slots__ = ("_model", "_prefix", "_paths")

    def __new__(cls, model: Optional["StandardizedTransformer"] = None, prefix: str = "", *args, **kwargs):
        if model is None:  # copy / pickle protocols make the object first, then set its slots
            return object.__new__(cls)
        paths = model._paths_under(prefix)
        obj = object.__new__(_envoy_class(cls, tuple(sorted(paths))))
        object.__setattr__(obj, "_paths", paths)
        return obj

    def __init__(self, model: "StandardizedTransformer", prefix: str):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        # The per-value path (issue 9 item 5): state methods are the only names looked at first.
        if name in _STATE_METHODS and self._prefix.endswith("linear_attn."):
            if not self._model._known(self._prefix + "states"):
                self._no_state(name)
            if name == "state_after":
                return self._state_after
            if name == "set_state_after":
                return self._set_state_after
            return self._model._read(self._state_path(self._current_token("read")))
        path = self._prefix + name
        model = self._model
        ref = model._open
        t = ref() if ref is not None else None
        if (t is None or t._session is None) and not model._known(path):
            names = ", ".join(self._names()) or "none"
            raise UnknownAttributeError(f"'{path}' is not a value of this model (values here: {names})")
        try:
            return model._read(path)
        except UnknownAttributeError:
            raise
        except UnknownValueError as e:  # also an AttributeError, so hasattr() answers False
            raise UnknownAttributeError(str(e)) from None

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("_"):
            raise AttributeError(f"cannot set {name!r} on {self._prefix.rstrip('.')}")
        if name == "state" and self._prefix.endswith("linear_attn."):
            if not self._model._known(self._prefix + "states"):
                self._no_state(name)
            self._model._write(self._state_path(self._current_token("write")), value)
            return
        self._model._write(self._prefix + name, value)

    # -- per-token state (docs/values.md "Per-token state") ------------------------------------
    def _no_state(self, name: str) -> None:
        """Raises for a per-token state name on a block without a recurrent state (a hybrid's attention or
        MLP block), with support()'s reason for that block rather than an unknown-name guess."""
        layer = self._prefix.split(".")[1]
        reason = None
        if layer.isdigit() and int(layer) < self._model.num_layers:
            reason = self._model.support(layer=int(layer)).get("linear_attn." + name)
        raise UnknownAttributeError(f"'{self._prefix}{name}': " + (reason or "this model has no per-token state here"))

    def _state_path(self, t: int) -> str:
        return f"{self._prefix}state@t{t}"

    def _current_token(self, verb: str) -> int:
        tr = self._model._open_tracer()
        if tr is None or tr._token is None:
            raise InputError(f"cannot {verb} '{self._prefix}state' here: it is the state after the current token of "
                             "`for t in tracer.iter[...]` inside `with model.trace(...)`; elsewhere use "
                             "state_after(t) / set_state_after(t, value), or states")
        return tr._token

    def _state_after(self, t: int) -> "ValueArray":
        """The state after token `t` of the current call (negative counts from the end), served key side
        first: ``[B, ...]`` as ``state_output`` (Mamba-2 ``[B,heads,state_dim,head_dim]``, Mamba-1
        ``[B,d_inner,state_dim]``, gated DeltaNet ``[B,HV,Dk,Dv]``), float32, computed on the side from the
        state entering t's chunk (no token loop; nothing else in the call changes). Read inside a trace;
        a layer's tokens go in increasing order (OutOfOrderError otherwise); after the layer's ``states``
        it is its row. Equals ``states[:, t]`` exactly (and ``state_output`` at the last token)."""
        t = _check_int("t", t, -_INT32_MAX, _INT32_MAX)
        return self._model._read(self._state_path(t))

    def _set_state_after(self, t: int, value) -> None:
        """Replace the state after token `t` (shape and dtype as ``state_after(t)``); tokens t+1.. continue
        from it: their values, ``states``, ``state_output``, the logits and the cache follow. WriteError on
        a wrong shape / NaN. Writes at several tokens of one layer go in increasing token order, before the
        layer's ``states`` is read (which then holds the written states)."""
        t = _check_int("t", t, -_INT32_MAX, _INT32_MAX)
        self._model._write(self._state_path(t), value)

    def _names(self) -> list[str]:
        """Value names under this prefix, from the model's values for this very layer (hybrids differ)."""
        p = self._prefix
        names = {path[len(p):] for path in self._model._paths() if path.startswith(p)}
        if "states" in names and p.endswith("linear_attn."):
            names |= {"state", "state_after", "set_state_after"}
        return sorted(names)

    def __dir__(self):
        return self._names()

    def __repr__(self) -> str:
        return f"<mixlens {self._prefix.rstrip('.')}: {', '.join(self._names())}>"


class _Layer(_Envoy):
    """``model.layers[i]``: ``layer_input``, ``layer_output`` (residual stream, ``[B,T,hidden]``) and the
    components ``linear_attn`` (recurrent mixer), ``self_attn`` (attention of a hybrid), ``mlp``."""

    # The components are made with the layer and sit in its __dict__: ``layer.linear_attn`` is a plain
    # attribute lookup, no Python call (issue 9 item 5).
    __slots__ = ("__dict__",)

    def __init__(self, model: "StandardizedTransformer", prefix: str):
        super().__init__(model, prefix)
        d = self.__dict__
        for name in ("linear_attn", "self_attn", "mlp"):
            d[name] = _Envoy(model, f"{prefix}{name}.")

    def _names(self) -> list[str]:
        return sorted({n.split(".")[0] for n in super()._names()})


class LayerIndexError(IndexInputError):
    """``model.layers[i]`` past the last layer: an InputError, and an IndexError so that iteration and
    ``except IndexError`` work as for a list."""


class _Layers(Sequence):
    def __init__(self, model: "StandardizedTransformer"):
        self._model = model
        self._items: list = [None] * model.num_layers  # the _Layer of each index, made on first use

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):
        if type(i) is int:  # the per-value path (issue 9 item 5): a cached envoy, negatives as lists do
            try:
                layer = self._items[i]
            except IndexError:
                raise LayerIndexError(f"layer {i} out of range (the model has {len(self._items)} layers)") from None
            if layer is not None:
                return layer
        n = len(self)
        try:
            if isinstance(i, slice):
                return [self[j] for j in range(*_index_slice(i).indices(n))]
            j = _as_index(i)
        except TypeError:
            raise InputError(f"model.layers[{i!r}]: a layer index is an integer or a slice of integers, got "
                             f"{type(i).__name__}") from None
        except ValueError as e:  # slice step 0
            raise InputError(f"model.layers[{i!r}]: {e}") from None
        j = j + n if j < 0 else j
        if not 0 <= j < n:
            raise LayerIndexError(f"layer {i} out of range (the model has {n} layers)")
        layer = self._items[j]
        if layer is None:
            layer = self._items[j] = _Layer(self._model, f"layers.{j}.")
        return layer


class _LayerValue:
    """nnterp's ``model.layers_output[i]`` / ``model.layers_input[i]`` / ``attentions_output[i]`` /
    ``mlps_output[i]`` (read and assign by layer index). `name` is the value's path under ``layers.{i}.``,
    or a function of the layer index giving it (the mixer's path depends on the block's kind)."""

    def __init__(self, model: "StandardizedTransformer", name):
        self._model, self._name = model, name
        self._paths: list = [None] * model.num_layers  # each layer's path, made on first use

    def __len__(self) -> int:
        return len(self._paths)

    def _path(self, i: int) -> str:
        if type(i) is int:  # the per-value path: no string work for a layer read before
            try:
                path = self._paths[i]
            except IndexError:
                path = None
            if path is not None:
                return path
        n = len(self._paths)
        i = _check_int("layer", i, -n, n - 1)
        i = i + n if i < 0 else i
        name = self._name(i) if callable(self._name) else self._name
        path = self._paths[i] = f"layers.{i}.{name}"
        return path

    def __getitem__(self, i: int):
        return self._model._read(self._path(i))

    def __setitem__(self, i: int, value) -> None:
        self._model._write(self._path(i), value)


# ---- tracer ------------------------------------------------------------------------------------


def _iter_key(key) -> Union[slice, list]:
    """``tracer.iter[key]``'s key as a slice of int bounds or a list of ints: an integer (numpy / 0-d tensor
    too), a slice of integers (step not 0), or a sequence of integers; InputError for anything else."""
    what = "tracer.iter[...] takes an integer, a slice of integers or a list of integers"
    try:
        out = _index_slice(key) if isinstance(key, slice) else _index_list(key)
    except TypeError:
        raise InputError(f"{what}, got {key!r} ({type(key).__name__})") from None
    if isinstance(out, slice) and out.step == 0:
        raise InputError("tracer.iter[...]: a slice step cannot be zero")
    return out


class _StepLoop:
    """``tracer.iter[...]``: in a generation, iterating yields step indices and reads inside the loop body
    use that step; in a ``trace`` (one forward call) it yields the call's token indices and
    ``linear_attn.state`` in the body is the state after that token."""

    def __init__(self, tracer: "Tracer", key):
        self._tracer, self._key = tracer, _iter_key(key)

    def _tokens(self) -> Iterator[int]:
        tr = self._tracer
        tr._require_session()
        seq = max(len(r) for r in tr._rows)
        key = self._key
        if isinstance(key, slice):
            tokens: Iterable[int] = range(*key.indices(seq))
        else:
            tokens = [k + seq if k < 0 else k for k in key]
        try:
            for t in tokens:
                if not 0 <= t < seq:
                    raise InputError(f"tracer.iter: token {t} is out of range for a call of {seq} tokens")
                tr._token = t
                yield t
        finally:
            tr._token = None

    def __iter__(self) -> Iterator[int]:
        tr = self._tracer
        if _invoke.current() is not None:
            raise InputError("tracer.iter inside an invoke: invoke bodies read and write the first step only")
        if tr._kind == "trace":
            yield from self._tokens()
            return
        sess = tr._require_session()
        first, last = sess.first_step, sess.last_step
        key = self._key
        if isinstance(key, slice):
            start, stop, stride = key.indices(last - first + 1)
            steps: Iterable[int] = (first + k for k in range(start, stop, stride))
        else:
            steps = [first + (k if k >= 0 else last - first + 1 + k) for k in key]
        for step in steps:
            if step > last:
                break
            # reach_step applies pending in-place edits first (a new step).
            if not sess.reach_step(step):  # the generation ended (EOS) before this step
                break
            tr._step = step
            sess.set_reader(None if tr._grad else tr._ctx, step)
            yield step


class _StepIndexer:
    def __init__(self, tracer: "Tracer"):
        self._tracer = tracer

    def __getitem__(self, key) -> _StepLoop:
        return _StepLoop(self._tracer, key)

    def __iter__(self) -> Iterator[int]:
        return iter(_StepLoop(self._tracer, slice(None)))


class _StopTrace(Exception):
    """Raised by :meth:`Tracer.stop` and swallowed by that tracer's ``with`` block."""

    def __init__(self, tracer: "Tracer"):
        super().__init__("tracer.stop() outside its own `with` block")
        self.tracer = tracer


class Tracer:
    """The object of ``with model.trace(...) as tracer`` / ``with model.generate(...) as tracer``.

    Inside the block, ``model.<...>`` reads run the forward (C++, on this thread)
    reaches the value, and assignments replace it before it is consumed. Reads and writes go in
    forward order (``model.values()``); going back raises :class:`mixlens.OutOfOrderError`.

    ``tracer.invoke(prompt)`` (trace / generate opened without inputs) batches several prompts, each with its
    own reads and writes, into one forward; ``tracer.stop()`` ends the block without running the rest;
    ``tracer.attention_mask`` / ``tracer.input_ids`` give the left-padded batch.

    After the block: ``tracer.logits`` (trace: ``[B,T,vocab]``; teacher-forced generate: one array per
    step), ``tracer.tokens`` / ``tracer.text`` (generate: the new tokens / their text, per prompt, or a
    single list / str for a single prompt), ``tracer.saved`` (pre-registered ``saves``), ``tracer.calls``
    (kernel and length of every forward call).
    """

    def __init__(self, model: "StandardizedTransformer", kind: str, inputs: Optional[Prompt], *,
                 cache: Optional[Cache] = None, saves=None, edits=None, forced_tokens=None, inputs_embeds=None,
                 attention_mask=None, grad: bool = False, logits: str = "all", **gen):
        self._session = None  # first: __del__ looks at it even when __init__ raised
        self._save_mounted = False  # torch.Tensor.save mounted by this trace (_convert.mount_tensor_save)
        self._grad = bool(grad)
        self._grad_session = None  # the finished session whose trace holds the gradient record
        self._grad_reads: list = []  # (path, value) read in the block, given .grad by backward()
        self._logits_leaf = None
        self._full_logits = None  # grad trace: every position's logits once formed (_grad_logits)
        self._all_logits = _all_logits(logits)
        if self._grad and not self._all_logits:
            raise InputError("grad=True needs logits='all': backward takes dMetric/dLogits at every position")
        self._holds_model = False
        self._model = model
        self._kind = kind
        self._embeds, self._mask = None, []
        if inputs_embeds is not None:
            if inputs is not None:
                raise InputError("give inputs (text / token ids) or inputs_embeds, not both")
            if forced_tokens is not None:
                raise InputError("forced_tokens takes token-id prompts, not inputs_embeds")
            self._embeds, self._mask, self._single = _embeds_input(inputs_embeds, attention_mask)
            if cache is not None and self._mask:
                raise InputError(_NO_MASK_WITH_CACHE)
            self._rows: list = []
        elif inputs is None:
            # No inputs: the prompts come from tracer.invoke(...) blocks, batched when the block ends.
            if attention_mask is not None:
                raise InputError("attention_mask goes with the inputs of trace(...) / generate(...): the prompts of "
                                 "tracer.invoke(...) are left-padded for you")
            self._rows, self._single = [], False
        else:
            self._rows, self._mask, self._single = _ids_input(model, inputs, attention_mask)
            if self._mask and cache is not None:
                raise InputError(_NO_MASK_WITH_CACHE)
            if self._mask and forced_tokens is not None:
                raise InputError("forced_tokens takes unpadded token-id prompts, not an attention_mask")
        if cache is not None and not isinstance(cache, Cache):
            raise InputError(f"cache must be a cache of this model (model.new_cache(batch)), got {type(cache).__name__}")
        self._cache = cache
        self._saves = _save_specs(saves)
        self._fmt = model._output
        self._edits = _edit_specs(edits, self._fmt)
        self._forced = forced_tokens
        self._gen = gen
        self._step = 0
        self._token: Optional[int] = None  # the token of `for t in tracer.iter[...]` in a trace
        self._result: Optional[dict] = None
        self._calls: list = []
        self._owner_thread = None
        self._opened_token = None
        self._ctx: Optional[tuple] = None  # _OPENED's value in the context that entered (while open)
        self._deferred = inputs is None and inputs_embeds is None
        self._deferred_open = False
        self._invokes: list = []
        self._stopped = False
        self._shapes: dict = {}

    # -- context manager -------------------------------------------------------------------
    def __enter__(self) -> "Tracer":
        if self._deferred:
            if self._deferred_open or self._result is not None:
                raise InputError("this tracer was already entered; make a new one with model.trace() / model.generate()")
            if self._cache is not None or self._forced is not None:
                raise InputError("tracer.invoke batches fresh prompts: no cache= or forced_tokens= with invokes")
            self._deferred_open = True  # the invoke bodies are captured now and run when the block ends
            self._model._deferred_tracer = weakref.ref(self)
            return self
        return self._enter_session()

    def _enter_session(self) -> "Tracer":
        m = self._model
        if self._session is not None or self._result is not None:
            raise InputError("this tracer was already entered; make a new one with model.trace(...) / model.generate(...)")
        open_t = m._open_tracer()
        if open_t is not None and (open_t._opened_here() or open_t._owner_thread is threading.current_thread()):
            raise InputError("a trace is already open on this model; finish it before starting another"
                             + ("" if open_t._opened_here() else " (it was opened by another asyncio task / context of "
                                "this thread, which would wait on this one forever)"))
        # One open trace per model: another thread's trace makes this one wait until it ends (documented;
        # a trace entered and never exited is released when it is garbage-collected).
        while not m._trace_lock.acquire(timeout=0.1):
            pass
        self._holds_model = True
        try:
            if self._fmt == "torch":
                self._save_mounted = mount_tensor_save()
            self._start_session()
            # In-place edit bookkeeping of the values read in the block lives in the session binding
            # (python/src/session.cpp; rules in mixlens._inplace).
            if self._fmt == "torch":
                self._session.set_output(value_tensor_class(), _torch_from_dlpack(), _released_error,
                                         released_value_tensor_class(), _inplace.WATCH_LIMIT,
                                         _inplace.WATCH_COPY_LIMIT)
            else:
                self._session.set_output(ValueArray, None, _released_error, None, _inplace.WATCH_LIMIT,
                                         _inplace.WATCH_COPY_LIMIT)
        except BaseException:
            self._release_model()
            raise
        self._step = self._session.first_step
        self._owner_thread = threading.current_thread()
        self._opened_token = _OPENED.set(_OPENED.get() + (weakref.ref(self),))
        self._ctx = _OPENED.get()  # the reads' fast check: this very tuple in the reader's context
        # Envoy reads in C (python/src/session.cpp value_attr_fast) check the session's copy of these.
        self._session.set_reader(None if self._grad else self._ctx, self._step)
        m._open = weakref.ref(self)
        return self

    def _start_session(self) -> None:
        core = self._model._core
        e, mask = self._embeds, self._mask
        if self._kind == "trace" and self._cache is None:
            # grad: the forward forms the last position's logits only; a metric's rows (or, when read, every
            # position's) come from the recorded LM-head input (_grad_logits).
            self._session = _core.session_run(core, self._rows, self._saves, self._edits, e, mask,
                                              self._all_logits and not self._grad, grad=self._grad)
        elif self._kind == "trace":
            if self._cache._busy:
                raise InputError("this cache is in use by another open trace")
            self._session = _core.session_forward(core, self._rows, self._cache._core, self._saves, self._edits,
                                                  self._all_logits and not self._grad, e, grad=self._grad)
            self._cache._busy = True
        elif self._forced is not None:
            self._session = _core.session_teacher_forced(core, self._rows, self._forced, self._saves, self._edits)
        else:
            self._session = _core.session_generate(core, self._rows, saves=self._saves, edits=self._edits, embeds=e,
                                                   mask=mask, **self._gen)

    def _opened_here(self) -> bool:
        """True in the thread / asyncio context that entered this tracer."""
        for r in _OPENED.get():  # a loop, not any(generator): this runs for every value read
            if r() is self:
                return True
        return False

    def _release_model(self) -> None:
        """Forget this tracer as the model's open one and let another trace start (idempotent). The model's
        lock is released whatever interrupts the rest (a KeyboardInterrupt landing here left it held: every
        later trace waited forever)."""
        m = self._model
        try:
            if getattr(self, "_save_mounted", False):
                self._save_mounted = False
                unmount_tensor_save()
            self._ctx = None
            if getattr(self, "_session", None) is not None:
                self._session.set_reader(None, 0)
            if m._open is not None and m._open() in (self, None):
                m._open = None
            token, self._opened_token = self._opened_token, None
            if token is not None:
                try:
                    _OPENED.reset(token)
                except (ValueError, RuntimeError):  # exited in another context: drop it from this one
                    _OPENED.set(tuple(r for r in _OPENED.get() if r() is not self and r() is not None))
        finally:
            if self._cache is not None:
                self._cache._busy = False
            if getattr(self, "_holds_model", False):
                self._holds_model = False
                m._trace_lock.release()

    def invoke(self, inputs: Prompt) -> "_invoke._Invoke":
        """nnsight's ``with tracer.invoke(prompt):`` inside ``with model.trace() as tracer:`` (no inputs) or
        ``model.generate(max_new_tokens=...)``: each invoke adds its prompt(s) to one left-padded batch that
        runs as one forward; reads in its body return its own rows, writes replace them. The bodies run
        when the trace block ends, in forward order across invokes (see :mod:`mixlens._invoke`)."""
        if not self._deferred:
            raise InputError("tracer.invoke: open the trace without inputs (model.trace() / model.generate()) to "
                             "batch invokes")
        if self._session is not None or not self._deferred_open:
            raise InputError("tracer.invoke is used inside its trace's `with` block")
        rows, single = self._model._rows(inputs)
        return _invoke._Invoke(self, rows, single)

    def __exit__(self, exc_type, exc, tb) -> bool:
        stopped = exc_type is not None and issubclass(exc_type, _StopTrace) and exc.tracer is self
        if self._deferred and self._deferred_open:
            self._deferred_open = False
            if exc_type is not None:
                return False
            if not self._invokes:
                raise InputError("model.trace() / model.generate() without inputs needs tracer.invoke(prompt) blocks")
            for inv in self._invokes:
                inv.first_row = len(self._rows)
                self._rows.extend(inv.rows)
            self._enter_session()
            try:
                _invoke.run_invokes(self, self._invokes, None)
            except BaseException as e:
                sess, self._session = self._session, None
                self._calls = sess.calls
                try:
                    sess.close()
                finally:
                    self._release_model()
                if isinstance(e, _StopTrace) and e.tracer is self:  # tracer.stop() inside an invoke
                    self._stopped = True
                    return True
                raise
        sess = self._session
        try:
            if exc_type is None:
                sess.settle()  # in-place edits of the last value read reach the rest of the forward
                self._session = None
                # Step by step, so Ctrl-C (KeyboardInterrupt) is raised between forward calls rather
                # than after the whole generation: each C++ wait blocks with the GIL released.
                for step in range(sess.first_step + 1, sess.last_step + 1):
                    if not sess.reach_step(step):
                        break
                result = sess.finish()
                self._calls = sess.calls
                if self._grad:
                    self._grad_session = sess  # keeps the trace (and its record) for backward()
                _check_saved_steps(self._saves, (c["step"] for c in self._calls))
                _check_saved_steps(self._edits, (c["step"] for c in self._calls), "edit")
                self._result = result
            else:
                self._calls = sess.calls
                self._stopped = stopped  # tracer.stop(): the rest of the forward is not run
        finally:
            self._session = None
            sess.close_values(check=False)
            try:
                sess.close()  # aborts the forward when leaving early (an exception, KeyboardInterrupt, stop())
            finally:
                self._release_model()
        return stopped

    def __del__(self):
        # Entered and never exited (no `with`, or the frame was dropped): abort the run so the model is
        # not locked forever, and say so.
        sess = getattr(self, "_session", None)
        if sess is None:
            # Exited, but an interrupt (Ctrl-C) cut the release short: the model's lock goes with the tracer.
            if getattr(self, "_holds_model", False):
                self._release_model()
            return
        self._session = None
        try:
            warnings.warn("a mixlens tracer was entered and never exited: its run was aborted and the model released "
                          "when the tracer was garbage-collected (use `with model.trace(...)`)", RuntimeWarning,
                          stacklevel=2)
        except Exception:  # noqa: BLE001 - interpreter shutdown: warnings may be gone
            pass
        try:
            sess.close()
        finally:
            self._release_model()

    def run(self) -> "Tracer":
        """Run without an interleaved block (pre-registered ``saves`` / ``edits`` only); returns self."""
        with self:
            pass
        return self

    # -- reads / writes (used by the envoys) --------------------------------------------------
    def _require_session(self):
        if self._session is None:
            if self._deferred and self._deferred_open:
                raise InputError("this trace batches tracer.invoke(...) blocks: read and write values inside an invoke")
            raise InputError("this tracer is not open: values are read inside its `with` block")
        return self._session

    def _read(self, path: str):
        inv = _invoke.current()
        if inv is not None and inv.tracer is self:
            return inv.read(path)
        return self._read_here(path)

    def _read_here(self, path: str):
        """_read on the thread that opened the trace (not an invoke body): the per-value hot path."""
        sess = self._session
        if sess is None:
            self._require_session()
        # One binding call: in-place edits of the previous value go in first, then this value is read
        # and becomes the live one (mixlens._inplace describes the rules).
        value = sess.read_value(self._step, path)
        if self._grad:
            self._note_read(path, value)
        return value

    def _note_read(self, path: str, value) -> None:
        """grad=True: a value read in the block gets .grad from backward()."""
        if value is not None:
            self._grad_reads.append((path, value))

    def _refuse_foreign(self, path: str) -> None:
        """Raises for a read / write of `path` from outside the thread and context that opened this tracer:
        never another trace's values, never a wait on itself."""
        sess = self._session
        if sess is not None and sess.in_forward:
            raise InputError(f"'{path}' was read or written through the open tracer from inside the forward (an "
                             "edit function passed in edits=... runs there): it would wait on itself forever "
                             "(deadlock). Use the value the edit function is given; read other values in the "
                             "`with` block instead")
        owner = self._owner_thread
        where = "another asyncio task / context of this thread" if owner is threading.current_thread() else (
            f"thread {owner.name!r}" if owner is not None else "another thread")
        raise InputError(f"'{path}': the trace open on this model belongs to {where}; a thread reads values only "
                         "inside its own `with model.trace(...)` block (opening one waits until that trace ends)")

    def _write(self, path: str, value) -> None:
        inv = _invoke.current()
        if inv is not None and inv.tracer is self:
            return inv.write(path, value)
        sess = self._require_session()
        arr = as_float32(value, path)
        shape = self._expected_shape(path)
        if shape is not None and arr.shape != shape:
            try:  # a scalar / vector broadcast over the value (mix.betas[...] = 0 style), as torch would
                arr = np.ascontiguousarray(np.broadcast_to(arr, shape))
            except ValueError:
                pass  # the core names the expected and given shapes
        sess.write_value(self._step, path, arr)

    def _call_seq(self) -> int:
        """Tokens of the forward call at the current step."""
        first = self._require_session().first_step
        if self._kind == "generate" and self._step > first:
            return 1
        return max(len(r) for r in self._rows)

    def _expected_shape(self, path: str) -> Optional[tuple]:
        key = (len(self._rows), self._call_seq())
        table = self._shapes.get(key)
        if table is None:
            table = {v["path"]: tuple(v["shape"]) for v in self._model._core.values(*key)}
            self._shapes[key] = table
        base, at, _ = path.partition("@t")
        if at and base.endswith(".state"):  # one token's slice of `states` [B,T,...] -> [B,...]
            states = table.get(base + "s")
            return None if states is None else states[:1] + states[2:]
        return table.get(path)

    def stop(self) -> None:
        """nnsight's ``tracer.stop()``: end the block here without running the rest of the forward. Values
        read so far stay valid; results (``tracer.logits``, ``tokens``, ``saved``) are not available."""
        self._require_session()
        raise _StopTrace(self)

    @property
    def stopped(self) -> bool:
        """True when the block ended with :meth:`stop`."""
        return self._stopped

    @property
    def input_ids(self):
        """The prompt batch as the forward receives it: ``[B, T]`` token ids, left-padded with the model's
        pad_token_id (a batch given with an attention_mask: the ids as given); int64, a torch tensor or numpy
        array by the model's output format."""
        pad = self._model._core.pad_token_id
        T = max(len(r) for r in self._rows)
        ids = np.array([[pad] * (T - len(r)) + list(r) for r in self._rows], dtype=np.int64)
        return to_plain(ids, self._fmt)

    @property
    def attention_mask(self):
        """``[B, T]`` int64, 1 for real tokens and 0 for left padding (transformers' attention_mask of the
        same left-padded batch); a torch tensor or numpy array by the model's output format."""
        T = max(len(r) for r in self._rows)
        if self._mask:  # a batch the caller padded: its own mask
            return to_plain(np.array(self._mask, dtype=np.int64).reshape(len(self._rows), T), self._fmt)
        mask = np.array([[0] * (T - len(r)) + [1] * len(r) for r in self._rows], dtype=np.int64)
        return to_plain(mask, self._fmt)

    # -- steps ------------------------------------------------------------------------------
    @property
    def iter(self) -> _StepIndexer:
        """``for step in tracer.iter[:]`` / ``[0:3]`` / ``[2]`` / ``[[0, 2]]``: each iteration waits until that
        forward call starts; reads in the body address that step. Stops early when generation ends."""
        return _StepIndexer(self)

    def all(self) -> _StepLoop:
        """nnsight's ``tracer.all()``: every step (same as ``tracer.iter[:]``)."""
        return _StepLoop(self, slice(None))

    @property
    def step(self) -> int:
        """The step reads and writes address now (0 = the prompt)."""
        return self._step

    # -- results ----------------------------------------------------------------------------
    def _done(self) -> dict:
        if self._stopped:
            raise InputError("this trace was stopped with tracer.stop(): the forward did not finish, so it has no results")
        if self._result is None:
            raise InputError("results are available after the `with` block has finished without an error")
        return self._result

    @property
    def logits(self):
        """trace: logits ``[B,T,vocab]`` float32; teacher-forced generate: a list, one array per step."""
        if self._grad and self._kind == "trace":
            if self._fmt != "torch":
                return to_plain(self._grad_logits(), self._fmt)
            # One leaf tensor, so a metric built from it can be differentiated (backward()).
            if self._logits_leaf is None:
                self._logits_leaf = to_plain(self._grad_logits(), self._fmt).requires_grad_(True)
            return self._logits_leaf
        logits = [to_plain(x, self._fmt) for x in self._done()["logits"]]
        if self._kind == "trace":
            return logits[0]
        return logits or None

    output = logits  # nnsight spelling

    @property
    def tokens(self):
        """generate: the new token ids, a list per row when the input had a batch dimension (a list of
        prompts / rows, a [B,T] array, [B,T,hidden] inputs_embeds; B = 1 included), else one flat list (a
        string, flat ids, a [T] array, [T,hidden] inputs_embeds): the same for ids and embeddings."""
        toks = self._done()["new_tokens"]
        return toks[0] if self._single else toks

    @property
    def text(self):
        """generate: the decoded new tokens, shaped as :attr:`tokens` (a str per row, or one str)."""
        toks = self._done()["new_tokens"]
        texts = [self._model.tokenizer.decode(t) for t in toks]
        return texts[0] if self._single else texts

    @property
    def prompt_ids(self) -> list[list[int]]:
        return self._rows

    @property
    def steps(self) -> int:
        """Forward calls made."""
        return self._done()["steps"]

    @property
    def saved(self) -> dict:
        """Pre-registered saves: trace -> {path: array}; generate -> {path: [array per step, None where
        the value does not exist (state_input at step 0)]}."""
        raw = self._done()["saved"]
        if self._kind == "trace":
            return {_STEP_KEY.match(k).group("path"): to_plain(v, self._fmt) for k, v in raw.items()}
        out: dict = {}
        n = self.steps
        for k, v in raw.items():
            m = _STEP_KEY.match(k)
            out.setdefault(m.group("path"), [None] * n)[int(m.group("step"))] = to_plain(v, self._fmt)
        return out

    # -- gradients (issue 12, docs/gradients.md) ------------------------------------------------
    def _grad_logits(self):
        """Every position's logits of a grad trace: the forward returned them when they were saved, else
        they are formed once from the recorded LM-head input."""
        raw = self._done()["logits"][0]
        T = self._calls[-1]["seq"] if self._calls else raw.shape[1]
        if raw.shape[1] == T or self._grad_session is None:
            return raw
        if self._full_logits is None:
            self._full_logits = self._grad_session.logits_at(list(range(T)))
        return self._full_logits

    def backward(self, metric, paths: Optional[Iterable[str]] = None) -> None:
        """Gradients of a scalar `metric` of this trace's logits with respect to its values, computed natively
        (C++ reverse pass through the edited forward). Needs ``model.trace(..., grad=True)``.

        `metric`: a torch scalar computed from ``tracer.logits`` (torch output), a :mod:`mixlens.metrics`
        metric (``LogProb``, ``LogitDiff``; no torch needed), or dMetric/dLogits itself as a ``[B,T,vocab]``
        array. A metric that declares its positions (``Metric.positions``) gets the logits of those
        positions only, and the LM head's backward runs on those rows (docs/gradients.md); reading
        ``tracer.logits`` forms every position's. Gradients are computed for `paths` (value paths, ``*`` for every layer), by default every
        saved path and every value read in the block; each read value gets ``.grad``, and
        :meth:`grad` returns any of them. A second ``backward`` replaces every ``.grad`` (unlike torch's
        ``.backward``, gradients do not accumulate: add them yourself to combine metrics). Errors as
        ``Trace::backward`` (mixlens/trace.h)."""
        paths = _check_strs("paths", paths, allow_none=True)
        if self._session is not None:  # still inside the `with` block
            raise InputError("tracer.backward: call it after the `with` block has ended (the reverse pass needs the "
                             "whole forward); values read in the block get .grad then")
        sess = self._grad_session
        if sess is None:
            self._done()
            raise InputError("tracer.backward: open the trace with grad=True (model.trace(..., grad=True)) so the "
                             "forward keeps what the backward needs")
        raw = self._done()["logits"][0]
        seq = self._calls[-1]["seq"] if self._calls else raw.shape[1]
        positions: list = []  # the call positions dl covers; [] = every one
        pos_of = getattr(metric, "positions", None)
        declared = pos_of(seq) if callable(pos_of) and self._full_logits is None and raw.shape[1] != seq else None
        if declared is not None:
            # The metric reads a few positions: their logits only, and the LM head's backward on those rows.
            positions = [int(t) for t in declared]
            # The last position's are the forward's own (returned [B,1,V]); others are formed here.
            rows = raw if positions == [seq - 1] else self._grad_session.logits_at(positions)
            dl = metric.dlogits(rows, positions=positions, seq=seq)
        elif hasattr(metric, "dlogits") and callable(metric.dlogits):
            dl = metric.dlogits(self._grad_logits())
        elif is_torch(metric) and metric.dim() == 3 and not metric.requires_grad:
            dl = metric.detach().float().cpu().numpy()  # dMetric/dLogits itself, given as a torch tensor
        elif is_torch(metric):
            import torch

            leaf = self._logits_leaf
            if leaf is None or not metric.requires_grad:
                raise InputError("tracer.backward: the metric does not depend on tracer.logits (build it from "
                                 "tracer.logits after the block)")
            if metric.numel() != 1:
                raise InputError(f"tracer.backward: the metric must be a scalar, got shape {tuple(metric.shape)}")
            (g,) = torch.autograd.grad(metric, leaf, allow_unused=True)
            if g is None:
                raise InputError("tracer.backward: the metric does not depend on tracer.logits")
            dl = g.detach().to(torch.float32).contiguous().numpy()
        else:
            dl = as_float32(metric, "dlogits")
        dl = np.ascontiguousarray(dl, dtype=np.float32)
        if paths is None:
            wanted = [p for p, _, _ in self._saves] + [p for p, _ in self._grad_reads]
        else:
            wanted = [paths] if isinstance(paths, str) else list(paths)
        wanted = list(dict.fromkeys(wanted))
        sess.backward(dl, wanted, positions)
        have = set(sess.grad_paths())
        for path, value in self._grad_reads:
            if path in have:
                g = to_plain(sess.grad(path), self._fmt)
                try:
                    value.grad = g
                except (AttributeError, RuntimeError, TypeError):
                    pass  # a tensor type that takes no .grad: tracer.grad(path) still has it

    def grad(self, path: str):
        """The gradient computed by the last :meth:`backward` for `path` (same shape and type as the value)."""
        if self._grad_session is None:
            raise InputError("tracer.grad: run tracer.backward(metric) on a trace opened with grad=True first")
        if not isinstance(path, str):
            raise InputError(f"tracer.grad takes a value path, got {path!r} ({type(path).__name__})")
        return to_plain(self._grad_session.grad(path), self._fmt)

    @property
    def calls(self) -> list[dict]:
        """Every forward call: step, batch, seq, fresh (no cached state before), kernel ('chunked' or
        'recurrent')."""
        return self._session.calls if self._session is not None else self._calls


# ---- the model ---------------------------------------------------------------------------------


def _dtype_name(dtype: Any) -> str:
    """'float32' / 'bfloat16' / 'float16' / 'auto' from a string or a torch dtype."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = str(dtype).replace("torch.", "")  # torch.bfloat16 -> "bfloat16" without importing torch
    if name not in ("float32", "bfloat16", "float16", "auto"):
        raise InputError(f"dtype {dtype!r} is not one of 'float32', 'bfloat16', 'float16', 'auto' "
                         "(or torch.float32 / torch.bfloat16 / torch.float16)")
    return name


class StandardizedTransformer(_nnterp.NnterpMixin):
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
                 dtype: Any = "float32"):
        """``dtype``: the dtype the matmul weights (projections, embeddings, lm_head, experts) are kept
        in and multiplied as, with float32 accumulation: ``"float32"`` (default, widened at load: exact
        parity with transformers in float32), ``"bfloat16"``, ``"float16"``, or ``"auto"`` (each weight's
        checkpoint dtype); ``torch.float32`` / ``torch.bfloat16`` / ``torch.float16`` are accepted too.
        States, gates, decays, norms and every value served stay float32. ValueError otherwise."""
        self._output = resolve_output(output)
        dtype = _dtype_name(dtype)
        path = default_model_path() if path_or_hub_id is None else os.fspath(path_or_hub_id)
        if use_hub or cache_dir is not None or revision is not None:
            path = hub.resolve(path, revision=revision, cache_dir=cache_dir)
        try:
            self._core = _core.Model.load(path, dtype)
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

    def extract(self, inputs, values, out, **kwargs) -> dict:
        """Dataset-scale extraction to sharded safetensors + index.json (resumable; ``ray=True`` for a Ray
        cluster): see :func:`mixlens.extract` for the arguments, docs/extract.md for the layout."""
        from . import _extract

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
