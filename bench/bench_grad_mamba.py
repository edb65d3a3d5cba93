#!/usr/bin/env python
"""Native gradients for Mamba-1 (issue 12): forward + backward cost against a forward, and against
transformers' autograd doing the same.

    .venv/bin/python bench/bench_grad_mamba.py [--layout tiny|130m] [--threads N] [--repeats R] [--tokens 128]

Models: ``tiny`` = the shipped models/mamba-tinystories; ``130m`` = the state-spaces/mamba-130m-hf layout
(hidden 768, 24 layers, state 16, vocab 50280) with random weights, saved once under build/.
Metric: log p(token) at the last position; gradients of every layer's layer_output are kept (attribution
patching's need). mixlens: ``model.trace(ids, grad=True)`` + ``tr.backward(LogProb)``; its forward alone is
the same trace without grad; both scan algorithms (routed). transformers: its pure-torch forward with
inputs_embeds as the leaf (weights frozen), retain_grad on every hidden state, then ``.backward()``.
The runs alternate (fwd, fwd+bwd, transformers) R times; the table gives medians of process CPU time
(all threads; less sensitive than wall time to other jobs on a shared machine) and of wall time, with
the 1-minute load average before and after. Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=["tiny", "130m"], default="tiny")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    return ap.parse_args()


ARGS = parse_args()
os.environ["MIXLENS_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mixlens  # noqa: E402


def model_dir() -> Path:
    if ARGS.layout == "tiny":
        return REPO / "models" / "mamba-tinystories"
    d = REPO / "build" / "mamba-130m-layout"
    if not (d / "model.safetensors").exists():
        from transformers import MambaConfig, MambaForCausalLM

        torch.manual_seed(0)
        cfg = MambaConfig(hidden_size=768, num_hidden_layers=24, state_size=16, expand=2, conv_kernel=4,
                          vocab_size=50280, tie_word_embeddings=True)
        MambaForCausalLM(cfg).save_pretrained(str(d))
    return d


def timed(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0


def main():
    torch.set_num_threads(ARGS.threads)
    path = model_dir()
    ml = mixlens.StandardizedTransformer(str(path), output="torch")
    from transformers import MambaForCausalLM

    hf = MambaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for p in hf.parameters():
        p.requires_grad_(False)
    paths = [f"layers.{i}.layer_output" for i in range(ml.num_layers)]
    ids = np.random.default_rng(0).integers(3, ml.vocab_size, size=ARGS.tokens).tolist()
    x = torch.tensor([ids])

    def fwd():
        with ml.trace([ids]):
            pass

    def fwd_bwd():
        with ml.trace([ids], grad=True) as tr:
            pass
        tr.backward(mixlens.metrics.LogProb(7), paths=paths)

    def hf_fb():
        emb = hf.get_input_embeddings()(x).detach().requires_grad_(True)
        out = hf(inputs_embeds=emb, output_hidden_states=True, use_cache=False)
        for h in out.hidden_states:
            if h.requires_grad:
                h.retain_grad()
        torch.log_softmax(out.logits[0, -1], -1)[7].backward()

    load0 = os.getloadavg()[0]
    rows = []
    hf_times = []
    for route in ("recurrent", "chunked"):
        mixlens.route_kernels("mamba", route)
        t = {"fwd": [], "fb": []}
        fwd(), fwd_bwd()  # warm-up
        for _ in range(ARGS.repeats):
            t["fwd"].append(timed(fwd))
            t["fb"].append(timed(fwd_bwd))
            if route == "recurrent":
                hf_times.append(timed(hf_fb))
        rows.append((route, t))
    mixlens.route_kernels("mamba", "default")
    load1 = os.getloadavg()[0]

    def med(xs, k):
        return statistics.median(v[k] for v in xs)

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Gradients, Mamba-1: {ARGS.layout} layout, {ARGS.tokens} tokens ({when}, {platform.machine()}, "
             f"{ARGS.threads} threads, median of {ARGS.repeats}, interleaved)", "",
             f"1-minute load average {load0:.1f} before, {load1:.1f} after (the machine is shared: CPU-time ratios "
             "are the numbers to read).", "",
             "| scan | mixlens fwd CPU s (wall) | fwd+bwd CPU s (wall) | fwd+bwd / fwd, CPU (target <= 3) | "
             "transformers fwd+bwd CPU s (wall) | transformers / mixlens, CPU (target >= 2) |",
             "|---|---|---|---|---|---|"]
    hc, hw = med(hf_times, 0), med(hf_times, 1)
    for route, t in rows:
        fc, fw, bc, bw = med(t["fwd"], 0), med(t["fwd"], 1), med(t["fb"], 0), med(t["fb"], 1)
        lines.append(f"| {route} | {fc:.3f} ({fw:.3f}) | {bc:.3f} ({bw:.3f}) | {bc / fc:.2f} | {hc:.3f} ({hw:.3f}) | "
                     f"{hc / bc:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(ARGS.out) if ARGS.out else REPO / "bench" / "results" / f"grad_mamba_{ARGS.layout}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
