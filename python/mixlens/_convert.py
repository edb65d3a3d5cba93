"""torch / numpy in and out (issue 10 item 1).

Values leave mixlens as ``torch.Tensor`` (:class:`ValueTensor`) when the model's output format is
``"torch"`` and as numpy arrays (:class:`ValueArray`) when it is ``"numpy"``; the default ``"auto"``
picks torch when it is installed. ``$MIXLENS_OUTPUT`` (``torch`` / ``numpy`` / ``auto``) sets the
default for models created without ``output=``. Every read is a copy the core made for Python; the
torch tensor is a zero-copy view of that copy (``torch.from_numpy``), so it stays valid after the
forward moves on.

Writes accept numpy arrays, torch tensors of any real dtype on any device (detached, moved to the
CPU and cast to float32), nested lists and Python / numpy scalars; the caller broadcasts a value
whose shape is not the value's own (``mix.betas = 0``). torch is imported lazily, the first time it
is needed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from typing import Any, Optional

import numpy as np

from .errors import InputError, WriteError

OUTPUTS = ("auto", "torch", "numpy")


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def _torch():
    import torch

    return torch


def resolve_output(output: Optional[str]) -> str:
    """'torch' or 'numpy' for a model's ``output=`` argument (None: ``$MIXLENS_OUTPUT``, else 'auto')."""
    where = "output"
    if output is None:
        output = os.environ.get("MIXLENS_OUTPUT", "auto") or "auto"
        where = "$MIXLENS_OUTPUT"
    if output not in OUTPUTS:
        raise InputError(f"{where} must be one of {', '.join(OUTPUTS)}, got {output!r}")
    if output == "auto":
        return "torch" if torch_available() else "numpy"
    if output == "torch" and not torch_available():
        raise InputError("output='torch' but torch is not installed (pip install torch, or use output='numpy')")
    return output


def _frozen_path(arr: np.ndarray) -> Optional[tuple]:
    """(step, path) of the released value `arr` is (a view of), if any."""
    a = arr
    while isinstance(a, np.ndarray):
        info = a.__dict__.get("_mixlens_released") if hasattr(a, "__dict__") else None
        if info is not None:
            return info
        a = a.base
    return None


def released_error(info: tuple) -> WriteError:
    step, path = info
    return WriteError(
        f"in-place edit of '{path}' (read at step {step}) after the forward moved past it: it can no longer reach "
        f"the forward. Edit a value in place before the next read/write, or assign it (model.<...> = new value) "
        f"before reading a later value; .copy() / .clone() it to change it offline")


class ValueArray(np.ndarray):
    """A value read inside a trace as a float32 numpy array (``output="numpy"``), with nnsight's
    ``.save()`` accepted for compatibility.

    In place edits (``v[:, 3] = 0``, ``v *= 2``) of the value read last are consumed by the forward when
    the block moves on (the next read, write, step or the end of the block). Once the forward has
    moved past it the array is read-only until the block ends, and editing it raises
    :class:`mixlens.WriteError` saying to assign instead."""

    def save(self) -> "ValueArray":
        """nnsight compatibility: reads are already real arrays, so this returns the value itself."""
        return self

    def __reduce__(self):
        # Pickled (multiprocessing, joblib, pickle.dump) as a plain ndarray: loading it needs numpy only,
        # as a torch value loads as a plain torch.Tensor.
        return np.asarray(self).__reduce__()

    @property
    def value(self) -> "ValueArray":
        """nnsight < 0.4 compatibility (``saved.value``)."""
        return self

    def __setitem__(self, key, value) -> None:
        if not self.flags.writeable:
            info = _frozen_path(self)
            if info is not None:
                raise released_error(info)
        super().__setitem__(key, value)


def _guard_inplace(name: str):
    base = getattr(np.ndarray, name)

    def op(self, other):
        if not self.flags.writeable:
            info = _frozen_path(self)
            if info is not None:
                raise released_error(info)
        return base(self, other)

    op.__name__ = name
    return op


for _name in ("__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__ipow__", "__imod__",
              "__imatmul__"):
    setattr(ValueArray, _name, _guard_inplace(_name))

