#!/usr/bin/env python
"""mixlens token_mixing vs TransformerLens 4.3's SSM effective attention / state (issue 26, speed
section), on the same checkpoint folder, batch 1, one middle recurrent layer.

mixlens and TransformerLens live in different venvs (TL 4.3 needs transformers 5.9: requirements-tl.txt),
so each side is a worker process (ml_worker.py / tl_worker.py) that loads the model once and runs one
timed cell per request; this driver (stdlib only) alternates the two sides cell by cell (A B A B ...),
round after round, so a load change hits both alike. Only one side computes at a time. First-call
costs are paid untimed on a --warmup-tokens prompt (--warmup-cells); a cell whose first sample takes
over --max-repeat-s is not repeated (TransformerLens' CPU forward of Mamba-2 is transformers' naive
SSD, minutes per call at 4,096 tokens), and the table marks it n=1.

    # smoke (the shipped tiny models, 64 and 256 tokens, seconds):
    .venv/bin/python bench/tl/bench_token_mixing_tl.py --smoke --tl-python bench/tl/venv/bin/python
    # full (random-weight published layouts: make_layouts.py), on a quiet machine (about an hour):
    python bench_token_mixing_tl.py --model layouts/mamba2-130m --model layouts/qwen3_5-0.8b-text \
        --tokens 1024,4096 --repeats 3 --agree-tokens 256 --ml-python ... --tl-python ... \
        --warmup-cells ml_plain,ml_token_mixing,ml_token_mixing_row,ml_state_contrib

Cells (see the workers' docstrings): ml_plain, ml_token_mixing, ml_token_mixing_row, ml_state_contrib;
tl_forward, tl_cache (the run_with_cache TL's functions need, blocks 0..L), tl_effattn, tl_state
(time_step=T-1), tl_state_all (every step). Threads: MIXLENS_NUM_THREADS and torch.set_num_threads to
--threads. A cell whose estimated peak memory is over --max-gib is skipped and says so. Output: one
JSON line per cell summary (--out), and a markdown table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ["ml_plain", "tl_forward", "ml_token_mixing", "tl_cache", "ml_token_mixing_row", "tl_effattn",
         "ml_state_contrib", "tl_state", "tl_state_all"]


class Worker:
    def __init__(self, python: str, script: str, log: Path, env: dict):
        self.log = open(log, "a")
        self.p = subprocess.Popen([python, str(HERE / script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.log, text=True, env=env, cwd=str(HERE))

    def call(self, **req) -> dict:
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker died (exit {self.p.wait()}); see {self.log.name}")
        return json.loads(line)

    def close(self):
        try:
            self.call(op="quit")
        except Exception:
            pass
        self.p.wait(timeout=60)
        self.log.close()


def shapes(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    if cfg.get("model_type", "").startswith("mamba2") or "state_size" in cfg:
        return {"kind": "ssd", "H": cfg["num_heads"], "P": cfg["head_dim"], "N": cfg["state_size"],
                "vocab": cfg["vocab_size"]}
    return {"kind": "gated_delta", "H": cfg["linear_num_value_heads"], "P": cfg["linear_value_head_dim"],
            "N": cfg["linear_key_head_dim"], "vocab": cfg["vocab_size"]}


def estimate_gib(cell: str, sh: dict, T: int) -> float:
    """Rough peak of the cell's own tensors (float32), from the code paths (see token_mixing.md)."""
    H, P, N, f = sh["H"], sh["P"], sh["N"], 4 / 2**30
    TT = H * T * T * f
    ssd = sh["kind"] == "ssd"
    return {
        "ml_token_mixing": 1.2 * TT,
        "ml_state_contrib": 1.2 * H * T * P * N * f,
        # L_log, exp, zeros_like, L, CB, M, dt-scaled M (measured ~0.9 GiB over the model at 1,024 tokens, 24 heads)
        "tl_effattn": 10 * TT,
        # SSD: _ssd_terms' L [H,T,T] (x3 while built); delta rule: the Python scan stacks every step
        "tl_state": 10 * TT if ssd else 2 * T * H * P * N * f,
        # SSD without opt_einsum: torch contracts left to right: L x (dt x) first -> [H, T, T, P], and
        # the operands' broadcast copies double it (measured: 13.9 GiB peak RSS at 1,024 tokens, 24 heads)
        "tl_state_all": (2 * H * T * T * P * f + 2 * H * T * P * N * f + 4 * TT) if ssd else 2 * T * H * P * N * f,
    }.get(cell, 0.0)


