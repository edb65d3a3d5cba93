#!/usr/bin/env python
"""Cost of the scan side of issue 23 (one number per value: chunk-end states by the token recurrence,
per-token reads on the side, rows scanned from their own first token): a plain forward and a
one-layer `states` read, "before" (another checkout's installed mixlens, e.g. main's .venv) against
"after" (this checkout's), interleaved round by round so a load change hits both alike.

    .venv/bin/python bench/bench_invariance_scan.py --before /work/main/.venv/bin/python --rounds 5

Models: the shipped ones (models/*-tinystories). Relative numbers only on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, sys, time
import numpy as np
import mixlens
model_dir, tokens, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = mixlens.StandardizedTransformer(model_dir, output="numpy")
ids = [np.random.default_rng(0).integers(3, 1000, size=tokens).tolist()]
layer = [i for i, k in enumerate(m.info["layer_kinds"]) if k != "attention"][0]
def plain():  # the same block as states() reading nothing (m.run's result handling is not the scan)
    with m.trace(ids, logits="last"):
        pass
def states():
    with m.trace(ids, logits="last"):
        s = m.layers[layer].linear_attn.states
        float(np.asarray(s[:, -1]).sum())
        del s
out = {}
for name, fn in (("plain", plain), ("states", states)):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    out[name] = ts
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="python of the checkout to compare against")
    ap.add_argument("--after", default=sys.executable)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--out", default=str(REPO / "bench/results/invariance-scan.md"))
    a = ap.parse_args()
    models = sorted(p for p in (REPO / "models").iterdir() if (p / "config.json").exists())
    rows = []
    for model in models:
        for T in a.tokens:
            res = {"before": {"plain": [], "states": []}, "after": {"plain": [], "states": []}}
            for r in range(a.rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for side in order:
                    py = a.before if side == "before" else a.after
                    got = json.loads(subprocess.run([py, "-c", WORKER, str(model), str(T), str(a.reps)], check=True,
                                                    capture_output=True, text=True).stdout)
                    for k, v in got.items():
                        res[side][k] += v
            med = {s: {k: statistics.median(v) for k, v in d.items()} for s, d in res.items()}
            rows.append((model.name, T, med))
            print(model.name, T, json.dumps(med), flush=True)
    lines = ["| model | tokens | plain before (ms) | plain after (ms) | after/before | states before (ms) | states after (ms) | after/before |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, T, med in rows:
        b, f = med["before"], med["after"]
        lines.append(f"| {name} | {T} | {1e3 * b['plain']:.1f} | {1e3 * f['plain']:.1f} | {f['plain'] / b['plain']:.3f} | "
                     f"{1e3 * b['states']:.1f} | {1e3 * f['states']:.1f} | {f['states'] / b['states']:.3f} |")
    print("\n".join(lines))
    Path(a.out + ".table").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