def _torch_aware(name: str):
    """ndarray's binary operator, except that with a torch tensor operand the result is torch's (numpy alone
    refuses ``ndarray + Tensor``)."""
    base = getattr(np.ndarray, name)
    torch_name = name

    def op(self, other):
        if is_torch(other):
            return getattr(_torch().from_numpy(np.asarray(self)), torch_name)(other)
        return base(self, other)

    op.__name__ = name
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__matmul__", "__rmatmul__", "__pow__", "__rpow__"):
    setattr(ValueArray, _name, _torch_aware(_name))

_VALUE_TENSOR = None


def _save_self(self):
    """nnsight's ``.save()`` on any torch tensor while a mixlens trace with torch output is open (see
    :func:`mount_tensor_save`): the tensor is real already, so it returns itself."""
    return self


_SAVE_LOCK = threading.Lock()
_save_mounts = 0


def mount_tensor_save() -> bool:
    """nnsight code saves what it computes from values too (``h = model.layers_output[3][:, -1].save()``,
    ``model.next_token_probs.save()``), which are plain tensors. nnsight mounts ``.save`` on every object
    while it traces; mixlens mounts an identity ``save`` on ``torch.Tensor`` while one of its traces is open
    and removes it when the last one ends, so nnsight's own mount (it shadows nnsight's ``object.save``)
    works between them. Nothing is mounted where ``torch.Tensor`` has a ``save`` of its own. Returns whether
    this call counted a mount (then :func:`unmount_tensor_save` must follow)."""
    global _save_mounts
    torch = _torch()
    with _SAVE_LOCK:
        if _save_mounts == 0:
            if "save" in vars(torch.Tensor):
                return False
            torch.Tensor.save = _save_self
        _save_mounts += 1
        return True


def unmount_tensor_save() -> None:
    global _save_mounts
    torch = _torch()
    with _SAVE_LOCK:
        _save_mounts -= 1
        if _save_mounts == 0 and vars(torch.Tensor).get("save") is _save_self:
            del torch.Tensor.save


def value_tensor_class():
    """:class:`ValueTensor`, a ``torch.Tensor`` subclass with nnsight's ``.save()`` (defined on first use,
    so importing mixlens does not import torch). Operations on it return plain tensors."""
    global _VALUE_TENSOR
    if _VALUE_TENSOR is None:
        torch = _torch()

        # No state or __slots__ of its own: the session binding (python/src/session.cpp) gives each value
        # read in a `with` block this class (and a released one its subclass) by __class__ assignment, which needs torch.Tensor's layout
        # (as_subclass, the fallback, costs a second tensor and Python object per value: issue 9 item 5).
        class ValueTensor(torch.Tensor):
            """A value read inside a trace as a float32 CPU ``torch.Tensor`` (``output="torch"``). In place edits
            of the value read last reach the forward when the block moves on; editing a value the
            forward has passed raises :class:`mixlens.WriteError` at the next generation step or the end of
            the block (at the next read / write when the value is dropped after the edit; see
            :mod:`mixlens._inplace`). ``.save()`` returns the tensor itself (nnsight compatibility)."""

            __torch_function__ = torch._C._disabled_torch_function_impl

            def save(self):
                return self

            @property
            def value(self):
                return self

            # torch.save / pickle and copy.deepcopy as a plain tensor: torch.load's default weights_only=True
            # refuses the subclass, and torch's deepcopy needs a new_empty() the subclass lacks.
            def __reduce_ex__(self, proto):
                return self.as_subclass(torch.Tensor).__reduce_ex__(proto)

            def __deepcopy__(self, memo):
                out = self.as_subclass(torch.Tensor).detach().clone()
                if self.grad is not None:
                    out.grad = self.grad.detach().clone()
                memo[id(self)] = out
                return out

        ValueTensor.__module__, ValueTensor.__qualname__ = "mixlens", "ValueTensor"
        _VALUE_TENSOR = ValueTensor
    return _VALUE_TENSOR


def to_output(arr: Optional[np.ndarray], fmt: str):
    """A float32 array from the core as the model's output type (None stays None)."""
    if arr is None:
        return None
    if fmt == "torch":
        return _torch().from_numpy(arr).as_subclass(value_tensor_class())
    return arr.view(ValueArray)


