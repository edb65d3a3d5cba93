#!/usr/bin/env python3
"""Throughput of mixlens vs transformers on a published Mamba-2 hybrid layout: by default
tiiuae/Falcon-H1-0.5B-Base at full size (random weights, bf16 on disk; scripts/make_published_hybrids.py
builds it under build/published/); --layout picks another of that script's layouts.

One process, the same thread count for both (torch.set_num_threads and MIXLENS_NUM_THREADS),
float32 compute on both sides: prompt = one forward over a fresh prompt of 128 and 1024 tokens
(last-position logits only); decode = greedy single-token steps after a 128-token prompt.
mixlens runs first and is freed before transformers loads. Each timing is the best of --repeats.
This is not a test; numbers taken on the shared 2-core development machine are only indicative.

    .venv/bin/python bench/bench_hybrids.py [--layout falcon_h1_0_5b] [--threads 2]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLASSES = {"falcon_h1": "FalconH1ForCausalLM", "nemotron_h": "NemotronHForCausalLM", "bamba": "BambaForCausalLM"}


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="falcon_h1_0_5b")
    ap.add_argument("--model", type=Path, default=None, help="a checkpoint folder instead of --layout")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", default="128,1024")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    os.environ["MIXLENS_NUM_THREADS"] = str(a.threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import json

    import numpy as np
    import torch

    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(REPO / "scripts"))
    if a.model is None:
        import make_published_hybrids as mph

        a.model = mph.cached(a.layout)
    out = a.out or REPO / "bench" / "results" / f"hybrids_{a.layout}.md"
    import mixlens

    cfg = json.loads((a.model / "config.json").read_text())
    rng = np.random.default_rng(0)
    lens = [int(x) for x in a.prompts.split(",")]
    prompts = {n: rng.integers(3, cfg["vocab_size"], size=n).tolist() for n in lens}
    base = prompts.get(128) or rng.integers(3, cfg["vocab_size"], size=128).tolist()
    n_dec = a.decode_steps
    res: dict[str, dict[str, float]] = {"mixlens": {}, "transformers": {}}

    m = mixlens.StandardizedTransformer(str(a.model))
    core = m._core

    def ml_prompt(ids):
        cache = core.new_cache(1)
        logits, _ = core.forward([ids], cache, [], [], False)
        return cache, logits

    def ml_decode():
        cache, logits = ml_prompt(base)
        tok = int(np.argmax(logits[0, -1]))
        t0 = time.perf_counter()
        for _ in range(n_dec):
            logits, _ = core.forward([[tok]], cache, [], [], False)
            tok = int(np.argmax(logits[0, -1]))
        return time.perf_counter() - t0

    for n, ids in prompts.items():
        res["mixlens"][f"prompt{n}"] = n / best_time(lambda: ml_prompt(ids), a.repeats)
    res["mixlens"]["decode"] = n_dec / min(ml_decode() for _ in range(a.repeats))
    del m, core
    gc.collect()

    import transformers

    hf = getattr(transformers, CLASSES[cfg["model_type"]]).from_pretrained(str(a.model), dtype=torch.bfloat16)
    hf = hf.float().eval()

    @torch.no_grad()
    def hf_prompt(ids):
        return hf(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)

    @torch.no_grad()
    def hf_decode():
        o = hf_prompt(base)
        pkv, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(n_dec):
            o = hf(input_ids=tok, past_key_values=pkv, use_cache=True, logits_to_keep=1)
            pkv, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
        return time.perf_counter() - t0

    for n, ids in prompts.items():
        res["transformers"][f"prompt{n}"] = n / best_time(lambda: hf_prompt(ids), a.repeats)
    res["transformers"]["decode"] = n_dec / min(hf_decode() for _ in range(a.repeats))
    del hf
    gc.collect()

    ml, tf = res["mixlens"], res["transformers"]
    rows = [(f"prompt {n} tokens (tokens/s)", ml[f"prompt{n}"], tf[f"prompt{n}"]) for n in lens]
    rows.append((f"decode after 128 (tokens/s, {n_dec} steps)", ml["decode"], tf["decode"]))
    lines = ["| measure | mixlens | transformers | mixlens / transformers |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {x:.2f} | {y:.2f} | {x / y:.2f}x |" for name, x, y in rows]
    header = (f"# mixlens vs transformers: {a.layout}\n\n"
              f"Checkpoint: `{os.path.relpath(a.model, REPO)}` (random weights, bf16 on disk, float32 compute on both "
              f"sides). {a.threads} threads each, best of {a.repeats}; {platform.machine()}, {os.cpu_count()} cores "
              f"shared with other work: the numbers are only indicative. transformers {transformers.__version__} "
              f"(pure-torch Mamba-2 kernels), torch {torch.__version__}.\n\n")
    table = "\n".join(lines)
    print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + table + "\n", encoding="utf-8")
    print(f"wrote {os.path.relpath(out, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
