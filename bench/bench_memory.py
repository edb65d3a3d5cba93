#!/usr/bin/env python
"""Page faults and time of a mamba2-130m prompt with and without the activation arena (issue 9 item 4).

    .venv/bin/python bench/bench_memory.py [--tokens 1024] [--calls 3] [--out bench/results/memory.md]

Each configuration runs in its own process (the arena's size is read once per process from
MIXLENS_ARENA_MB; 0 turns pooling off): load the mamba2-130m layout, run the prompt once (warm-up),
then `--calls` more times, reporting per call the minor page faults (getrusage ru_minflt) and the
wall time, median. Prefill chunking on (default) and off, since the chunk size sets the working set.
Not a test: absolute numbers depend on the machine and its load (printed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from mixlens_dev.timing import median, timed

REPO = Path(__file__).resolve().parents[1]


def child(tokens: int, calls: int, prefill: int) -> dict:
    import numpy as np

    import mixlens
    from mixlens_dev.published_layout import cached_layout

    m = mixlens.StandardizedTransformer(str(cached_layout()))
    m.prefill_chunk = prefill
    ids = np.random.default_rng(0).integers(3, 50000, size=tokens).tolist()
    m.run([ids], logits="last")
    faults, times = [], []
    for _ in range(calls):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times.append(timed(m.run, [ids], logits="last").wall)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {"faults": median(faults), "seconds": median(times),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "memory.md"))
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.tokens, a.calls, a.prefill)))
        return 0
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores", flush=True)
    rows = []
    for prefill in (512, 0):
        for arena in ("256", "0"):
            env = dict(os.environ, MIXLENS_ARENA_MB=arena, MIXLENS_NUM_THREADS=str(a.threads),
                       OPENBLAS_NUM_THREADS=str(a.threads))
            r = subprocess.run([sys.executable, __file__, "--child", "--tokens", str(a.tokens), "--calls", str(a.calls),
                                "--prefill", str(prefill)], capture_output=True, text=True, env=env)
            if r.returncode != 0:
                print(r.stderr[-2000:])
                return 1
            res = json.loads(r.stdout.strip().splitlines()[-1])
            rows.append((prefill, arena, res))
            print(prefill, arena, res, flush=True)
    load_end = os.getloadavg()
    lines = ["# Activation arena: page faults of a repeated mamba2-130m prompt", "",
             f"{a.tokens}-token prompt, logits of the last position, {a.threads} threads, median of {a.calls} calls "
             f"after a warm-up, one process per row. Load average {load[0]:.2f} at start, {load_end[0]:.2f} at end on "
             f"{os.cpu_count()} cores" + (" (busy machine: times are noisy; fault counts are not)" if load[0] > 1 else "")
             + ".", "",
             "| prefill chunk | arena | minor faults per call | seconds per call | process peak RSS MiB |",
             "|---|---|---|---|---|"]
    for prefill, arena, res in rows:
        lines.append(f"| {prefill or 'off'} | {'on (256 MiB)' if arena != '0' else 'off'} | {res['faults']:,.0f} | "
                     f"{res['seconds']:.3f} | {res['peak_rss_mib']:,.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
