#!/usr/bin/env python
"""Where the all-layer `states` read of bench/bench_state_after.py goes (issue 7 item 3): one process,
one layout, the "states, all layers" variant (or plain / the states read without the norm), one
warm-up then REPS timed calls, each split into the time spent getting every layer's `states` (our
forward up to that layer, the per-token replay and its streamed writes) and the time of the reader's
norm (torch, on the served stack). CPU seconds of the process are printed next to the wall seconds:
on a shared machine they are the steadier measure (bench/results/state_after.md).

    .venv/bin/python bench/bench_qwen_states_split.py [--mode states|nonorm|plain] [--reps N] [--tokens T]
    PYTHONPATH=/tmp/base-install .venv/bin/python bench/bench_qwen_states_split.py   # an A/B against a copy

With MIXLENS_PERF_CTL=FIFO the script writes "enable" there after the warm-up, for
`perf stat --control=fifo:FIFO -D -1` (count the timed calls only).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mixlens_dev.timing import Timer

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("states", "nonorm", "plain"), default="states")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("MIXLENS_NUM_THREADS", str(args.threads))
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    import mixlens

    from mixlens_dev import published_layout as mpl

    ml = mixlens.StandardizedTransformer(str(mpl.cached_qwen3_5_0_8b(REPO / "build" / "published")))
    T = args.tokens
    ids = np.random.default_rng(T).integers(3, 50000, size=T).tolist()  # the bench's prompt
    rec = [i for i, k in enumerate(ml.info["layer_kinds"]) if k not in ("attention", "mlp", "moe")]

    def once():
        got = [0.0, 0.0, 0.0, 0.0]  # wall / CPU getting the stacks, wall / CPU of the norms
        with Timer() as whole:
            if args.mode == "plain":
                ml.run([ids], logits="last")
            else:
                with ml.trace([ids], logits="last"):
                    for i in rec:
                        with Timer() as get:
                            s = ml.layers[i].linear_attn.states
                        with Timer() as norm:
                            if args.mode == "states":
                                float(s.norm()) if hasattr(s, "norm") else float(np.linalg.norm(s))
                            del s
                        got = [got[0] + get.wall, got[1] + get.cpu, got[2] + norm.wall, got[3] + norm.cpu]
        return whole.wall, whole.cpu, got

    once()
    if ctl := os.environ.get("MIXLENS_PERF_CTL"):
        Path(ctl).write_text("enable\n")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {T} tokens, {args.threads} threads")
    for _ in range(args.reps):
        w, c, g = once()
        print(f"{args.mode}: wall {w:.3f} s, CPU {c:.3f} s | getting the stacks: wall {g[0]:.3f}, CPU {g[1]:.3f} | "
              f"norms: wall {g[2]:.3f}, CPU {g[3]:.3f} | load {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
