"""In-place edits of values read inside a ``with`` block (issue 10 item 2): no silent no-op.

The value read last is *live*: the forward is still paused at it, so an in-place edit (``v[:, 3] = 0``,
``model.layers_output[i][:, t] = x``, ``v *= 2``) is consumed as a write when the block moves on (the
next read, write, ``tracer.iter`` step, ``tracer.stop()`` or the end of the block). Detection: a torch
value's version counter (bumped by every in-place op on it or its views), a numpy value compared
bit-for-bit against a pristine copy.

A value the forward has moved past is *released*: numpy values become read-only (editing raises
:class:`mixlens.WriteError` at once, naming the value and saying to assign; a view made before the
release stays writable, so their bytes are checked as a torch value's are); torch values have no
read-only mode, so they are checked instead, raising the same WriteError: for a value edited and then
dropped, at the next read / write / step; for one still held (or a view of it, or a re-export of its
memory), at the next step of a generation and at the end of the block. Up to :data:`WATCH_LIMIT`
bytes the check compares the value's bytes with those at the release (a copy, or a 64-bit checksum
above :data:`WATCH_COPY_LIMIT`; python/src/dlpack.cpp ``EditWatch``; compared again when the value's
storage is freed, so dropped values need no Python finalizer): it sees every write, through torch,
``.numpy()``, ``.data`` or a DLPack re-export. A
larger value (a long prompt's ``states`` stack, where a pass over its bytes costs more than reading it)
is checked by torch's version counter, compared with its value at the release (its class,
:func:`released_value_tensor_class`, notes the edit when it is collected), which sees torch's in-place
ops on it and its views, not writes that bypass torch. (Checking every held value at every read made
a read cost ~0.2 us per value held, and swapping classes to read version counters ~5 us a held value:
issue 9 item 5.) After the block ends every value is an ordinary array again.

Where it runs: for reads in the ``with`` block itself these rules are applied by the session, once per
value (issue 9 item 5: this bookkeeping was most of a read's cost in Python): the C++ session keeps the
live value and compares it with the forward's own copy (or a pristine copy after an assignment) and
applies an in-place change as a write (``Session::read_live``), and the binding
(``python/src/session.cpp``, ``Session.read_value``) releases the Python objects. A value nobody holds
any more when the block moves on is not released (nothing can edit it), unless a view or a re-export of
its memory still holds its storage (torch: then its bytes are watched).
:class:`LiveValues` below does the same for ``tracer.invoke`` bodies, whose values are row slices of
the batch's value.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import numpy as np

from ._convert import ValueArray, as_float32, released_error
from .errors import MixlensError, OutOfOrderError, WriteError


# Values up to this size keep their pristine copy as bytes (see _Live.rebase); larger ones (a `states`
# stack can be hundreds of MiB) as an array, so a comparison does not make another full-size copy.
_BYTES_LIMIT = 1 << 20


# Released torch values of a `with` block up to WATCH_LIMIT bytes are checked by their bytes
# (python/src/dlpack.cpp EditWatch: every write counts, through torch, numpy views, `.data` or DLPack
# re-exports): compared with a copy up to WATCH_COPY_LIMIT bytes, with a 64-bit checksum above (no
# second copy of a big value). Larger ones (a `states` stack, where a pass over the bytes costs more
# than the read) by torch's version counter (in-place torch ops on them or their views). Read when a
# tracer opens.
WATCH_LIMIT = 16 << 20
WATCH_COPY_LIMIT = 256 << 10

_RELEASED_TENSOR = None


def released_value_tensor_class():
    """The class a released torch value of a `with` block takes until the block ends (by ``__class__``
    assignment in python/src/session.cpp, which sets ``_mixlens_released`` = (version at the release, step,
    path, pending list) on it): a :class:`ValueTensor` whose ``__del__`` appends (step, path) to the pending
    list when the value was edited in place after its release, so that the session raises the WriteError at
    its next move even though the value is gone."""
    global _RELEASED_TENSOR
    if _RELEASED_TENSOR is None:
        from ._convert import value_tensor_class

        def __del__(self):
            try:
                info = self.__dict__.get("_mixlens_released")
                if info is not None and self._version != info[0]:
                    info[3].append((info[1], info[2]))
            except Exception:  # noqa: BLE001 - a finalizer must not raise (interpreter shutdown, inference mode)
                pass

        base = value_tensor_class()
        # No state of its own (the session swaps classes both ways); the name users see is ValueTensor's.
        _RELEASED_TENSOR = type(base)("ValueTensor", (base,), {"__del__": __del__, "__module__": "mixlens",
                                                               "__qualname__": "ValueTensor", "__doc__": base.__doc__})
    return _RELEASED_TENSOR


def _version(v) -> Optional[int]:
    try:
        return v._version
    except (AttributeError, RuntimeError):  # inference-mode tensors have no version counter
        return None


class _Live:
    __slots__ = ("step", "path", "ref", "version", "pristine", "is_torch")

    def __init__(self, step: int, path: str, value: Any, is_torch: bool):
        self.step, self.path, self.is_torch = step, path, is_torch
        self.ref = value
        self.version: Optional[int] = None
        self.pristine: Any = None  # np.ndarray, or (shape, bytes) for a small float32 value
        self.rebase()

    def rebase(self) -> None:
        """Take the value as it is now as unmodified."""
        v = self.ref
        self.version = _version(v) if self.is_torch else None
        if self.version is None:
            arr = np.asarray(v.detach().numpy() if self.is_torch else v)
            # Small values (nearly all reads) keep their bytes: copying and comparing bytes costs ~1 us
            # where np.array_equal costs tens (issue 9 item 5: this was most of a read's hand-off).
            if arr.dtype == np.float32 and arr.nbytes <= _BYTES_LIMIT:
                self.pristine = (arr.shape, arr.tobytes())
            else:
                self.pristine = np.array(arr, dtype=np.float32, copy=True)
        else:
            self.pristine = None

    def modified(self) -> bool:
        v = self.ref
        if self.version is not None:
            return _version(v) != self.version
        cur = v.detach().numpy() if self.is_torch else np.asarray(v)
        p = self.pristine
        if isinstance(p, tuple):  # (shape, bytes): bit-for-bit, as below (NaN payloads and -0.0 count)
            return cur.shape != p[0] or cur.dtype != np.float32 or cur.tobytes() != p[1]
        if cur.shape != p.shape:
            return True
        return not np.array_equal(cur.view(np.uint32), p.view(np.uint32))


class LiveValues:
    """Per-invoke bookkeeping; `write(step, path, float32 array)` applies a write through the session.

    Invoke values are row copies made in Python, so the version counter (torch) and the read-only flag
    (numpy) check them: a released torch value takes :func:`released_value_tensor_class` (its ``__del__``
    notes an edit when it is collected, raised at the next move); the values still held are checked at
    the end of the body (:meth:`check_released`), not at every read. :meth:`close` makes them ordinary
    again when the trace ends."""

    def __init__(self, write: Callable[[int, str, np.ndarray], None]):
        self._write = write
        self._live: Optional[_Live] = None
        self._released_np: list = []  # weakrefs to numpy values made read-only
        self._released_torch: list = []  # (weakref, version, step, path)
        # (step, path) of released torch values edited and then collected: noted by the released class's
        # __del__, so a move checks this list rather than every held value (O(1) a read, issue 9 item 5).
        self._pending: list = []

    def track(self, step: int, path: str, value: Any, read_only: bool = False) -> None:
        """`value` (just read at `step`, `path`) becomes the live value. A read-only value (``states``) is
        released at once: there is nothing to write back."""
        if value is None:
            return
        is_torch = not isinstance(value, np.ndarray)
        rec = _Live(step, path, value, is_torch) if not read_only or is_torch else None
        if rec is None:
            self._release_np(value, step, path)
        elif read_only:
            self._release(rec)
        else:
            self._live = rec

    def wrote(self, step: int, path: str) -> None:
        """An explicit assignment to (step, path): it replaces the whole value, so the live value (if it is
        that one) starts over from here; later in-place edits of it are still consumed."""
        live = self._live
        if live is not None and live.step == step and live.path == path:
            live.rebase()

    def settle(self, keep: Optional[tuple] = None) -> None:
        """The block moves on: apply the live value's in-place edits, release it, and check released torch
        values for edits made after they were released. `keep` = (step, path) of an assignment about to
        replace the live value itself: it stays live (the assignment supersedes its edits so far)."""
        live = self._live
        if live is not None and keep == (live.step, live.path):
            self._raise_pending()
            return
        self._live = None
        try:
            if live is not None and live.modified():
                try:
                    self._write(live.step, live.path, as_float32(live.ref, live.path))
                except (OutOfOrderError, WriteError) as e:
                    raise type(e)(f"in-place edit of '{live.path}' (read at step {live.step}) could not be applied: "
                                  f"{e}") from None
        finally:
            if live is not None:
                self._release(live)
        self._raise_pending()

    def _raise_pending(self) -> None:
        if self._pending:
            bad = self._pending[0]
            self._pending.clear()
            raise released_error(bad)

    def check_released(self) -> None:
        """Released torch values edited since their release (collected ones first): raise the first one's
        WriteError. O(values held): at the end of a body and of the trace, not per read."""
        self._raise_pending()
        if not self._released_torch:  # numpy output: nothing to check
            return
        keep, bad = [], None
        for ref, version, step, path in self._released_torch:
            v = ref()
            if v is None:
                continue
            if bad is None and _version(v) not in (None, version):
                bad = (step, path)
                continue
            keep.append((ref, version, step, path))
        self._released_torch = keep
        if bad is not None:
            raise released_error(bad)

    def close(self, check: bool) -> None:
        """The block ends: optionally check released torch values, then make every value ordinary again."""
        self._live = None
        try:
            if check:
                self.check_released()
        finally:
            for ref in self._released_np:
                v = ref()
                if v is not None:
                    v.__dict__.pop("_mixlens_released", None)
                    try:
                        v.flags.writeable = True
                    except ValueError:
                        pass
            self._released_np.clear()
            from ._convert import value_tensor_class

            plain = value_tensor_class()
            for ref, *_ in self._released_torch:
                v = ref()
                if v is not None:
                    v.__dict__.pop("_mixlens_released", None)
                    try:
                        v.__class__ = plain
                    except TypeError:
                        pass
            self._released_torch.clear()
            self._pending.clear()

    # -- internals -------------------------------------------------------------------------
    def _release(self, live: _Live) -> None:
        if live.is_torch:
            v = live.ref
            version = _version(v)
            if version is not None:
                self._released_torch.append((weakref.ref(v), version, live.step, live.path))
                # Its __del__ notes an edit made after the release when it is collected before the next check.
                try:
                    v.__class__ = released_value_tensor_class()
                    v.__dict__["_mixlens_released"] = (version, live.step, live.path, self._pending)
                except (TypeError, AttributeError):
                    pass
        else:
            self._release_np(live.ref, live.step, live.path)

    def _release_np(self, v: np.ndarray, step: int, path: str) -> None:
        if isinstance(v, ValueArray):
            v.__dict__["_mixlens_released"] = (step, path)
            v.flags.writeable = False
            self._released_np.append(weakref.ref(v))


__all__ = ["LiveValues", "MixlensError"]
