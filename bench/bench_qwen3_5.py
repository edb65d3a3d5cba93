#!/usr/bin/env python3
"""Throughput of mixlens vs transformers on the Qwen/Qwen3.5-0.8B-shaped checkpoint (random
weights, bf16 on disk; scripts/make_published_layout.py builds it under build/published/).

Measured in one process, with the same thread count for both (torch.set_num_threads and
MIXLENS_NUM_THREADS), float32 compute on both sides:

- prompt: one forward over a fresh prompt of 128 and 1024 tokens, last-position logits only
  (mixlens forward(all_logits=False); transformers logits_to_keep=1), cache filled by both;
- decode: greedy single-token steps after a 128-token prompt (mixlens forward on its cache;
  transformers model(...) with past_key_values);
- states: the same mixlens prompt (128 tokens) and decode with every DeltaNet layer's
  ``linear_attn.states`` saved ([B, T, 16, 128, 128] per layer: 128 MB per layer at T=128, so the
  1024-token prompt is not measured with states: 18 GB would not fit next to the model).

mixlens runs first and is freed before transformers loads, so the peak memory is one float32 model
(~3.6 GB) plus activations. Each timing is the best of --repeats runs (the machine is shared).

    .venv/bin/python bench/bench_qwen3_5.py [--threads 2] [--model DIR] [--out bench/results/qwen3_5.md]
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


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, default=None, help="default: the cached 0.8B-shaped layout")
    ap.add_argument("--prompts", default="128,1024")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "qwen3_5.md")
    a = ap.parse_args(argv)

    # Both libraries read their thread counts at start-up: set them before importing either.
    os.environ["MIXLENS_NUM_THREADS"] = str(a.threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import numpy as np
    import torch

    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(REPO / "scripts"))
    if a.model is None:
        import make_published_layout as mpl

        a.model = mpl.cached_qwen3_5_0_8b(REPO / "build" / "published")
    import mixlens

    prompt_lens = [int(x) for x in a.prompts.split(",")]
    rng = np.random.default_rng(0)
    import json

    cfg = json.loads((a.model / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    vocab = text_cfg["vocab_size"]
    lin_layers = [i for i, k in enumerate(text_cfg["layer_types"]) if k == "linear_attention"]
    prompts = {t: rng.integers(0, vocab, size=t).tolist() for t in prompt_lens}
    base = prompts.get(128) or rng.integers(0, vocab, size=128).tolist()
    n_dec = a.decode_steps
    res: dict[str, dict[str, float]] = {"mixlens": {}, "transformers": {}}

    # ------------------------------------------------------------------ mixlens
    t = time.perf_counter()
    m = mixlens.StandardizedTransformer(str(a.model))
    res["mixlens"]["load_s"] = time.perf_counter() - t
    core = m._core  # the binding's forward takes all_logits; the Python wrapper always asks for all
    states = [(f"layers.{i}.linear_attn.states", 0, 2**31 - 1) for i in lin_layers]

    def ml_prompt(ids, saves=()):
        cache = core.new_cache(1)
        logits, saved = core.forward([ids], cache, list(saves), [], False)
        return cache, logits, saved

    def ml_decode(saves=()):
        cache, logits, _ = ml_prompt(base)
        tok = int(np.argmax(logits[0, -1]))
        t0 = time.perf_counter()
        for _ in range(n_dec):
            logits, saved = core.forward([[tok]], cache, list(saves), [], False)
            tok = int(np.argmax(logits[0, -1]))
        return time.perf_counter() - t0

    for n, ids in prompts.items():
        res["mixlens"][f"prompt{n}"] = n / best_time(lambda: ml_prompt(ids), a.repeats)
    res["mixlens"]["decode"] = n_dec / min(ml_decode() for _ in range(a.repeats))
    res["mixlens"]["prompt_base"] = res["mixlens"].get("prompt128") or len(base) / best_time(lambda: ml_prompt(base), a.repeats)
    _, _, saved = ml_prompt(base, states)
    assert len(saved) == len(lin_layers) and all(v.shape[1] == len(base) for v in saved.values()), saved.keys()
    del saved
    res["mixlens"]["prompt128_states"] = len(base) / best_time(lambda: ml_prompt(base, states), a.repeats)
    res["mixlens"]["decode_states"] = n_dec / min(ml_decode(states) for _ in range(a.repeats))
    del m, core
    gc.collect()

    # ------------------------------------------------------------------ transformers
    from transformers import AutoConfig, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    cls = Qwen3_5ForConditionalGeneration if AutoConfig.from_pretrained(a.model).model_type == "qwen3_5" else Qwen3_5ForCausalLM
    t = time.perf_counter()
    # bf16 on disk, widened: the same rounded weights mixlens computes with in float32
    hf = cls.from_pretrained(str(a.model), dtype=torch.bfloat16).float().eval()
    res["transformers"]["load_s"] = time.perf_counter() - t

    @torch.no_grad()
    def hf_prompt(ids):
        return hf(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)

    @torch.no_grad()
    def hf_decode():
        out = hf_prompt(base)
        pkv, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(n_dec):
            out = hf(input_ids=tok, past_key_values=pkv, use_cache=True, logits_to_keep=1)
            pkv, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - t0

    for n, ids in prompts.items():
        res["transformers"][f"prompt{n}"] = n / best_time(lambda: hf_prompt(ids), a.repeats)
    res["transformers"]["decode"] = n_dec / min(hf_decode() for _ in range(a.repeats))
    del hf
    gc.collect()

    # ------------------------------------------------------------------ report
    ml, tf = res["mixlens"], res["transformers"]
    rows = [(f"prompt {n} tokens (tokens/s)", ml[f"prompt{n}"], tf[f"prompt{n}"]) for n in prompt_lens]
    rows.append((f"decode after 128 (tokens/s, {n_dec} steps)", ml["decode"], tf["decode"]))
    lines = ["| measure | mixlens | transformers | mixlens / transformers |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {x:.2f} | {y:.2f} | {x / y:.2f}x |" for name, x, y in rows]
    lines.append(f"| load (s, not a throughput) | {ml['load_s']:.1f} | {tf['load_s']:.1f} | |")
    lines += ["", f"Cost of saving `linear_attn.states` on all {len(lin_layers)} DeltaNet layers (mixlens):", "",
              "| measure | without | with states | slowdown |", "|---|---:|---:|---:|"]
    lines.append(f"| prompt 128 tokens (tokens/s) | {ml['prompt_base']:.2f} | "
                 f"{ml['prompt128_states']:.2f} | {ml['prompt_base'] / ml['prompt128_states']:.2f}x |")
    lines.append(f"| decode (tokens/s) | {ml['decode']:.2f} | {ml['decode_states']:.2f} | "
                 f"{ml['decode'] / ml['decode_states']:.2f}x |")
    lines += ["", "With states the 128-token prompt hands back one [1, 128, HV, Dk, Dv] float32 array per DeltaNet "
              "layer (the chunked kernel replays each chunk token by token to produce them), "
              f"{len(lin_layers)} x {128 * text_cfg['linear_num_value_heads'] * text_cfg['linear_key_head_dim'] * text_cfg['linear_value_head_dim'] * 4 / 2**20:.0f} MiB here; "
              "a decode step adds one [1, 1, HV, Dk, Dv] per layer."]
    table = "\n".join(lines)
    import transformers

    header = (f"# mixlens vs transformers: Qwen3.5-0.8B shape\n\n"
              f"Checkpoint: `{os.path.relpath(a.model, REPO)}` (random weights, bf16 on disk, float32 compute on "
              f"both sides). {a.threads} threads each (`MIXLENS_NUM_THREADS`, `torch.set_num_threads`), "
              f"best of {a.repeats}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
              f"shared with other work, so absolute numbers are noisy; the ratios are the point. "
              f"transformers {transformers.__version__} (pure-torch DeltaNet kernels), torch {torch.__version__}.\n"
              f"Command: `python bench/bench_qwen3_5.py {' '.join(sys.argv[1:] if argv is None else argv)}`.\n\n")
    print(table)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(header + table + "\n", encoding="utf-8")
    print(f"wrote {os.path.relpath(a.out, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
