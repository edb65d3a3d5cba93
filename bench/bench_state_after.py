#!/usr/bin/env python
"""Cost of per-token states (issue 7 item 3), mixlens against its own plain forward and against
transformers' token-by-token kernel producing the same per-token states.

    .venv/bin/python bench/bench_state_after.py [--families mamba2,mamba,qwen3_5] [--tokens 1024]
                                                [--threads N] [--repeats R] [--out FILE]

Models: the published layouts of scripts/make_published_layout.py (mamba2-130m, mamba-130m,
Qwen3.5-0.8B shapes, random weights), cached under build/. For each, at --tokens tokens, batch 1:
  - plain: one forward (`model.run`);
  - states, all layers: a trace reading every recurrent layer's `states` (each read and dropped);
  - states, one layer: `states` of the middle recurrent layer;
  - set_state_after: one pre-registered write of `state@t<T/2>` on the middle layer (the scan is
    split there and resumes from the written state);
  - state_after: one read of `state@t<T/2>`;
  - transformers token loop: transformers fed the prompt one token per call (its token-by-token
    kernel, the way it yields a state after every token without chunk_size 1), copying every
    layer's recurrent state after each token. Skipped with --no-hf.
Targets (issue 7): states of all layers <= 3x plain; one layer's states, one set_state_after
<= 1.3x plain; mixlens all-layer states >= 20x faster than the transformers token loop.
Best of R runs after a warm-up, the variants alternating. Not a test; on a shared machine the
numbers are indicative only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="mamba2,mamba,qwen3_5")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers token loop (slow)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "state_after.md"))
    return ap.parse_args()


ARGS = parse_args()
os.environ["MIXLENS_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mixlens  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))
import make_published_layout as mpl  # noqa: E402
import published_layout_cache  # noqa: E402


def layout(family: str) -> Path:
    if family == "mamba2":
        return published_layout_cache.cached_layout(REPO / "build")
    if family == "mamba":
        return mpl.cached_mamba1_130m(REPO / "build" / "published")
    return mpl.cached_qwen3_5_0_8b(REPO / "build" / "published")


def best(fns: dict, repeats: int) -> dict:
    for fn in fns.values():
        fn()  # warm-up
    out = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[k] = min(out[k], time.perf_counter() - t0)
    return out


def hf_token_loop(family: str, path: Path, ids: list[int]) -> float:
    """transformers, one token per call, copying every layer's recurrent state after each token."""
    import transformers

    if family == "qwen3_5":
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    else:
        cls = transformers.Mamba2ForCausalLM if family == "mamba2" else transformers.MambaForCausalLM
        model = cls.from_pretrained(str(path), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.no_grad():
        if family == "qwen3_5":
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config.get_text_config())
            for t in range(len(ids)):
                model(input_ids=x[:, t:t + 1], past_key_values=cache, use_cache=True,
                      position_ids=torch.tensor([[t]]))
                _ = [layer.recurrent_states[0].clone() for layer in cache.layers
                     if getattr(layer, "recurrent_states", None) and layer.recurrent_states[0] is not None]
        else:
            out = model(input_ids=x[:, :1], use_cache=True)
            cache = out.cache_params
            for t in range(1, len(ids)):
                out = model(input_ids=x[:, t:t + 1], cache_params=cache, use_cache=True)
                cache = out.cache_params
                _ = [s.clone() for s in cache.ssm_states] if hasattr(cache, "ssm_states") else None
    return time.perf_counter() - t0


def bench(family: str) -> list[str]:
    path = layout(family)
    ml = mixlens.StandardizedTransformer(str(path))
    T = ARGS.tokens
    ids = [np.random.default_rng(T).integers(3, min(ml.tokenizer.vocab_size, 50000), size=T).tolist()]
    rec = [i for i, k in enumerate(ml.info["layer_kinds"]) if k != "attention"]
    mid = rec[len(rec) // 2]

    def all_states():
        with ml.trace(ids):
            for i in rec:
                s = ml.layers[i].linear_attn.states
                del s

    def one_states():
        with ml.trace(ids):
            s = ml.layers[mid].linear_attn.states
            del s

    fns = {
        "plain": lambda: ml.run(ids),
        "states, all layers": all_states,
        "states, one layer": one_states,
        "set_state_after": lambda: ml.run(ids, edits={f"layers.{mid}.linear_attn.state@t{T // 2}": lambda v: v * 0.5}),
        "state_after": lambda: ml.run(ids, saves=[f"layers.{mid}.linear_attn.state@t{T // 2}"]),
    }
    t = best(fns, ARGS.repeats)
    lines = [f"| {family} | {k} | {v:.3f} | {v / t['plain']:.2f}x |" for k, v in t.items()]
    if not ARGS.no_hf:
        hf = hf_token_loop(family, path, ids[0])
        lines.append(f"| {family} | transformers token loop (all layers' states) | {hf:.3f} | "
                     f"{hf / t['plain']:.2f}x (mixlens all-layer states {hf / t['states, all layers']:.1f}x faster) |")
    for line in lines:
        print(line, flush=True)
    return lines


def main() -> int:
    torch.set_num_threads(ARGS.threads)
    load = os.getloadavg()[0]
    lines = [
        "# Per-token states: cost against a plain forward",
        "",
        f"{ARGS.tokens} tokens, batch 1, {ARGS.threads} threads, best of {ARGS.repeats}; load average {load:.1f} "
        "at start. A shared machine: indicative numbers only.",
        "",
        "| model | measurement | seconds | / plain |",
        "| --- | --- | ---: | ---: |",
    ]
    for fam in ARGS.families.split(","):
        lines += bench(fam)
    Path(ARGS.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ARGS.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
