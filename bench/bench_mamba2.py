#!/usr/bin/env python
"""Mamba-2 speed, mixlens against transformers, measured in the same run on the same machine.

    .venv/bin/python bench/bench_mamba2.py [--threads N] [--repeats R] [--out bench/results/mamba2.md]

Model: the mamba2-130m layout (AntonV/mamba2-130m-hf's exact config, random weights; built once by
scripts/make_published_layout.py and cached under build/). Both sides run float32 on the CPU with
the same thread count (MIXLENS_NUM_THREADS / torch.set_num_threads). transformers runs its
pure-torch path (no mamba_ssm / causal_conv1d kernels installed), the reference mixlens matches.

Measured as the best of R timed runs after one warm-up, mixlens and transformers alternating run by
run (on a shared machine the minimum is the measurement least disturbed by other load):
  - prompt throughput, 128 and 1024 tokens, batch 1, full logits (tokens/s);
  - decode throughput: 32 single-token steps after a 16-token prompt, greedy (tokens/s);
  - reading `states` of all 24 layers inside a trace (mixlens only; transformers has no per-token
    state without chunk_size 1): time with the reads vs the same trace without. Each layer's stack
    is read and dropped in turn (1024 tokens x 24 layers would be 19 GiB if kept).
Prints a markdown table and writes it to --out. Not a test: absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "mamba2.md"))
    return ap.parse_args()


ARGS = parse_args()
# Both libraries size their thread pools at first use: set the count before importing them.
os.environ["MIXLENS_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Mamba2ForCausalLM  # noqa: E402

import mixlens  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))
import published_layout_cache  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best_times(fns, repeats: int) -> list[float]:
    """Best time of each function over `repeats` rounds, the functions alternating within a round."""
    for fn in fns:
        fn()  # warm-up: first touch of weights, thread pools, allocator
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], timed(fn))
    return best


def prompt_ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 50000, size=n).tolist()


def bench_prompt(ml, hf, n: int) -> tuple[float, float]:
    ids = prompt_ids(n, n)
    x = torch.tensor([ids])

    def hf_run():
        with torch.no_grad():
            hf(input_ids=x, use_cache=True)

    t_ml, t_hf = best_times([lambda: ml.run([ids]), hf_run], ARGS.repeats)
    return n / t_ml, n / t_hf


def bench_decode(ml, hf, steps: int) -> tuple[float, float]:
    prompt = prompt_ids(16, 7)

    def ml_decode() -> float:
        cache = ml.new_cache(1)
        tok = int(ml.forward([prompt], cache=cache)["logits"][0, -1].argmax())
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = int(ml.forward([[tok]], cache=cache)["logits"][0, -1].argmax())
        return time.perf_counter() - t0

    def hf_decode() -> float:
        with torch.no_grad():
            out = hf(input_ids=torch.tensor([prompt]), use_cache=True)
            tok = out.logits[:, -1].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = hf(input_ids=tok[:, None], cache_params=out.cache_params, use_cache=True)
                tok = out.logits[:, -1].argmax(-1)
            return time.perf_counter() - t0

    ml_decode(), hf_decode()  # warm-up
    t_ml = t_hf = float("inf")
    for _ in range(ARGS.repeats):
        t_ml = min(t_ml, ml_decode())
        t_hf = min(t_hf, hf_decode())
    return steps / t_ml, steps / t_hf


def bench_states(ml, n: int) -> tuple[float, float, int]:
    ids = [prompt_ids(n, n)]
    layers = ml.num_layers
    nbytes = 0

    def without():
        with ml.trace(ids):
            pass

    def with_states():
        nonlocal nbytes
        nbytes = 0
        with ml.trace(ids):
            for i in range(layers):
                s = ml.layers[i].linear_attn.states
                nbytes += s.nbytes
                del s

    t_without, t_with = best_times([without, with_states], ARGS.repeats)
    return t_without, t_with, nbytes


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main() -> int:
    torch.set_num_threads(ARGS.threads)
    layout = published_layout_cache.cached_layout(REPO / "build")
    ml = mixlens.StandardizedTransformer(str(layout))
    hf = Mamba2ForCausalLM.from_pretrained(str(layout), dtype=torch.float32).eval()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    rows = []
    for n in (128, 1024):
        a, b = bench_prompt(ml, hf, n)
        rows.append((f"prompt, {n} tokens (tokens/s)", a, b))
        print(f"prompt {n}: mixlens {a:.1f} tok/s, transformers {b:.1f} tok/s", flush=True)
    a, b = bench_decode(ml, hf, ARGS.decode_steps)
    rows.append((f"decode, {ARGS.decode_steps} steps after 16 tokens (tokens/s)", a, b))
    print(f"decode: mixlens {a:.1f} tok/s, transformers {b:.1f} tok/s", flush=True)
    states = []
    for n in (128, 1024):
        t0, t1, nbytes = bench_states(ml, n)
        states.append((n, t0, t1, nbytes))
        print(f"states {n}: without {t0:.3f}s, with {t1:.3f}s ({nbytes / 2**30:.2f} GiB read)", flush=True)

    end_load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# Mamba-2: mixlens vs transformers",
        "",
        f"mamba2-130m layout (AntonV/mamba2-130m-hf config, random float32 weights), batch 1, "
        f"{ARGS.threads} threads on both sides, best of {ARGS.repeats} alternating runs after a warm-up.",
        f"Machine: {cpu_name()}, {os.cpu_count()} logical CPUs, load average {load:.1f} at start and "
        f"{end_load:.1f} at the end (a shared machine: absolute numbers are noisy; the ratios come from "
        f"interleaved runs).",
        f"mixlens {git_commit()}, torch {torch.__version__}, transformers {transformers.__version__} "
        f"(pure-torch Mamba-2 path), {datetime.date.today().isoformat()}.",
        "",
        "| measurement | mixlens | transformers | mixlens / transformers |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, a, b in rows:
        lines.append(f"| {name} | {a:,.1f} | {b:,.1f} | {a / b:.2f}x |")
    lines += [
        "",
        "Reading `states` (the state after every token) of all 24 layers inside `with model.trace(...)`, "
        "each layer's `[1, T, 24, 128, 64]` stack read and dropped in turn:",
        "",
        "| prompt | trace without reads (s) | with all 24 `states` reads (s) | cost | data read |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for n, t0, t1, nbytes in states:
        lines.append(f"| {n} tokens | {t0:.3f} | {t1:.3f} | {t1 / t0:.2f}x | {nbytes / 2**30:.2f} GiB |")
    lines += [
        "",
        "The `states` cost is memory traffic, not arithmetic: each asked-for stack is written once by the kernel "
        "(replayed from the chunk-boundary states) and copied once for the caller, both into freshly mapped pages.",
    ]
    table = "\n".join(lines) + "\n"
    print()
    print(table)
    out = Path(ARGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
