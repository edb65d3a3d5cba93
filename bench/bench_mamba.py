#!/usr/bin/env python
"""Mamba-1 speed, mixlens against transformers, measured in the same run on the same machine.

    .venv/bin/python bench/bench_mamba.py [--threads N] [--repeats R] [--out bench/results/mamba.md]

Model: the mamba-130m layout (state-spaces/mamba-130m-hf's exact config, random float32 weights;
built once by scripts/make_published_layout.py make_mamba1 and cached under build/published/).
Both sides run float32 on the CPU with the same thread count (MIXLENS_NUM_THREADS /
torch.set_num_threads). transformers runs its pure-torch path (no mamba_ssm / causal_conv1d
installed), the reference mixlens matches.

Measured (median of R timed runs after one warm-up):
  - prompt throughput, 128 and 1024 tokens, batch 1, full logits (tokens/s), mixlens with its
    default algorithm and with each selective-scan algorithm forced (route_kernels);
  - decode throughput: 32 single-token steps after a 16-token prompt, greedy (tokens/s);
  - reading `states` of all 24 layers inside a trace (mixlens only), each [1, T, 1536, 16] stack
    read and dropped in turn, against the same trace without reads.
Prints a markdown table and writes it to --out. Not a test: absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
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
    ap.add_argument("--lengths", default="128,1024")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "mamba.md"))
    return ap.parse_args()


ARGS = parse_args()
# Both libraries size their thread pools at first use: set the count before importing them.
os.environ["MIXLENS_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import MambaForCausalLM  # noqa: E402

import mixlens  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))
import make_published_layout  # noqa: E402


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up: first touch of weights, thread pools, allocator
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prompt_ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 50000, size=n).tolist()


def bench_prompt(ml, hf, n: int) -> dict:
    ids = prompt_ids(n, n)
    out = {}
    for route in ("default", "recurrent", "chunked"):
        mixlens.route_kernels("mamba", route)
        out[route] = n / median_time(lambda: ml.run([ids]), ARGS.repeats)
    mixlens.route_kernels("mamba", "default")
    x = torch.tensor([ids])

    def hf_run():
        with torch.no_grad():
            hf(input_ids=x, use_cache=True)

    out["transformers"] = n / median_time(hf_run, ARGS.repeats)
    return out


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
    t_ml = statistics.median(ml_decode() for _ in range(ARGS.repeats))
    t_hf = statistics.median(hf_decode() for _ in range(ARGS.repeats))
    return steps / t_ml, steps / t_hf


def bench_states(ml, n: int) -> tuple[float, float, int]:
    ids = [prompt_ids(n, n)]
    nbytes = 0

    def without():
        with ml.trace(ids):
            pass

    def with_states():
        nonlocal nbytes
        nbytes = 0
        with ml.trace(ids):
            for i in range(ml.num_layers):
                s = ml.layers[i].linear_attn.states
                nbytes += s.nbytes
                del s

    return median_time(without, ARGS.repeats), median_time(with_states, ARGS.repeats), nbytes


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
    layout = make_published_layout.cached_mamba1_130m(REPO / "build" / "published")
    ml = mixlens.StandardizedTransformer(str(layout))
    hf = MambaForCausalLM.from_pretrained(str(layout), dtype=torch.float32).eval()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    prompts = []
    for n in (int(x) for x in ARGS.lengths.split(",")):
        r = bench_prompt(ml, hf, n)
        prompts.append((n, r))
        print(f"prompt {n}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in r.items()), flush=True)
    dec = bench_decode(ml, hf, ARGS.decode_steps)
    print(f"decode: mixlens {dec[0]:.1f} tok/s, transformers {dec[1]:.1f} tok/s", flush=True)
    states = []
    for n, _ in prompts:
        t0, t1, nbytes = bench_states(ml, n)
        states.append((n, t0, t1, nbytes))
        print(f"states {n}: without {t0:.3f}s, with {t1:.3f}s ({nbytes / 2**30:.2f} GiB read)", flush=True)

    lines = [
        "# Mamba-1: mixlens vs transformers",
        "",
        f"mamba-130m layout (state-spaces/mamba-130m-hf config, random float32 weights), batch 1, "
        f"{ARGS.threads} threads on both sides, median of {ARGS.repeats} runs after a warm-up.",
        f"Machine: {cpu_name()}, {os.cpu_count()} logical CPUs, load average {load:.1f} at start "
        f"(shared machine: absolute numbers are noisy, the ratios are measured in the same run).",
        f"mixlens {git_commit()}, torch {torch.__version__}, transformers {transformers.__version__} "
        f"(pure-torch Mamba-1 path), {datetime.date.today().isoformat()}.",
        "",
        "| measurement | mixlens (default) | transformers | mixlens / transformers | mixlens token loop | mixlens chunked scan |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, r in prompts:
        lines.append(f"| prompt, {n} tokens (tokens/s) | {r['default']:,.1f} | {r['transformers']:,.1f} | "
                     f"{r['default'] / r['transformers']:.2f}x | {r['recurrent']:,.1f} | {r['chunked']:,.1f} |")
    lines.append(f"| decode, {ARGS.decode_steps} steps after 16 tokens (tokens/s) | {dec[0]:,.1f} | {dec[1]:,.1f} | "
                 f"{dec[0] / dec[1]:.2f}x | | |")
    lines += [
        "",
        "Reading `states` (the state after every token) of all 24 layers inside `with model.trace(...)`, "
        "each layer's `[1, T, 1536, 16]` stack read and dropped in turn:",
        "",
        "| prompt | trace without reads (s) | with all 24 `states` reads (s) | cost | data read |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for n, t0, t1, nbytes in states:
        lines.append(f"| {n} tokens | {t0:.3f} | {t1:.3f} | {t1 / t0:.2f}x | {nbytes / 2**30:.2f} GiB |")
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