def summ(xs):
    xs = list(xs)
    med = statistics.median(xs)
    return {"min": min(xs), "median": med, "max": max(xs), "spread": (max(xs) - min(xs)) / med if med else None,
            "n": len(xs)}


def ids_for(T: int, vocab: int, seed: int = 0):
    r = random.Random(seed * 1_000_003 + T)
    return [r.randrange(3, min(5000, vocab)) for _ in range(T)]


def bench_model(path: Path, a, ml: Worker, tl: Worker, out) -> list[dict]:
    sh = shapes(path)
    info_ml = ml.call(op="load", path=str(path), threads=a.threads)
    if not info_ml["ok"]:
        raise RuntimeError(f"mixlens load: {info_ml}")
    L = info_ml["layer"]
    info_tl = tl.call(op="load", path=str(path), layer=L, threads=a.threads)
    if not info_tl["ok"]:
        raise RuntimeError(f"TL load: {info_tl}")
    head = {"model": str(path), "layer": L, "shapes": sh, "mixlens": info_ml, "tl": info_tl}
    print(json.dumps({"load": head}), file=out, flush=True)
    rows = []
    cells = [c for c in ORDER if c in a.cells.split(",")]
    if a.warmup:  # first-call costs (lazy init, allocator) paid on a short prompt, untimed
        wids = ids_for(a.warmup_tokens, sh["vocab"], seed=2)
        for w in (ml, tl):
            assert w.call(op="set_ids", ids=wids)["ok"]
        for _ in range(a.warmup):
            for c in [c for c in cells if c in a.warmup_cells.split(",")]:
                res = (ml if c.startswith("ml_") else tl).call(op="time", cell=c)
                print(json.dumps({"warmup_tokens": a.warmup_tokens, "cell": c, **res}), file=out, flush=True)
    for T in [int(t) for t in a.tokens.split(",")]:
        ids = ids_for(T, sh["vocab"])
        for w in (ml, tl):
            assert w.call(op="set_ids", ids=ids)["ok"]
        skip = {c: round(estimate_gib(c, sh, T), 2) for c in cells if estimate_gib(c, sh, T) > a.max_gib}
        run = [c for c in cells if c not in skip]
        load0 = os.getloadavg()
        samples = {c: [] for c in run}
        errors = {}
        once = set()  # cells whose first sample took over --max-repeat-s: timed once only
        for r in range(a.repeats):
            for c in run:
                if c in errors or c in once:
                    continue
                res = (ml if c.startswith("ml_") else tl).call(op="time", cell=c)
                if not res["ok"]:
                    errors[c] = res["error"]
                    continue
                samples[c].append(res)
                if res["wall"] > a.max_repeat_s:
                    once.add(c)
                print(json.dumps({"tokens": T, "round": r, "cell": c, **res}), file=out, flush=True)
        load1 = os.getloadavg()
        row = {"model": path.name, "family": sh["kind"], "layer": L, "tokens": T,
               "loadavg_before": [round(x, 2) for x in load0], "loadavg_after": [round(x, 2) for x in load1],
               "skipped": skip, "errors": errors, "cells": {}}
        for c, ss in samples.items():
            if ss:
                row["cells"][c] = {"wall": summ(s["wall"] for s in ss), "cpu": summ(s["cpu"] for s in ss),
                                   "peak_rss_gib": max(s["peak_rss_gib"] for s in ss)}
        print(json.dumps({"summary": row}), file=out, flush=True)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def agree(path: Path, a, ml: Worker, tl: Worker, out) -> dict:
    sh = shapes(path)
    d = Path(a.agree_dir) / path.name
    ids = ids_for(a.agree_tokens, sh["vocab"], seed=1)
    res = {}
    for w, name in ((ml, "ml"), (tl, "tl")):
        assert w.call(op="set_ids", ids=ids)["ok"]
        res[name] = w.call(op="dump", out=str(d))
        if not res[name]["ok"]:
            raise RuntimeError(f"{name} dump: {res[name]}")
    cmp = subprocess.run([a.ml_python, str(HERE / "compare_tl.py"), str(d), "--kind", sh["kind"]],
                         capture_output=True, text=True)
    sys.stderr.write(cmp.stderr)
    got = json.loads(cmp.stdout.strip().splitlines()[-1])
    rec = {"agreement": {"model": path.name, "tokens": a.agree_tokens, "dir": str(d), **got}}
    print(json.dumps(rec), file=out, flush=True)
    return rec["agreement"]


def fmt(x, nd=3):
    return "—" if x is None else f"{x:.{nd}f}"


