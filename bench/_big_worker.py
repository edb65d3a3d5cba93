#!/usr/bin/env python
"""One measurement process of bench/bench_big.py: one engine (mixlens or transformers) on one big
layout, printing one JSON line. Run as a child so that its peak RSS is its own.

    python bench/_big_worker.py mixlens      --model DIR --dtype auto|int8 [--load-only]
                                             [--prompt 512] [--decode 64] [--states-tokens 1024]
    python bench/_big_worker.py transformers --model DIR --dtype bfloat16 [--load-only] [--prompt 512] [--decode 64]

--load-only: load, run a 1-token prompt (logits of the last position), exit; the parent times the
whole process (load to first logits). Otherwise, after loading: the prompt (--prompt tokens, logits of
the last position; one warm-up call then one timed call, as llama-bench's warm-up and -r 1), decode
(--decode single-token steps after a 16-token prompt, greedy, 2 untimed steps first), and for mixlens
a --states-tokens prompt twice: plain (its VmHWM is the peak RSS through that prompt) and reading
one layer's per-token `states` (the middle recurrent layer: docs/values.md "Per-token state").
Peak RSS figures are VmHWM from /proc/self/status (per process image: a fork's parent's size does
not leak in). Prompt ids are drawn with a fixed seed below min(vocab, 50,000).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def hwm() -> int:
    """VmHWM (peak resident bytes of this process image) from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed + n).integers(3, min(vocab, 50000), size=n).tolist()


def logits_ok(x) -> bool:
    x = np.asarray(x, dtype=np.float32)
    return bool(np.isfinite(x).all() and x.std() > 0)


def run_mixlens(a) -> dict:
    import mixlens

    t0 = time.perf_counter()
    try:
        m = mixlens.StandardizedTransformer(a.model, dtype=a.dtype)
    except Exception as e:  # e.g. dtype="int8" before the build has it
        return {"error": f"{type(e).__name__}: {e}", "unsupported": "dtype" in str(e) and a.dtype in str(e)}
    out = {"construct_s": time.perf_counter() - t0, "weight_dtypes": m.info.get("weight_dtypes")}
    vocab = m.info["vocab_size"]
    first = m.run([ids(1, vocab)], logits="last")["logits"]
    out["first_logits_s"] = time.perf_counter() - t0
    out["logits_ok"] = logits_ok(first)
    if a.load_only:
        out["hwm"] = hwm()
        return out
    p = ids(a.prompt, vocab)
    m.run([p], logits="last")
    t = time.perf_counter()
    r = m.run([p], logits="last")["logits"]
    out["prompt"] = a.prompt / (time.perf_counter() - t)
    out["logits_ok"] = out["logits_ok"] and logits_ok(r)
    cache = m.new_cache(1)
    tok = int(np.asarray(m.forward([ids(16, vocab, 7)], cache=cache, logits="last")["logits"])[0, -1].argmax())
    for _ in range(2):
        tok = int(np.asarray(m.forward([[tok]], cache=cache, logits="last")["logits"])[0, -1].argmax())
    t = time.perf_counter()
    for _ in range(a.decode):
        tok = int(np.asarray(m.forward([[tok]], cache=cache, logits="last")["logits"])[0, -1].argmax())
    out["decode"] = a.decode / (time.perf_counter() - t)
    del cache
    out["hwm_prompt_decode"] = hwm()
    if a.states_tokens:
        s_ids = ids(a.states_tokens, vocab)
        t = time.perf_counter()
        m.run([s_ids], logits="last")
        out["plain_s"] = time.perf_counter() - t
        out["hwm_states_tokens"] = hwm()
        rec = [i for i, k in enumerate(m.info["layer_kinds"]) if k not in ("attention", "mlp", "moe")]
        mid = rec[len(rec) // 2]
        t = time.perf_counter()
        with m.trace([s_ids], logits="last"):
            s = m.layers[mid].linear_attn.states
            out["states_shape"] = list(s.shape)
            out["states_norm"] = float(np.linalg.norm(np.asarray(s).reshape(-1)[:1 << 20].astype(np.float64)))  # a view: no copy of the stack
            del s
        out["states_s"] = time.perf_counter() - t
        out["states_layer"] = mid
        out["hwm_states"] = hwm()
    out["hwm"] = hwm()
    return out


def run_transformers(a) -> dict:
    import signal

    import torch
    import transformers

    def over(*_):
        raise TimeoutError(f"over the --budget-s of {a.budget_s:.0f} s")

    # The projection below can be optimistic; the alarm stops the run between two torch calls.
    signal.signal(signal.SIGALRM, over)
    signal.alarm(int(a.budget_s) + 60)

    torch.set_num_threads(a.threads)
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    t0 = time.perf_counter()
    hf = getattr(transformers, cfg["architectures"][0]).from_pretrained(a.model, dtype=torch.bfloat16).eval()
    out = {"construct_s": time.perf_counter() - t0}
    vocab = hf.config.get_text_config().vocab_size

    @torch.no_grad()
    def prompt(x):
        return hf(input_ids=torch.tensor([x]), use_cache=False, logits_to_keep=1).logits

    first = prompt(ids(1, vocab))
    out["first_logits_s"] = time.perf_counter() - t0
    out["logits_ok"] = logits_ok(first.float())
    if a.load_only:
        out["hwm"] = hwm()
        return out
    # Its bf16 CPU kernels can be hours per measurement at 7-9B (no bf16 dot products on AVX2): an
    # 8-token prompt and a 1-token step first, and the rest only if the projected time fits --budget-s.
    t = time.perf_counter()
    prompt(ids(8, vocab))
    t8 = time.perf_counter() - t
    t = time.perf_counter()
    prompt(ids(1, vocab))
    t1 = time.perf_counter() - t
    # two prompts + three generate calls (68 steps, three 16-token prompts)
    projected = 2 * a.prompt / 8 * t8 + (a.decode + 4) * t1 + 6 * t8
    if projected > a.budget_s:
        return dict(out, error=f"too slow for the budget: an 8-token prompt ran at {8 / t8:.2f} tok/s and a 1-token step "
                               f"took {t1:.1f} s: the prompt and decode would take ~{projected / 60:,.0f} min "
                               f"(> --budget-s {a.budget_s:.0f})", hwm=hwm())
    p = ids(a.prompt, vocab)
    prompt(p)
    t = time.perf_counter()
    prompt(p)
    out["prompt"] = a.prompt / (time.perf_counter() - t)
    x = torch.tensor([ids(16, vocab, 7)])

    @torch.no_grad()
    def gen(k: int) -> float:
        t = time.perf_counter()
        hf.generate(x, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    gen(2)
    # generate(k+1) - generate(1): the k decode steps (the prompt and setup cancel out).
    out["decode"] = a.decode / max(gen(a.decode + 1) - gen(1), 1e-9)
    out["hwm_prompt_decode"] = out["hwm"] = hwm()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=["mixlens", "transformers"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--load-only", action="store_true")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--states-tokens", type=int, default=1024)
    ap.add_argument("--budget-s", type=float, default=3600, help="transformers: skip when projected to take longer")
    a = ap.parse_args()
    try:
        out = run_mixlens(a) if a.engine == "mixlens" else run_transformers(a)
    except Exception as e:  # reported in the table, not a crash of the whole bench
        out = {"error": f"{type(e).__name__}: {e}"[:300]}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
