#!/usr/bin/env python
"""One measurement process of bench/harness.py (run as a subprocess so each system's peak RSS is its
own and at most one large model is in memory): loads one model with one system, times the prompts
and the decode once each after a warm-up, and prints one JSON line.

    python bench/_workers.py mixlens      --model DIR --threads 2 --prompts 128,1024 --decode 32 [--dtype float32]
                                          [--route default|chunked|recurrent]
    python bench/_workers.py transformers --model DIR --threads 2 --prompts 128,1024 --decode 32 [--dtype float32]

Prompts are token ids drawn with a fixed seed from the first 5,000 ids (every model's vocabulary
has them); both systems return the logits of the last position only (llama-bench's prompt test
does the same). Decode: single-token steps after a 16-token prompt, greedy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from mixlens_dev.timing import Timer, timed

VOCAB = 5000  # ids are drawn below this (and below the model's vocabulary: tiny test fixtures)


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed + n).integers(3, VOCAB, size=n).tolist()


def run_mixlens(a) -> dict:
    import mixlens

    t0 = time.perf_counter()
    kwargs = {}
    if a.dtype != "float32":
        kwargs["dtype"] = a.dtype  # the load option of issue 9 item 1, where this build has it
    try:
        m = mixlens.StandardizedTransformer(a.model, **kwargs)
    except TypeError as e:
        return {"error": f"mixlens has no dtype load option in this build ({e})"}
    # A forced kernel route (the recurrent or chunked scan on every call) for the model's family.
    mixlens.route_kernels(m.info["family"], a.route)
    global VOCAB
    VOCAB = min(VOCAB, m.info["vocab_size"])
    out = {"load_s": time.perf_counter() - t0, "route": mixlens.kernel_route(m.info["family"])}
    for n in a.prompts:
        ids = prompt_ids(n)
        m.run([ids], logits="last")  # warm-up: pages, pools, arena
        out[f"prompt{n}"] = n / timed(m.run, [ids], logits="last").wall
    if a.decode:
        def decode() -> float:
            cache = m.new_cache(1)
            tok = int(m.forward([prompt_ids(16, 7)], cache=cache, logits="last")["logits"][0, -1].argmax())
            with Timer() as t:
                for _ in range(a.decode):
                    tok = int(m.forward([[tok]], cache=cache, logits="last")["logits"][0, -1].argmax())
            return t.wall

        decode()
        out["decode"] = a.decode / decode()
    return out


def run_transformers(a) -> dict:
    import torch
    import transformers

    torch.set_num_threads(a.threads)
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    arch = (cfg.get("architectures") or [None])[0]
    t0 = time.perf_counter()
    if arch and arch.endswith("ForConditionalGeneration"):
        cls = getattr(transformers, arch)
    else:
        cls = transformers.AutoModelForCausalLM
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    # A bf16 checkpoint is widened after loading so a float32 run sees the same rounded weights.
    hf = cls.from_pretrained(a.model, dtype=torch.bfloat16 if cfg.get("dtype") == "bfloat16" else torch.float32)
    hf = hf.to(dtype).eval()
    out = {"load_s": time.perf_counter() - t0}

    @torch.no_grad()
    def prompt(ids):
        try:
            return hf(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        except TypeError:
            return hf(input_ids=torch.tensor([ids]), use_cache=True)

    for n in a.prompts:
        ids = prompt_ids(n)
        prompt(ids)
        out[f"prompt{n}"] = n / timed(prompt, ids).wall
    if a.decode:
        x = torch.tensor([prompt_ids(16, 7)])

        @torch.no_grad()
        def gen(k: int) -> float:
            return timed(hf.generate, x, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0).wall

        gen(2)
        # generate(k+1) - generate(1): the k decode steps (the prompt and setup cancel out).
        out["decode"] = a.decode / max(gen(a.decode + 1) - gen(1), 1e-9)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("system", choices=["mixlens", "transformers"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", default="128,1024")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    ap.add_argument("--route", default="default", choices=["default", "chunked", "recurrent"])
    a = ap.parse_args()
    a.prompts = [int(x) for x in a.prompts.split(",") if x]
    try:
        out = run_mixlens(a) if a.system == "mixlens" else run_transformers(a)
    except Exception as e:  # reported in the table, not a crash of the whole harness
        out = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