def table(rows: list[dict]) -> str:
    hdr = ("| model | tokens | mixlens plain s | mixlens token_mixing s | ratio to plain | mixlens row s | "
           "TL forward s | TL cache (blocks 0..L) s | TL effective attention s | TL cache + eff. attn s | "
           "TL state(T-1) s | TL state (all steps) s | TL (cache+eff) / mixlens token_mixing | load before → after |")
    lines = [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for r in rows:
        c = r["cells"]
        g = lambda k: c[k]["wall"]["min"] if k in c else None
        sp = lambda k: ("" if k not in c else " (n=1)" if c[k]["wall"]["n"] == 1 else
                        f" (spread {c[k]['wall']['spread'] * 100:.0f}%)")
        cell = lambda k: (f"skipped (est {r['skipped'][k]} GiB)" if k in r["skipped"] else
                          "error" if k in r["errors"] else fmt(g(k)) + sp(k))
        tm, pl = g("ml_token_mixing"), g("ml_plain")
        e2e = g("tl_cache") + g("tl_effattn") if g("tl_cache") is not None and g("tl_effattn") is not None else None
        lines.append("| " + " | ".join([
            r["model"], str(r["tokens"]), cell("ml_plain"), cell("ml_token_mixing"),
            fmt(tm / pl, 2) if tm and pl else "—", cell("ml_token_mixing_row"), cell("tl_forward"), cell("tl_cache"),
            cell("tl_effattn"), fmt(e2e), cell("tl_state"), cell("tl_state_all"),
            fmt(e2e / tm, 2) if e2e and tm else "—",
            f"{r['loadavg_before'][0]} → {r['loadavg_after'][0]}"]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", help="checkpoint folder (repeatable)")
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of every cell first, on --warmup-tokens")
    p.add_argument("--warmup-tokens", type=int, default=64)
    p.add_argument("--warmup-cells", default=",".join(ORDER),
                   help="cells warmed up (TL's SSD forward pads to chunk_size=256: a 64-token warmup costs a 256-token run)")
    p.add_argument("--max-repeat-s", type=float, default=300.0,
                   help="a cell whose first sample took longer is not repeated (n=1 in the table)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cells", default=",".join(ORDER))
    p.add_argument("--max-gib", type=float, default=18.0, help="skip a cell estimated above this (GiB)")
    p.add_argument("--ml-python", default=os.environ.get("MIXLENS_PYTHON", sys.executable))
    p.add_argument("--tl-python", default=os.environ.get("TL_PYTHON", str(HERE / "venv" / "bin" / "python")))
    p.add_argument("--agree-tokens", type=int, default=256, help="0: no agreement dump")
    p.add_argument("--agree-dir", default=str(HERE / "agree"))
    p.add_argument("--out", default=str(HERE / "results" / "tl_bench.jsonl"))
    p.add_argument("--smoke", action="store_true", help="shipped tiny models, 64,256 tokens, 1 repeat")
    a = p.parse_args(argv)
    if a.smoke:
        repo = HERE.parents[1]  # bench/tl/ -> the checkout
        a.model = a.model or [str(repo / "models" / "mamba2-tinystories"), str(repo / "models" / "qwen3_5-tinystories")]
        a.tokens, a.repeats = "64,256", 1
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MIXLENS_NUM_THREADS=str(a.threads),
               OMP_NUM_THREADS=str(a.threads), OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    logs = Path(a.out).parent
    all_rows, agreements = [], []
    with open(a.out, "a") as out:
        meta = {"start": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "argv": sys.argv,
                "nproc": os.cpu_count(), "loadavg": os.getloadavg(), "threads": a.threads}
        print(json.dumps({"run": meta}), file=out, flush=True)
        print(json.dumps(meta), flush=True)
        for m in a.model:
            ml = Worker(a.ml_python, "ml_worker.py", logs / "ml_worker.log", env)
            tl = Worker(a.tl_python, "tl_worker.py", logs / "tl_worker.log", env)
            try:
                all_rows += bench_model(Path(m), a, ml, tl, out)
                if a.agree_tokens:
                    agreements.append(agree(Path(m), a, ml, tl, out))
            finally:
                ml.close()
                tl.close()
        print(json.dumps({"end": time.strftime("%H:%M:%S", time.gmtime()), "loadavg": os.getloadavg()}),
              file=out, flush=True)
    print()
    print(table(all_rows))
    for g in agreements:
        print(json.dumps(g))
    return 0


if __name__ == "__main__":
    sys.exit(main())
