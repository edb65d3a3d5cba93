#!/usr/bin/env python
"""Native gradients (issue 12): forward + backward time against a forward, and against transformers'
autograd doing the same, on the mamba2-130m layout.

    .venv/bin/python bench/bench_grad.py [--threads N] [--repeats R] [--tokens 128 512] [--out bench/results/grad.md]

Model: the mamba2-130m layout (AntonV/mamba2-130m-hf's config, random weights; scripts/published_layout_cache.py).
Metric: log p(token) at the last position; gradients of every layer's layer_output are kept (attribution
patching's need). mixlens: `model.trace(ids, grad=True)` + `tr.backward(LogProb)`; its forward alone is the
same trace without grad. transformers: its pure-torch forward with inputs_embeds as the leaf (weights frozen,
so no weight gradients), retain_grad on every hidden state, then .backward(). Peak RSS is the process's
maximum resident set after the mixlens measurements (before transformers is loaded) and at the end.
Best of R runs after a warm-up, the two libraries alternating. Not a test: absolute times depend on the
machine; numbers taken while other jobs share it are noisy (the report says when they were taken).
The Qwen3.5-0.8B layout has no backward yet (docs/gradients.md), so it is not measured.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "grad.md"))
    return ap.parse_args()


ARGS = parse_args()
os.environ["MIXLENS_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mixlens  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))
import published_layout_cache  # noqa: E402


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def best(fn, repeats: int) -> float:
    fn()
    t = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main():
    torch.set_num_threads(ARGS.threads)
    path = published_layout_cache.cached_layout()
    ml = mixlens.StandardizedTransformer(str(path), output="torch")
    L = ml.num_layers
    paths = [f"layers.{i}.layer_output" for i in range(L)]
    rows = []
    inputs = {n: np.random.default_rng(n).integers(3, 50000, size=n).tolist() for n in ARGS.tokens}
    for n, ids in inputs.items():
        def fwd():
            with ml.trace([ids]):
                pass

        def fwd_bwd():
            with ml.trace([ids], grad=True) as tr:
                pass
            tr.backward(mixlens.metrics.LogProb(7), paths=paths)

        rows.append({"n": n, "ml_fwd": best(fwd, ARGS.repeats), "ml_fb": best(fwd_bwd, ARGS.repeats)})
    rss_ml = rss_mib()

    from transformers import Mamba2ForCausalLM

    hf = Mamba2ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for p in hf.parameters():
        p.requires_grad_(False)
    for row in rows:
        x = torch.tensor([inputs[row["n"]]])

        def hf_fb():
            emb = hf.get_input_embeddings()(x).detach().requires_grad_(True)
            out = hf(inputs_embeds=emb, output_hidden_states=True, use_cache=False)
            for h in out.hidden_states:
                if h.requires_grad:
                    h.retain_grad()
            torch.log_softmax(out.logits[0, -1], -1)[7].backward()

        row["hf_fb"] = best(hf_fb, ARGS.repeats)
    rss_end = rss_mib()

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Gradients: mamba2-130m layout ({when}, {platform.machine()}, {ARGS.threads} threads, best of "
             f"{ARGS.repeats})", "",
             "Taken on a shared machine while other jobs ran: ratios are indicative only.", "",
             "| tokens | mixlens fwd (s) | mixlens fwd+bwd (s) | fwd+bwd / fwd (target <= 3) | transformers fwd+bwd (s) "
             "| transformers / mixlens (target >= 2) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['ml_fwd']:.3f} | {r['ml_fb']:.3f} | {r['ml_fb'] / r['ml_fwd']:.2f} | "
                     f"{r['hf_fb']:.3f} | {r['hf_fb'] / r['ml_fb']:.2f} |")
    lines += ["", f"Peak RSS: {rss_ml:.0f} MiB after the mixlens runs, {rss_end:.0f} MiB at the end (with transformers)."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(ARGS.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ARGS.out).write_text(text)


if __name__ == "__main__":
    main()
