#!/usr/bin/env python
"""Cost of deterministic=True (batch-invariant matmuls, issue 23 item 2) against the default (OpenBLAS /
gemm16 for prompts), interleaved in one process on the harness layouts.

    .venv/bin/python bench/invariance_ab.py [--models mamba2,mamba,qwen3_5] [--rounds 7] [--decode 32]

Both models are loaded once (float32 checkpoints are memory-mapped, so the copies share the pages);
every round times each (prompt length, mode) once in alternating order (default first on even rounds,
deterministic first on odd ones), so load changes on a shared machine hit both alike. Prints the
median time per call, the spread (max - min) / median, and deterministic / default per row.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from mixlens_dev import timing
from mixlens_dev.common import REPO


def layout(name: str) -> Path:
    from mixlens_dev import published_layout as mpl

    if name == "mamba2":
        return mpl.cached_layout()
    if name == "mamba":
        return mpl.cached_mamba1_130m(REPO / "build" / "published")
    if name == "qwen3_5":
        return mpl.cached_qwen3_5_0_8b(REPO / "build" / "published")
    return Path(name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mamba2,mamba,qwen3_5")
    ap.add_argument("--prompts", default="128,1024")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    import mixlens

    print(f"load: {os.getloadavg()}, threads {os.environ.get('MIXLENS_NUM_THREADS', 'all')} of {os.cpu_count()}")
    print("| model | call | default s | spread | deterministic s | spread | det / default |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in a.models.split(","):
        path = str(layout(name))
        ms = {"default": mixlens.load(path, dtype=a.dtype), "det": mixlens.load(path, dtype=a.dtype, deterministic=True)}
        vocab = min(5000, int(ms["default"].info["vocab_size"]))
        rng = np.random.default_rng(0)
        prompts = {n: [int(t) for t in rng.integers(3, vocab, n)] for n in map(int, a.prompts.split(","))}
        start = [int(t) for t in rng.integers(3, vocab, 16)]

        def prompt(m, ids):
            t0 = time.perf_counter()
            m.run([ids], logits="last")
            return time.perf_counter() - t0

        def decode(m):
            cache = m.new_cache(1)
            tok = int(np.argmax(m.forward([start], cache=cache, logits="last")["logits"][0, -1]))
            t0 = time.perf_counter()
            for _ in range(a.decode):
                tok = int(np.argmax(m.forward([[tok]], cache=cache, logits="last")["logits"][0, -1]))
            return (time.perf_counter() - t0) / a.decode

        for m in ms.values():  # warm-up: pages, pools, arenas
            for ids in prompts.values():
                prompt(m, ids)
            decode(m)
        times: dict = {}
        for r in range(a.rounds):
            order = ["default", "det"] if r % 2 == 0 else ["det", "default"]
            for n, ids in prompts.items():
                for mode in order:
                    times.setdefault((f"prompt {n}", mode), []).append(prompt(ms[mode], ids))
            for mode in order:
                times.setdefault(("decode step", mode), []).append(decode(ms[mode]))
        for call in dict.fromkeys(k[0] for k in times):
            d, x = times[(call, "default")], times[(call, "det")]
            md, mx = timing.median(d), timing.median(x)
            print(f"| {name} | {call} | {md:.4g} | {timing.spread(d):.0%} | {mx:.4g} | "
                  f"{timing.spread(x):.0%} | {mx / md:.3f} |", flush=True)
        del ms
    print(f"load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
