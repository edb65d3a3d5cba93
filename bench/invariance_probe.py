#!/usr/bin/env python
"""Where does a row's numbers first change with the batch, the threads or the prefill split (issue 23 item 2)?

    .venv/bin/python bench/invariance_probe.py [--models DIR,...] [--threads 1,2,4] [--len-a 21 --len-b 37]
                                               [--deterministic] [--route recurrent|chunked]

Per model: every value of prompt A run alone, as row 0 of [A, B] (B longer, so A is left padded) and
of [A, A], and alone under MIXLENS_NUM_THREADS = each of --threads (one process each; the pool size
is fixed at start). Prints, per comparison, the first value in forward order that differs and by how
much, and how many values differ. The logits of a call nobody observes are also compared with the
prefill split into chunks of 5 tokens. Not a test (tests/ hold those); a diagnostic.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

DEFAULT_MODELS = [
    "models/mamba2-tinystories",
    "models/mamba-tinystories",
    "models/qwen3_5-tinystories",
    "tests/fixtures/qwen3_next/padded_batch",
    "tests/fixtures/nemotron_h/padded_batch",
]


def prompts(model, la: int, lb: int):
    rng = np.random.default_rng(0)
    vocab = int(model.info["vocab_size"]) if "vocab_size" in model.info else 100
    hi = min(vocab, 1000)
    a = [int(t) for t in rng.integers(3, hi, la)]
    b = [int(t) for t in rng.integers(3, hi, lb)]
    return a, b


def token_axes(model, la: int, lb: int) -> dict:
    """path -> the axes whose size follows the call's token count (sliced to the last la positions)."""
    s1 = {v["path"]: v["shape"] for v in model.values(1, la)}
    s2 = {v["path"]: v["shape"] for v in model.values(1, lb)}
    return {p: [i for i, (x, y) in enumerate(zip(s1[p], s2[p])) if x != y] for p in s1}


def row0(arr, axes, la: int):
    a = np.asarray(arr)[:1]
    for ax in axes:
        a = np.take(a, np.arange(a.shape[ax] - la, a.shape[ax]), axis=ax)
    return a


def saves_of(model):
    sup = model.support()
    out = []
    for v in model.values(1, 2):
        p = v["path"]
        out.append(p)
    return out, sup


def run_all(model, rows, paths):
    ok = []
    res = {}
    # Save in groups (a value a layer lacks raises: drop it and retry one by one).
    try:
        res = model.run(rows, saves=paths)
        ok = paths
    except Exception:
        for p in paths:
            try:
                r = model.run(rows, saves=[p])
                res[p] = r[p]
                ok.append(p)
            except Exception:
                pass
        res["logits"] = model.run(rows)["logits"]
    return {p: np.asarray(res[p]) for p in ok + ["logits"] if p in res}


def compare(name, ref, got, axes, la, order):
    first = None
    ndiff = 0
    worst = 0.0
    for p in order + ["logits"]:
        if p not in ref or p not in got:
            continue
        a = row0(ref[p], axes.get(p, []), la)
        b = row0(got[p], axes.get(p, []), la)
        if a.shape != b.shape:
            print(f"    {name}: {p} shapes {a.shape} vs {b.shape}")
            continue
        if not np.array_equal(a, b, equal_nan=True):
            d = float(np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64))))
            ndiff += 1
            worst = max(worst, d)
            if first is None:
                first = (p, d)
    if first is None:
        print(f"  {name:<22} bitwise equal ({len(order) + 1} values)")
    else:
        print(f"  {name:<22} first: {first[0]} max|d| {first[1]:.3g}; {ndiff} values differ, worst {worst:.3g}"
              f"; logits {'equal' if 'logits' not in ref or np.array_equal(row0(ref['logits'], axes['logits'], la), row0(got['logits'], axes['logits'], la)) else 'differ'}")


def child(args):
    import mixlens

    model = mixlens.load(args.child, deterministic=args.deterministic)
    if args.route:
        mixlens.route_kernels(model.info["family"], args.route)
    a, b = prompts(model, args.len_a, args.len_b)
    paths, _ = saves_of(model)
    res = run_all(model, [a], paths)
    np.savez(args.out, **{k.replace("/", "|"): v for k, v in res.items()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--threads", default="1,2,4")
    ap.add_argument("--len-a", type=int, default=21)
    ap.add_argument("--len-b", type=int, default=37)
    ap.add_argument("--deterministic", action="store_true", help="load with deterministic=True")
    ap.add_argument("--route", default="", help="route_kernels for every call: recurrent | chunked")
    ap.add_argument("--child")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        return child(args)
    import mixlens

    la, lb = args.len_a, args.len_b
    for path in args.models.split(","):
        model = mixlens.load(path, deterministic=args.deterministic)
        if args.route:
            mixlens.route_kernels(model.info["family"], args.route)
        print(f"{path} ({model.info.get('family', '?')})")
        a, b = prompts(model, la, lb)
        paths, _ = saves_of(model)
        axes = token_axes(model, la, lb)
        axes["logits"] = [1]
        alone = run_all(model, [a], paths)
        compare("[A, B] row 0", alone, run_all(model, [a, b], paths), axes, la, paths)
        compare("[A, A] row 0", alone, run_all(model, [a, a], paths), axes, la, paths)
        # Prefill chunking applies only to calls nobody observes: logits of the last position.
        pc = model.prefill_chunk
        whole = np.asarray(model.run([a], logits="last")["logits"])
        model.prefill_chunk = 5
        split = np.asarray(model.run([a], logits="last")["logits"])
        model.prefill_chunk = pc
        d = float(np.max(np.abs(whole - split)))
        print(f"  {'prefill chunk 5':<22} last logits {'bitwise equal' if d == 0 else f'max|d| {d:.3g}'}")
        runs = {}
        with tempfile.TemporaryDirectory() as td:
            for n in args.threads.split(","):
                out = os.path.join(td, f"t{n}.npz")
                env = dict(os.environ, MIXLENS_NUM_THREADS=n)
                subprocess.run([sys.executable, __file__, "--child", path, "--out", out, "--len-a", str(la),
                                "--len-b", str(lb)] + (["--deterministic"] if args.deterministic else [])
                               + (["--route", args.route] if args.route else []), env=env, check=True)
                z = np.load(out)
                runs[n] = {k.replace("|", "/"): z[k] for k in z.files}
        ns = args.threads.split(",")
        for n in ns[1:]:
            compare(f"threads {ns[0]} vs {n}", runs[ns[0]], runs[n], axes, la, paths)


if __name__ == "__main__":
    main()
