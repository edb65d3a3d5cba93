"""Fidelity of narrow weights (issue 27 item 2): for each model, logits KL / top-1 of int8 against
bfloat16 and float32, and the relative RMS error of every value kind (states included) under int8
and bfloat16 against the float32 load, as a markdown table for docs/values.md "int8 weights".

    python -m mixlens_dev.int8_fidelity MODEL_DIR... [--tokens 128] [--out FILE.md]

A value kind is a path's last component (``states``, ``betas``, ``layer_output``, ...); its error is
the largest relative RMS over the layers that serve it (relative to the float32 value's RMS).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

import mixlens

TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
        "friends. One day, Lily found a shiny red ball under a big tree. She was very happy and wanted to show it "
        "to her mom. Lily ran home as fast as she could. When she got home, her mom was in the kitchen making "
        "cookies. Lily said, \"Mom, look what I found!\" Her mom smiled and said, \"That is a very pretty ball, "
        "Lily. Where did you find it?\" Lily told her mom about the big tree in the park.")

DTYPES = ("float32", "bfloat16", "int8")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    den = float((b.astype(np.float64) ** 2).sum())
    return float(np.sqrt(((a.astype(np.float64) - b) ** 2).sum() / den)) if den > 0 else float(np.abs(a - b).max())


def measure(path: str, tokens: int) -> dict:
    runs = {}
    # "int8x16": int8 with deterministic=True, where every product rounds x to int16 as decode-sized
    # ones do; against "int8" (this prompt's products multiply float32 x) it isolates that rounding.
    for dt in DTYPES + ("int8x16",):
        m = mixlens.load(path, dtype="int8" if dt == "int8x16" else dt, output="numpy", deterministic=dt == "int8x16")
        try:
            ids = m.tokenizer.encode(TEXT)[:tokens]
        except mixlens.TokenizerError:  # random-weight layouts may ship no tokenizer
            ids = [1 + (7 * i) % 1000 for i in range(tokens)]
        T = len(ids)
        paths = sorted({v["path"] for v in m.values(batch=1, seq=T)} - {"input_ids"})
        paths = [p for p in paths if not p.endswith(".weight") and "token_mixing" not in p and "mixing" not in p]
        runs[dt] = {k: np.asarray(v) for k, v in m.run([ids], saves=paths).items()}
        del m
    f32 = runs["float32"]
    out = {"tokens": T, "logits": {}, "kinds": defaultdict(dict)}
    lq = {dt: _log_softmax(runs[dt]["logits"][0].astype(np.float64)) for dt in DTYPES}
    for ref in ("bfloat16", "float32"):
        lp = lq[ref]
        kl = (np.exp(lp) * (lp - lq["int8"])).sum(-1)
        out["logits"][ref] = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                              "top1": float((lp.argmax(-1) == lq["int8"].argmax(-1)).mean())}
    lp = lq["int8"]
    lx = _log_softmax(runs["int8x16"]["logits"][0].astype(np.float64))
    kl = (np.exp(lp) * (lp - lx)).sum(-1)
    out["x16"] = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1": float((lp.argmax(-1) == lx.argmax(-1)).mean()),
                  "logits": _rel(runs["int8x16"]["logits"], runs["int8"]["logits"]),
                  "values": max(_rel(runs["int8x16"][p], v) for p, v in runs["int8"].items()
                                if np.issubdtype(v.dtype, np.floating) and p != "logits")}
    for p, ref in f32.items():
        if not np.issubdtype(ref.dtype, np.floating) or p not in runs["int8"]:
            continue
        kind = p.rsplit(".", 1)[-1]
        for dt in ("bfloat16", "int8"):
            e = _rel(runs[dt][p], ref)
            out["kinds"][kind][dt] = max(out["kinds"][kind].get(dt, 0.0), e)
    return out


def table(results: dict) -> str:
    lines = ["| model | tokens | KL int8 ‖ bf16 mean / max | top-1 int8 = bf16 | KL int8 ‖ f32 mean / max | top-1 int8 = f32 |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        b, f = r["logits"]["bfloat16"], r["logits"]["float32"]
        lines.append(f"| {name} | {r['tokens']} | {b['kl_mean']:.1e} / {b['kl_max']:.1e} | {b['top1']:.3f} | "
                     f"{f['kl_mean']:.1e} / {f['kl_max']:.1e} | {f['top1']:.3f} |")
    kinds = sorted({k for r in results.values() for k in r["kinds"]})
    lines += ["", "Relative RMS error against the float32 load, largest over layers (int8 / bfloat16):", "",
              "| value | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for k in kinds:
        cells = []
        for r in results.values():
            e = r["kinds"].get(k)
            cells.append(f"{e['int8']:.1e} / {e['bfloat16']:.1e}" if e else "")
        lines.append(f"| `{k}` | " + " | ".join(cells) + " |")
    lines += ["", "The activations' int16 rounding alone (int8 with deterministic=True, every product rounding x, "
              "against int8, whose prompt products multiply float32 x):", "",
              "| model | KL mean / max | top-1 the same | logits rel. RMS | largest value rel. RMS |", "|---|---|---|---|---|"]
    for name, r in results.items():
        x = r["x16"]
        lines.append(f"| {name} | {x['kl_mean']:.1e} / {x['kl_max']:.1e} | {x['top1']:.3f} | {x['logits']:.1e} | "
                     f"{x['values']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    results = {}
    for path in a.models:
        name = Path(path).name
        print(f"{name} ...", file=sys.stderr, flush=True)
        results[name] = measure(path, a.tokens)
    md = table(results)
    if a.out:
        Path(a.out).write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
