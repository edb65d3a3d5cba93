#!/usr/bin/env python
"""Cost of exact token mixing (issue 26 item 1, speed section): `model.token_mixing` of one layer
(every head, every row and column: [1, H, T, T]) against a plain forward of the same prompt.

Run on a quiet machine (not in the test suite; --smoke runs the shipped tiny model for seconds):

    .venv/bin/python bench/bench_token_mixing.py                        # 1,024 and 4,096 tokens
    .venv/bin/python bench/bench_token_mixing.py --families mamba2 --tokens 1024 --repeats 2
    .venv/bin/python bench/bench_token_mixing.py --smoke

Models: the published layouts with random weights (mixlens_dev/published_layout.py: mamba2-130m and
Qwen3.5-0.8B shapes, float32), built once under build/. For each length, batch 1:
  - plain: `model.run(ids, logits="last")`, nothing read;
  - token_mixing: `model.token_mixing(ids, layer)` of the middle recurrent layer (one forward with the
    layer's scan inputs saved, then the mixing: SSD's `L o C B^T` with dt; the delta rule chunk by
    chunk in float64);
  - token_mixing, one row: `rows=-1` (what a generation step's full row costs).
Target (issue 26): token_mixing <= 2x plain. Memory: [1, H, T, T] float32 is H * 64 MiB at 4,096
tokens (mamba2-130m: 24 heads, 1.5 GiB). Results are printed as one JSON line per cell.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mixlens_dev import timing

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default="mamba2,qwen3_5,mamba", help="comma list of mamba2, qwen3_5, mamba")
    p.add_argument("--tokens", default="1024,4096", help="comma list of prompt lengths")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="MIXLENS_NUM_THREADS (0: leave as is)")
    p.add_argument("--smoke", action="store_true", help="the shipped tiny model, 64 tokens, one repeat")
    return p.parse_args(argv)


def layout(family: str) -> Path:
    from mixlens_dev import published_layout as mpl

    if family == "mamba2":
        return mpl.cached_layout(REPO / "build")
    if family == "mamba":
        return mpl.cached_mamba1_130m(REPO / "build" / "published")
    return mpl.cached_qwen3_5_0_8b(REPO / "build" / "published")


# Per-channel kinds (Mamba-1: H = d_inner = 1,536 channels) would need H x T^2 floats (6 GiB at 1,024
# tokens): they are read by block, here 64 channels (heads=slice(0, 64)) and every channel's last row.
PER_CHANNEL_BLOCK = 64


def bench(path: Path, tokens: list[int], repeats: int) -> list[dict]:
    import numpy as np

    import mixlens

    m = mixlens.StandardizedTransformer(str(path), output="numpy")
    layers = sorted({v["layer"] for v in m.values() if v["path"].endswith(".linear_attn.token_mixing")})
    layer = layers[len(layers) // 2]
    rows = []
    for n in tokens:
        ids = np.random.default_rng(n).integers(3, min(5000, m.vocab_size), size=n).tolist()
        per_channel = m._core.info["model_type"] in ("mamba", "falcon_mamba")
        heads = slice(0, PER_CHANNEL_BLOCK) if per_channel else None
        cells = {"plain": lambda: m.run([ids], logits="last"),
                 "token_mixing": lambda: m.token_mixing([ids], layer, heads=heads),
                 "token_mixing_row": lambda: m.token_mixing([ids], layer, rows=-1)}
        got = {k: timing.repeat(fn, repeats, warmup=1) for k, fn in cells.items()}
        walls = {k: min(s.wall for s in v) for k, v in got.items()}
        rows.append({"model": path.name, "layer": layer, "tokens": n,
                     "heads": f"0:{PER_CHANNEL_BLOCK}" if per_channel else "all",
                     **{f"{k}_s": round(v, 4) for k, v in walls.items()},
                     "ratio": round(walls["token_mixing"] / walls["plain"], 2)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.threads:
        os.environ["MIXLENS_NUM_THREADS"] = str(a.threads)
    print(json.dumps({"loadavg": os.getloadavg()[0]}), flush=True)
    if a.smoke:
        bench(REPO / "models" / "mamba2-tinystories", [64], 1)
        return 0
    for fam in a.families.split(","):
        bench(layout(fam), [int(t) for t in a.tokens.split(",")], a.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
