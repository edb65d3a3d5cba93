"""The benches' one timer: wall and CPU seconds of a block, repeats, interleaving, median and spread.

CPU time is the process's (every thread: a forward's workers and a spinning wait count), plus the
children's when ``children=True`` (a CLI run as a subprocess). On a machine shared with other work
the CPU seconds are the steadier measure, the wall seconds what a user waits; every bench reports
both. Interleaving runs each cell once per round, so a load change hits every cell alike.
The C++ benches' twin is bench/timing.h.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable


@dataclass
class Sample:
    wall: float
    cpu: float


def _cpu(children: bool) -> float:
    t = time.process_time()
    if children:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        t += ru.ru_utime + ru.ru_stime
    return t


class Timer:
    """``with Timer() as t: ...`` then ``t.wall`` / ``t.cpu`` (seconds) and ``t.sample``."""

    def __init__(self, children: bool = False):
        self.children = children
        self.wall = self.cpu = 0.0

    def __enter__(self) -> "Timer":
        self._c0, self._w0 = _cpu(self.children), time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        self.wall = time.perf_counter() - self._w0
        self.cpu = _cpu(self.children) - self._c0
        return False

    @property
    def sample(self) -> Sample:
        return Sample(self.wall, self.cpu)


def timed(fn: Callable, *args, children: bool = False, **kwargs) -> Sample:
    """One call of ``fn(*args, **kwargs)``, timed."""
    with Timer(children) as t:
        fn(*args, **kwargs)
    return t.sample


def repeat(fn: Callable, n: int, warmup: int = 0, children: bool = False) -> list[Sample]:
    """``warmup`` untimed calls, then ``n`` timed ones."""
    for _ in range(warmup):
        fn()
    return [timed(fn, children=children) for _ in range(n)]


def interleave(cells: dict[Hashable, Callable], rounds: int, warmup: int = 0,
               children: bool = False) -> dict[Hashable, list[Sample]]:
    """Every round runs each cell once, in order; ``warmup`` rounds are run first and dropped."""
    out: dict[Hashable, list[Sample]] = {k: [] for k in cells}
    for r in range(warmup + rounds):
        for k, fn in cells.items():
            s = timed(fn, children=children)
            if r >= warmup:
                out[k].append(s)
    return out


def walls(samples: Iterable[Sample]) -> list[float]:
    return [s.wall for s in samples]


def cpus(samples: Iterable[Sample]) -> list[float]:
    return [s.cpu for s in samples]


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def spread(xs: Iterable[float]) -> float:
    """(max - min) / median: the relative width of the runs (nan for no runs or a zero median)."""
    xs = list(xs)
    if not xs:
        return float("nan")
    med = statistics.median(xs)
    return (max(xs) - min(xs)) / med if med else float("nan")


def summary(xs: Iterable[float]) -> dict:
    """median, min, max and spread of a list of seconds (or rates)."""
    xs = list(xs)
    return {"median": median(xs), "min": min(xs), "max": max(xs), "spread": spread(xs), "n": len(xs)}