def to_plain(arr: Optional[np.ndarray], fmt: str):
    """Like :func:`to_output` for results outside a trace (no value semantics): torch.Tensor or ndarray."""
    if arr is None:
        return None
    if fmt == "torch":
        return _torch().from_numpy(arr)
    return arr


def saveable(value, fmt: str):
    """A helper's computed result (next_token_probs, project_on_vocab) with nnsight's ``.save()``: numpy ones
    become a ValueArray view (no copy); torch tensors have ``save`` mounted while a trace is open."""
    if fmt != "torch" and isinstance(value, np.ndarray) and not isinstance(value, ValueArray):
        return value.view(ValueArray)
    return value


def is_torch(value: Any) -> bool:
    """A torch.Tensor (without importing torch when nobody has)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def as_float32(value: Any, path: str) -> np.ndarray:
    """A C-contiguous float32 numpy copy of `value` for a write: numpy arrays, torch tensors (any real dtype,
    any device; detached), nested lists, Python / numpy scalars. WriteError for None, bool, complex, text,
    ragged lists."""
    if value is None:
        raise WriteError(f"write to '{path}': the new value is None")
    if is_torch(value):
        torch = _torch()
        t = value.detach()
        if t.is_complex() or t.dtype == torch.bool:
            raise WriteError(f"write to '{path}': dtype {t.dtype} cannot be written (values are float32)")
        if t.device.type == "meta":
            raise WriteError(f"write to '{path}': a tensor on the 'meta' device has no values to write")
        if t.is_nested:
            raise WriteError(f"write to '{path}': a nested tensor (rows of their own lengths) is not one array; write "
                             "a regular tensor of the value's shape")
        try:
            if t.is_quantized:  # its real values are what is written
                t = t.dequantize()
            if t.layout != torch.strided:  # sparse: its dense values are what is written
                t = t.to_dense()
            t = t.resolve_neg()  # a lazy negation view (torch._neg_view) cannot go to numpy as it is
            if t.dtype == torch.float64:
                _check_float32_range(t.to("cpu").numpy(), path)
            t = t.to(device="cpu", dtype=torch.float32)
            if t.is_inference() or type(t) is not torch.Tensor:
                t = t.as_subclass(torch.Tensor)
            return np.array(t.contiguous().numpy(), dtype=np.float32, copy=True)
        except (RuntimeError, NotImplementedError, TypeError) as e:  # quantized, nested, ...: torch cannot hand it over
            raise WriteError(f"write to '{path}': this {t.dtype} tensor ({t.layout}, device '{t.device}') cannot "
                             f"be converted to float32 values: {e}") from None
    try:
        arr = np.asarray(value)
    except ValueError as e:  # a ragged nested list
        raise WriteError(f"write to '{path}': the new value is not a rectangular array ({e})") from None
    if arr.dtype == object:  # Python ints past int64 (10**40): numbers, but numpy keeps them as objects
        if all(isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))
               for x in arr.reshape(-1)):  # not None (numpy would make it NaN) or text
            try:
                arr = np.asarray(value, dtype=np.float64)
            except (TypeError, ValueError, OverflowError):
                pass
    if arr.dtype.kind not in "fiu":
        raise WriteError(f"write to '{path}': dtype {arr.dtype} cannot be written (values are float32)")
    _check_float32_range(arr, path)
    return np.ascontiguousarray(arr, dtype=np.float32)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _check_float32_range(arr: np.ndarray, path: str) -> None:
    """WriteError for finite numbers float32 cannot hold (they would become inf and be reported as such)."""
    if arr.dtype.kind == "f" and arr.dtype.itemsize > 4:  # integers up to int64 fit float32's range
        with np.errstate(invalid="ignore"):
            big = np.isfinite(arr) & (np.abs(arr) > _FLOAT32_MAX)
        if big.any():
            x = arr.reshape(-1)[int(np.flatnonzero(big.reshape(-1))[0])]
            raise WriteError(f"write to '{path}': {float(x):g} is outside float32's range (|x| <= {_FLOAT32_MAX:.4g}); "
                             "values are float32")


def as_numpy(value: Any) -> np.ndarray:
    """float32 numpy view/copy of a value for computations in helpers (torch or numpy)."""
    return as_float32(value, "value")
