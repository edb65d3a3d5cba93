#!/usr/bin/env python
"""Decode speed of two `mixlens` CLI builds, A/B interleaved, by CPU time (for a shared machine).

    .venv/bin/python bench/bench_decode_ab.py --a /tmp/base/bin/mixlens --b .venv/bin/mixlens \
        [--model DIR] [--threads 2] [--rounds 7] [--short 24] [--long 120]

Each round runs both builds (order alternating) with `generate --greedy` for --short and --long new
tokens; the decode-only cost is the difference (long - short) / (long - short tokens), so loading,
the prompt and start-up cancel out. Reported per build: decode tokens/s by CPU time (user + system of
the child, every thread: what a spinning or waiting pool costs shows up here) and by wall time,
median over rounds, and the B/A ratio per round. Default model: random weights at mamba-130m's
published config (mixlens_dev/published_layout.py, built once under build/published). The load
average is printed; wall numbers on a busy machine are mostly scheduler noise, the CPU ones less so.
Not a test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from mixlens_dev.timing import median, timed

REPO = Path(__file__).resolve().parents[1]


def run_once(exe: str, model: str, ids: str, n: int, threads: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one `generate` run."""
    env = dict(os.environ, MIXLENS_NUM_THREADS=str(threads))
    s = timed(subprocess.run, [exe, "generate", "--model", model, "--ids", ids, "--max-new-tokens", str(n), "--greedy"],
              check=True, env=env, stdout=subprocess.DEVNULL, children=True)
    return s.cpu, s.wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="baseline mixlens CLI")
    ap.add_argument("--b", required=True, help="candidate mixlens CLI")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--short", type=int, default=24)
    ap.add_argument("--long", type=int, default=120)
    a = ap.parse_args(argv)
    model = a.model
    if model is None:
        from mixlens_dev import published_layout as make_published_layout

        model = str(make_published_layout.cached_mamba1_130m())
    ids = ",".join(str(i) for i in range(1, 9))
    load0 = os.getloadavg()
    print(f"load average before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} on {os.cpu_count()} cores", flush=True)
    builds = {"A": a.a, "B": a.b}
    rate = {k: {"cpu": [], "wall": []} for k in builds}
    ratios = {"cpu": [], "wall": []}
    n_dec = a.long - a.short
    for r in range(a.rounds):
        order = ["A", "B"] if r % 2 == 0 else ["B", "A"]
        got = {}
        for k in order:
            c_s, w_s = run_once(builds[k], model, ids, a.short, a.threads)
            c_l, w_l = run_once(builds[k], model, ids, a.long, a.threads)
            got[k] = (n_dec / max(c_l - c_s, 1e-9), n_dec / max(w_l - w_s, 1e-9))
            rate[k]["cpu"].append(got[k][0])
            rate[k]["wall"].append(got[k][1])
        ratios["cpu"].append(got["B"][0] / got["A"][0])
        ratios["wall"].append(got["B"][1] / got["A"][1])
        print(f"round {r}: A cpu {got['A'][0]:.1f} tok/s wall {got['A'][1]:.1f}; B cpu {got['B'][0]:.1f} wall "
              f"{got['B'][1]:.1f}; B/A cpu {ratios['cpu'][-1]:.3f} wall {ratios['wall'][-1]:.3f}", flush=True)
    load1 = os.getloadavg()
    print()
    print(f"Model {Path(model).name}, {a.threads} threads, decode = tokens {a.short + 1}..{a.long} "
          f"(difference of two runs), {a.rounds} rounds interleaved. Load average {load0[0]:.2f} before, "
          f"{load1[0]:.2f} after, {os.cpu_count()} cores.")
    print()
    print("| build | decode tok/s per CPU-second (median) | decode tok/s wall (median) |")
    print("|---|---|---|")
    for k in builds:
        print(f"| {k}: {builds[k]} | {median(rate[k]['cpu']):.1f} | {median(rate[k]['wall']):.1f} |")
    print()
    print(f"B/A per round, CPU: {', '.join(f'{x:.3f}' for x in ratios['cpu'])} (median "
          f"{median(ratios['cpu']):.3f}); wall: {', '.join(f'{x:.3f}' for x in ratios['wall'])} "
          f"(median {median(ratios['wall']):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
