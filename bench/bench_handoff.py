#!/usr/bin/env python
"""Python hand-off cost: what reading N values inside one ``with model.trace(...)`` block adds.

    .venv/bin/python bench/bench_handoff.py [--model DIR] [--repeats R] [--out bench/results/handoff.md]

For N in 0, 1, 10, 100 the block reads the first N small values of the model in forward order
(layer_input, layer_output, betas, decays, ...: a few KiB each, so the copy is negligible and the
time is the hand-off: Python attribute lookup, the binding, the forward pausing and resuming). The
per-value cost is (t(N) - t(0)) / N, for wall time (fastest and median of R repeats, the counts
interleaved block by block) and for process CPU time (least of the repeats; every thread counts: the
block, the forward, the pool's threads). To compare two builds, run the script with each one's Python
in turn and --label. Default model: a tiny random 24-layer Mamba-2 (hidden 64, made once with
transformers under build/), whose 8-token forward takes well under a millisecond, so the forward's
own jitter does not hide the hand-off; --model DIR measures another checkpoint.
Not a test: numbers depend on the machine and its load (printed with the result).
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def block_time(model, ids, readers) -> tuple[float, float]:
    """(wall, process CPU) seconds of one block; CPU time counts every thread (the forward's, a spinning wait)."""
    c0, t0 = time.process_time(), time.perf_counter()
    with model.trace([ids]):
        for r in readers:
            r()
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: a tiny 24-layer Mamba-2 built under build/")
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--counts", default="0,1,10,100")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--label", default="mixlens", help="names this build in the table (to compare builds run in turn)")
    ap.add_argument("--output", choices=("auto", "torch", "numpy"), default=None,
                    help="value type read (MIXLENS_OUTPUT; default: $MIXLENS_OUTPUT, else auto = torch when installed)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "handoff.md"))
    a = ap.parse_args(argv)
    os.environ.setdefault("MIXLENS_NUM_THREADS", str(a.threads))
    if a.output:
        os.environ["MIXLENS_OUTPUT"] = a.output
    import mixlens

    path = a.model or str(tiny_model(REPO / "build" / "bench-handoff-mamba2-24l"))
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores", flush=True)
    model = mixlens.StandardizedTransformer(path)
    ids = [(i * 37 + 5) % 256 for i in range(8)]
    counts = [int(c) for c in a.counts.split(",")]
    modes = [a.label]
    paths = small_paths(model, max(counts))
    if len(paths) < max(counts):
        raise SystemExit(f"the model has only {len(paths)} small values; need {max(counts)}")
    readers = {n: [envoy_reader(model, p) for p in paths[:n]] for n in counts}
    for mode in modes:  # warm-up
        for n in counts:
            block_time(model, ids, readers[n])
    wall = {(m, n): [] for m in modes for n in counts}
    cpu = {(m, n): [] for m in modes for n in counts}
    for _ in range(a.repeats):
        for mode in modes:
            for n in counts:
                w, c = block_time(model, ids, readers[n])
                wall[(mode, n)].append(w)
                cpu[(mode, n)].append(c)
    load_after = os.getloadavg()
    rows = ["| hand-off | values read | block wall (ms, fastest) | per value wall (us) | per value wall, median (us) "
            "| block CPU (ms, least) | per value CPU (us) |", "|---|---|---|---|---|---|---|"]
    for mode in modes:
        fast = {n: min(wall[(mode, n)]) for n in counts}
        med = {n: statistics.median(wall[(mode, n)]) for n in counts}
        least = {n: min(cpu[(mode, n)]) for n in counts}

        def per(d, n):
            return "-" if n == 0 else f"{(d[n] - d[0]) / n * 1e6:.1f}"

        for n in counts:
            rows.append(f"| {mode} | {n} | {fast[n] * 1e3:.3f} | {per(fast, n)} | {per(med, n)} | {least[n] * 1e3:.3f} "
                        f"| {per(least, n)} |")
    text = "\n".join([
        "# Python hand-off: values read in one `with model.trace(...)` block",
        "",
        f"Model: {Path(path).name}, 8-token prompt, {a.threads} threads, {a.repeats} repeats (counts interleaved "
        f"block by block), values as {model.output_format}, mixlens {mixlens.__file__}. Load average {load[0]:.2f} before, {load_after[0]:.2f} after, {os.cpu_count()} cores"
        + (" (busy machine: other work was running)" if load[0] > 1.0 else "") + ".",
        "Per value = (t(N) - t(0)) / N. Wall: fastest and median of the repeats; CPU: process CPU time (every "
        "thread: the Python block, the forward, any spinning wait), least of the repeats.",
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
