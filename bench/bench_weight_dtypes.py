#!/usr/bin/env python
"""Decode and prompt speed of one checkpoint under each weight format, A/B interleaved (issue 27):

* ``f32``: float32 weights (the float32 checkpoint, dtype float32);
* ``bf16-copy``: bfloat16 converted at load from the float32 checkpoint into our own buffers, which
  are 2 MiB aligned and advised as transparent huge pages;
* ``bf16-mapped``: the same bfloat16 weights served from the file's mapping (a ``mixlens convert``
  folder loaded with dtype auto: the page cache's 4 KiB pages, no copy);
* ``int8``: quantized at load (blocks of 32, Q8_0-like), our buffers (huge pages).

    .venv/bin/python bench/bench_weight_dtypes.py [--model DIR] [--rounds 5] [--threads 2]

bf16-copy and bf16-mapped hold bitwise the same weights and give the same numbers (checked here on
the generated tokens), so their ratio is the A/B of the mapping against huge pages. Decode =
(long - short) new tokens from the difference of two ``mixlens generate`` runs (load, prompt and
start-up cancel); prompt = ``mixlens run`` of --prompt tokens minus a 1-token run, as tokens/s.
Median over rounds, ± half the spread. The load average is printed: run it on a quiet machine. Not a test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from mixlens_dev.timing import median

REPO = Path(__file__).resolve().parents[1]
CLI = str(REPO / ".venv" / "bin" / "mixlens")


def wall(args: list[str], threads: int) -> tuple[float, str]:
    import time

    env = dict(os.environ, MIXLENS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads))
    env.pop("OMP_WAIT_POLICY", None)
    t0 = time.perf_counter()
    out = subprocess.run([CLI] + args, check=True, env=env, capture_output=True, text=True).stdout
    return time.perf_counter() - t0, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a float32 checkpoint (default: the mamba2-130m layout)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=80)
    ap.add_argument("--prompt", type=int, default=512)
    a = ap.parse_args(argv)
    model = a.model
    if model is None:
        from mixlens_dev import published_layout

        model = str(published_layout.cached_layout())
    bf16_dir = Path(tempfile.gettempdir()) / f"mixlens-bench-bf16-{Path(model).name}"
    if not (bf16_dir / "model.safetensors").is_file():
        subprocess.run([CLI, "convert", "--model", model, "--out", str(bf16_dir)], check=True, capture_output=True)
    cells = {"f32": (model, "float32"), "bf16-copy": (model, "bfloat16"), "bf16-mapped": (str(bf16_dir), "auto"),
             "int8": (model, "int8")}
    ids = ",".join(str(1 + i % 200) for i in range(16))
    long_ids = ",".join(str(1 + (7 * i) % 1000) for i in range(a.prompt))
    load0 = os.getloadavg()
    dec = {k: [] for k in cells}
    pro = {k: [] for k in cells}
    tokens = {}
    n_dec = a.long - a.short
    for r in range(a.rounds):
        order = list(cells) if r % 2 == 0 else list(reversed(cells))
        for k in order:
            path, dt = cells[k]
            gen = ["generate", "--model", path, "--dtype", dt, "--ids", ids, "--greedy", "--max-new-tokens"]
            ts, _ = wall(gen + [str(a.short)], a.threads)
            tl, out = wall(gen + [str(a.long)], a.threads)
            dec[k].append(n_dec / max(tl - ts, 1e-9))
            tokens[k] = out
            run = ["run", "--model", path, "--dtype", dt, "--ids", "--save", "logits", "--out", str(Path(tempfile.gettempdir()) / "mixlens-bench-out.safetensors")]
            p1, _ = wall(run[:5] + ["1"] + run[5:], a.threads)
            pn, _ = wall(run[:5] + [long_ids] + run[5:], a.threads)
            pro[k].append((a.prompt - 1) / max(pn - p1, 1e-9))
        print(f"round {r}: " + ", ".join(f"{k} decode {dec[k][-1]:.1f} prompt {pro[k][-1]:.0f}" for k in cells), flush=True)
    load1 = os.getloadavg()
    same = tokens["bf16-copy"] == tokens["bf16-mapped"]

    def cell(v):
        m = median(v)
        return f"{m:,.1f} ±{(max(v) - min(v)) / 2 / m * 100:.0f}%"

    print()
    print(f"Model {Path(model).name}, {a.threads} threads, {a.rounds} rounds interleaved; decode = tokens "
          f"{a.short + 1}..{a.long} after a 16-token prompt; prompt = {a.prompt} tokens. Load average "
          f"{load0[0]:.2f} / {load0[1]:.2f} before, {load1[0]:.2f} after, {os.cpu_count()} cores. "
          f"bf16-copy and bf16-mapped generated {'the same' if same else 'DIFFERENT'} tokens.")
    print()
    print("| weights | decode tok/s | prompt tok/s | decode / f32 |")
    print("|---|---|---|---|")
    for k in cells:
        print(f"| {k} | {cell(dec[k])} | {cell(pro[k])} | {median(dec[k]) / median(dec['f32']):.2f}x |")
    print()
    print(f"bf16-mapped / bf16-copy decode per round: "
          + ", ".join(f"{x / y:.3f}" for x, y in zip(dec["bf16-mapped"], dec["bf16-copy"])))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
