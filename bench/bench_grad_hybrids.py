#!/usr/bin/env python
"""Native gradients of the Mamba-2 hybrids (issue 12): forward + backward time relative to a forward,
per family, on small random layouts (scripts/make_fixtures_hybrids.py's builder, sizes below).

    .venv/bin/python bench/bench_grad_hybrids.py [--threads N] [--repeats R] [--tokens 128] [--out bench/results/grad_hybrids.md]

Forward: `model.trace(ids)` reading every layer_output; forward + backward: the same with grad=True and
`tr.backward(LogProb)`. The two alternate (interleaved) R times after a warm-up; the report gives the
median ratio of process CPU time (less sensitive than wall time to other jobs on a shared machine)
and of wall time, with the load average before and after. Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--out", default=str(REPO / "bench" / "results" / "grad_hybrids.md"))
ARGS = ap.parse_args()
os.environ["MIXLENS_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402

import mixlens  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))
import make_fixtures_hybrids as mh  # noqa: E402

SIZE = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)
LAYOUTS = {
    "nemotron_h": dict(SIZE, hybrid_override_pattern="M-M*M-M-", mamba_num_heads=8, mamba_head_dim=32,
                       ssm_state_size=64, n_groups=2, head_dim=32, chunk_size=64),
    "bamba": dict(SIZE, num_hidden_layers=6, attn_layer_indices=[2], mamba_n_heads=8, mamba_d_head=64,
                  mamba_n_groups=1, mamba_d_state=64, mamba_chunk_size=64),
    "falcon_h1": dict(SIZE, num_hidden_layers=6, mamba_d_ssm=512, mamba_n_heads=8, mamba_d_head=64,
                      mamba_n_groups=1, mamba_d_state=64, mamba_chunk_size=64),
}


def main():
    rows = []
    load0 = os.getloadavg()
    for fam, cfg in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as d:
            mh.build_model(fam, cfg, seed=1).save_pretrained(d)
            m = mixlens.StandardizedTransformer(d)
            ids = [np.random.default_rng(0).integers(1, cfg["vocab_size"], ARGS.tokens).tolist()]
            n = m.num_layers if hasattr(m, "num_layers") else len(m.info["layer_kinds"])
            paths = [f"layers.{i}.layer_output" for i in range(n)]

            def fwd():
                with m.trace(ids, saves=paths):
                    pass

            def fwd_bwd():
                with m.trace(ids, saves=paths, grad=True) as tr:
                    pass
                tr.backward(mixlens.metrics.LogProb(5))

            fwd(), fwd_bwd()  # warm-up
            cpu = {"f": [], "fb": []}
            wall = {"f": [], "fb": []}
            for _ in range(ARGS.repeats):
                for k, fn in (("f", fwd), ("fb", fwd_bwd)):
                    c0, w0 = time.process_time(), time.perf_counter()
                    fn()
                    cpu[k].append(time.process_time() - c0)
                    wall[k].append(time.perf_counter() - w0)
            rc = statistics.median(b / a for a, b in zip(cpu["f"], cpu["fb"]))
            rw = statistics.median(b / a for a, b in zip(wall["f"], wall["fb"]))
            rows.append((fam, statistics.median(cpu["f"]), statistics.median(cpu["fb"]), rc, rw))
            print(rows[-1], flush=True)
    load1 = os.getloadavg()
    lines = [
        "# Hybrid gradients: forward + backward vs forward (bench/bench_grad_hybrids.py)",
        "",
        f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {ARGS.tokens} tokens, batch 1, {ARGS.threads} threads, "
        f"{ARGS.repeats} interleaved repeats; load average {load0[0]:.1f} before, {load1[0]:.1f} after "
        f"({os.cpu_count()} CPUs).",
        "",
        "| family | forward CPU s | fwd+bwd CPU s | ratio (CPU) | ratio (wall) |",
        "| --- | --- | --- | --- | --- |",
    ] + [f"| {f} | {a:.3f} | {b:.3f} | {rc:.2f}x | {rw:.2f}x |" for f, a, b, rc, rw in rows]
    Path(ARGS.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
