"""Inputs of a trace / generate / run call: prompts and token-id batches, inputs_embeds and attention masks,
pre-registered saves and edits, the dtype argument. Nothing here knows the model class: a model is passed
in where its tokenizer is needed (``model._rows``)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np

from . import _core
from ._args import check_strs as _check_strs
from ._convert import as_float32, to_output
from ._inplace import _Live
from .errors import InputError

if TYPE_CHECKING:  # annotations only: the model module imports this one
    from ._model import StandardizedTransformer

_ALL_STEPS = (0, 2**31 - 1)
_INT32_MAX = 2**31 - 1
_UINT64_MAX = 2**64 - 1
_STEP_KEY = re.compile(r"^(?P<path>.+)@step(?P<step>\d+)$")

Prompt = Union[str, Sequence[int], Sequence[str], Sequence[Sequence[int]], np.ndarray]

# A call over a cache (even a fresh one) continues every row's stream token for token: no padding.
_NO_MASK_WITH_CACHE = ("attention_mask cannot pad a call over a cache (cache=...): each row of a cache, a fresh one "
                       "included, continues its own stream token for token. Run prompts of different lengths "
                       "without cache= (trace / generate left-pad them), or give each prompt its own cache "
                       "(model.new_cache(1))")


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


def _steps_of(key: str) -> tuple[str, int, int]:
    """'path' -> every step; 'path@step3' -> step 3 only (the C++ split_step, which the CLI's --save uses too)."""
    return _core.split_step(key)


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


def _dtype_name(dtype: Any) -> str:
    """'float32' / 'bfloat16' / 'float16' / 'int8' / 'auto' from a string or a torch dtype."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = str(dtype).replace("torch.", "")  # torch.bfloat16 -> "bfloat16" without importing torch
    if name not in ("float32", "bfloat16", "float16", "int8", "auto"):
        raise InputError(f"dtype {dtype!r} is not one of 'float32', 'bfloat16', 'float16', 'int8', 'auto' "
                         "(or torch.float32 / torch.bfloat16 / torch.float16 / torch.int8)")
    return name
