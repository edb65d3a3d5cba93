"""Metrics for :meth:`mixlens.Tracer.backward` that need no torch (issue 12, docs/gradients.md).

Each metric is a scalar function of a trace's logits ``[B, T, vocab]`` with its exact gradient
``dlogits`` (what the C++ backward takes)::

    with model.trace(prompt, grad=True) as tr:
        ...
    tr.backward(mixlens.metrics.LogProb(token_id))            # log p(token | prompt) at the last position
    tr.backward(mixlens.metrics.LogitDiff(good_id, bad_id))   # logit(good) - logit(bad)

``position`` is a token index of the call (negative counts from the end; ``None``: every position),
``row`` a batch row (``None``: every row); the metric sums over the rows and positions it covers.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ._args import IndexInputError, as_index
from .errors import InputError


def _index_or_none(name: str, value):
    """An optional integer argument (a position, a row, a token id); 1.5 or True is not one."""
    if value is None:
        return None
    try:
        return as_index(value)
    except TypeError:
        raise InputError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None


class Metric:
    """Base: ``value(logits) -> float`` and ``dlogits(logits) -> float32 [B,T,V]``.

    A metric may also declare the call positions it reads (:meth:`positions`); then
    :meth:`mixlens.Tracer.backward` forms the logits of those positions only and passes them as
    ``logits [B,P,V]`` with ``positions=`` (the call positions of axis 1) and ``seq=`` (the call's
    length): at a 248k-token vocabulary every position's logits cost as much as the blocks. A subclass
    that does not override :meth:`positions` gets every position's logits."""

    def __init__(self, position: Optional[int] = -1, row: Optional[int] = None):
        self.position, self.row = _index_or_none("position", position), _index_or_none("row", row)

    def positions(self, seq: int) -> Optional[list[int]]:
        """The call positions (ascending) this metric reads in a call of `seq` tokens; None: every one."""
        return None

    def _cells(self, shape, positions=None, seq=None) -> tuple[list, list]:
        """Rows and (call position, index into logits' axis 1) pairs the metric covers."""
        B = shape[0]
        T = shape[1] if positions is None else int(seq)
        rows = list(range(B)) if self.row is None else [self.row]
        pos = list(range(T)) if self.position is None else [self.position % T if -T <= self.position < T else None]
        if None in pos:
            raise IndexInputError(f"metric position {self.position} is out of range for a call of {T} tokens")
        for r in rows:
            if not -B <= r < B:
                raise IndexInputError(f"metric row {r} is out of range for a batch of {B}")
        if positions is None:
            return rows, [(t, t) for t in pos]
        at = {int(t): i for i, t in enumerate(positions)}
        missing = [t for t in pos if t not in at]
        if missing:
            raise IndexInputError(f"metric position {missing[0]} is not among the logits' positions")
        return rows, [(t, at[t]) for t in pos]

    def value(self, logits) -> float:
        raise NotImplementedError

    def dlogits(self, logits) -> np.ndarray:
        raise NotImplementedError


class CellMetric(Metric):
    """Base of metrics that read only the cells of their ``position`` and ``row``: declares that
    position (:meth:`Metric.positions`), so :meth:`mixlens.Tracer.backward` forms its logits only."""

    def positions(self, seq: int) -> Optional[list[int]]:
        # The positions of ``position`` (None: every one), checked as _cells does.
        if self.position is None:
            return None
        if not -seq <= self.position < seq:
            raise IndexError(f"metric position {self.position} is out of range for a call of {seq} tokens")
        return [self.position % seq]


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _token_id(i: int, vocab: int, what: str) -> int:
    # A negative id would silently index from the end of the vocabulary: refuse it like any other bad id.
    if not 0 <= i < vocab:
        raise InputError(f"{what} {i} is not a token id of this model (0..{vocab - 1})")
    return i


class LogProb(CellMetric):
    """Sum of ``log_softmax(logits)[row, position, token]``. ``token``: an id, or an int array ``[B, T]``
    of targets (with ``position=None``: the sum of every position's target log-prob)."""

    def __init__(self, token, position: Optional[int] = -1, row: Optional[int] = None):
        super().__init__(position, row)
        try:
            token = as_index(token)
        except TypeError:  # not one id: an integer array [B, T] of targets
            t = np.asarray(token.detach().cpu().numpy() if hasattr(token, "detach") else token)
            if t.ndim != 2 or t.dtype.kind not in "iu":
                raise InputError(f"LogProb: token must be a token id or an integer array [B, T] of them, got "
                                 f"{token!r}") from None
        self.token = token

    def _target(self, r: int, t: int, vocab: int) -> int:
        tok = np.asarray(self.token)
        i = int(tok) if tok.ndim == 0 else int(tok[r, t])
        return _token_id(i, vocab, "LogProb token")

    def value(self, logits, positions=None, seq=None) -> float:
        z = np.asarray(logits)
        rows, cells = self._cells(z.shape, positions, seq)
        return float(sum(_log_softmax(z[r, i])[self._target(r, t, z.shape[-1])] for r in rows for t, i in cells))

    def dlogits(self, logits, positions=None, seq=None) -> np.ndarray:
        z = np.asarray(logits)
        out = np.zeros(z.shape, np.float64)
        rows, cells = self._cells(z.shape, positions, seq)
        for r in rows:
            for t, i in cells:
                out[r, i] -= np.exp(_log_softmax(z[r, i]))
                out[r, i, self._target(r, t, z.shape[-1])] += 1.0
        return out.astype(np.float32)


class LogitDiff(CellMetric):
    """Sum of ``logits[row, position, a] - logits[row, position, b]``."""

    def __init__(self, a: int, b: int, position: Optional[int] = -1, row: Optional[int] = None):
        super().__init__(position, row)
        a, b = _index_or_none("LogitDiff: a", a), _index_or_none("LogitDiff: b", b)
        if a is None or b is None:
            raise InputError("LogitDiff takes two token ids a and b")
        self.a, self.b = a, b

    def value(self, logits, positions=None, seq=None) -> float:
        z = np.asarray(logits)
        rows, cells = self._cells(z.shape, positions, seq)
        _token_id(self.a, z.shape[-1], "LogitDiff token a"), _token_id(self.b, z.shape[-1], "LogitDiff token b")
        return float(sum(float(z[r, i, self.a]) - float(z[r, i, self.b]) for r in rows for _, i in cells))

    def dlogits(self, logits, positions=None, seq=None) -> np.ndarray:
        z = np.asarray(logits)
        out = np.zeros(z.shape, np.float32)
        rows, cells = self._cells(z.shape, positions, seq)
        _token_id(self.a, z.shape[-1], "LogitDiff token a"), _token_id(self.b, z.shape[-1], "LogitDiff token b")
        for r in rows:
            for _, i in cells:
                out[r, i, self.a] += 1.0
                out[r, i, self.b] -= 1.0
        return out
