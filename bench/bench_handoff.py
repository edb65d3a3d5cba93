#!/usr/bin/env python
"""Python hand-off cost: what reading N values inside one ``with model.trace(...)`` block adds.

    .venv/bin/python bench/bench_handoff.py [--model DIR] [--repeats R] [--out bench/results/handoff.md]

For N in 0, 1, 10, 100 the block reads the first N small values of the model in forward order
(layer_input, layer_output, betas, decays, ...: a few KiB each, so the copy is negligible and the
time is the hand-off: Python attribute lookup, the binding, the worker pausing and resuming). The
per-value cost is (t(N) - t(0)) / N with t the fastest of R alternating repeats (on a shared machine
the minimum is the run least disturbed by other load); the forward itself is the same work in every
block. A regression test was not added: on the loaded 2-core development machine the per-value
time ranged from 26 to 290 us between runs, no bound would be both meaningful and reliable there. Default model: a tiny random 24-layer Mamba-2 (hidden 64, made once with
transformers under build/), whose 8-token forward takes well under a millisecond, so the forward's
own jitter does not hide the hand-off; --model DIR measures another checkpoint.
Not a test: numbers depend on the machine and its load (printed with the result).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))


def tiny_model(out: Path) -> Path:
    """A random Mamba2ForCausalLM with 24 layers of width 64 (about 1,000 values per 8-token call)."""
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    cfg = Mamba2Config(hidden_size=64, num_hidden_layers=24, num_heads=8, head_dim=16, expand=2, state_size=16,
                       n_groups=1, vocab_size=256, chunk_size=8, tie_word_embeddings=True)
    Mamba2ForCausalLM(cfg).save_pretrained(out)
    return out


def small_paths(model, limit: int, max_numel: int = 1 << 16) -> list[str]:
    out = []
    for v in model.values(1, 8):
        n = 1
        for d in v["shape"]:
            n *= d
        if n <= max_numel and not v["path"].endswith("state_input"):
            out.append(v["path"])
    return out[:limit]


def envoy_reader(model, path: str):
    """model.layers[i].linear_attn.betas style access, as a user writes it."""
    parts = path.split(".")
    if parts[0] == "layers":
        obj = model.layers[int(parts[1])]
        for p in parts[2:-1]:
            obj = getattr(obj, p)
        last = parts[-1]
        return lambda: getattr(obj, last)
    return lambda: model._read(path)


def block_time(model, ids, readers) -> float:
    t0 = time.perf_counter()
    with model.trace([ids]):
        for r in readers:
            r()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: a tiny 24-layer Mamba-2 built under build/")
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--counts", default="0,1,10,100")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "handoff.md"))
    a = ap.parse_args(argv)
    os.environ.setdefault("MIXLENS_NUM_THREADS", str(a.threads))
    import mixlens

    path = a.model or str(tiny_model(REPO / "build" / "bench-handoff-mamba2-24l"))
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores", flush=True)
    model = mixlens.StandardizedTransformer(path)
    ids = [(i * 37 + 5) % 256 for i in range(8)]
    counts = [int(c) for c in a.counts.split(",")]
    paths = small_paths(model, max(counts))
    if len(paths) < max(counts):
        raise SystemExit(f"the model has only {len(paths)} small values; need {max(counts)}")
    readers = {n: [envoy_reader(model, p) for p in paths[:n]] for n in counts}
    for n in counts:  # warm-up
        block_time(model, ids, readers[n])
    times = {n: [] for n in counts}
    for _ in range(a.repeats):
        for n in counts:
            times[n].append(block_time(model, ids, readers[n]))
    med = {n: min(times[n]) for n in counts}
    load_after = os.getloadavg()
    rows = ["| values read | block time (ms, fastest) | per value (us) |", "|---|---|---|"]
    for n in counts:
        per = (med[n] - med[0]) / n * 1e6 if n else float("nan")
        rows.append(f"| {n} | {med[n] * 1e3:.3f} | {'-' if n == 0 else f'{per:.1f}'} |")
    text = "\n".join([
        "# Python hand-off: values read in one `with model.trace(...)` block",
        "",
        f"Model: {Path(path).name}, 8-token prompt, {a.threads} threads, {a.repeats} repeats (fastest). "
        f"Load average {load[0]:.2f} before, {load_after[0]:.2f} after, {os.cpu_count()} cores"
        + (" (busy machine: other work was running)" if load[0] > 1.0 else "") + ".",
        "",
        *rows,
        "",
    ])
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
