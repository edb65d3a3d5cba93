"""``model.new_cache(batch)``: the recurrent state of a batch between forward calls."""

from __future__ import annotations

from . import _core
from .errors import InputError


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
