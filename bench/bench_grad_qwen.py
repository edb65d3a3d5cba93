#!/usr/bin/env python
"""Native gradients of the Qwen hybrids (issue 12): forward + backward against a forward, and against
transformers' autograd doing the same, on Qwen3.5-0.8B's per-layer layout (hidden 1024, 16 GDN heads of
128 x 128, 8 attention heads of 256 with 2 KV heads, SwiGLU 3584, partial RoPE 0.25) cut to 4 blocks (the
published 3:1 GDN : attention pattern, 1/6 of the depth) and a 32768-token vocabulary (the published
248320-row LM head alone would dominate both sides), random weights; and a Qwen3-Next-shaped MoE variant
(8 experts, top 2, shared expert).

    .venv/bin/python bench/bench_grad_qwen.py [--threads N] [--repeats R] [--tokens 128] [--out bench/results/grad_qwen.md]

Metric: log p(token) at the last position; gradients of every block's layer_output (attribution patching's
need). mixlens: `model.trace(ids, grad=True)` + `tr.backward(LogProb)`; its forward is the same trace without
grad. transformers: the pure-torch forward (torch_chunk_gated_delta_rule) with inputs_embeds as the leaf and
frozen weights, retain_grad on every hidden state, then .backward(). Timing: process CPU time and wall time,
the three measurements interleaved per repeat, best of R; the load average is recorded (the machine is shared).
Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "grad_qwen.md"))
    return ap.parse_args()


ARGS = parse_args()
os.environ["MIXLENS_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import mixlens  # noqa: E402

LIN, FULL = "linear_attention", "full_attention"
BASE = dict(vocab_size=32768, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4,
            layer_types=[LIN, LIN, LIN, FULL], num_attention_heads=8, num_key_value_heads=2, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
LAYOUTS = {
    "qwen3_5 (0.8B layers x4)": (transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig, {}),
    "qwen3_next (MoE 8 x top-2)": (transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig,
                                   dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
                                        shared_expert_intermediate_size=512, decoder_sparse_step=1)),
}


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn):
    c, w = cpu(), time.perf_counter()
    fn()
    return cpu() - c, time.perf_counter() - w


def bench_layout(name, cls, cfg_cls, extra, tmp):
    torch.manual_seed(0)
    cfg = cfg_cls(**dict(BASE, **extra))
    hf = cls(cfg).eval()
    d = Path(tmp) / name.split()[0]
    hf.save_pretrained(d)
    for p in hf.parameters():
        p.requires_grad_(False)
    ml = mixlens.StandardizedTransformer(str(d), output="numpy")
    paths = [f"layers.{i}.layer_output" for i in range(cfg.num_hidden_layers)]
    rows = []
    for n in ARGS.tokens:
        ids = np.random.default_rng(n).integers(3, cfg.vocab_size, size=n).tolist()
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

        fwd(), fwd_bwd(), hf_fb()  # warm-up
        res = {"fwd": [], "fb": [], "hf": []}
        for _ in range(ARGS.repeats):  # interleaved: the three see the same load
            for k, f in (("fwd", fwd), ("fb", fwd_bwd), ("hf", hf_fb)):
                res[k].append(timed(f))
        best = {k: (min(c for c, _ in v), min(w for _, w in v)) for k, v in res.items()}
        rows.append((name, n, best))
    return rows


def main():
    torch.set_num_threads(ARGS.threads)
    load0 = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (cls, cfg_cls, extra) in LAYOUTS.items():
            rows += bench_layout(name, cls, cfg_cls, extra, tmp)
    load1 = os.getloadavg()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Gradients: Qwen hybrids ({when}, {platform.machine()}, {ARGS.threads} threads, best of {ARGS.repeats}, "
             "interleaved)", "",
             f"Load average (1, 5, 15 min) {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f} before, "
             f"{load1[0]:.1f} / {load1[1]:.1f} / {load1[2]:.1f} after, on {os.cpu_count()} cores: wall times are "
             "noisy; the CPU-time ratios are the figures to read.", "",
             "| layout | tokens | mixlens fwd CPU s (wall) | fwd+bwd CPU s (wall) | fwd+bwd / fwd CPU (wall), target <= 3 "
             "| transformers fwd+bwd CPU s (wall) | transformers / mixlens CPU (wall), target >= 2 |",
             "|---|---|---|---|---|---|---|"]
    for name, n, b in rows:
        f, fb, hf = b["fwd"], b["fb"], b["hf"]
        lines.append(f"| {name} | {n} | {f[0]:.3f} ({f[1]:.3f}) | {fb[0]:.3f} ({fb[1]:.3f}) | "
                     f"{fb[0] / f[0]:.2f} ({fb[1] / f[1]:.2f}) | {hf[0]:.3f} ({hf[1]:.3f}) | "
                     f"{hf[0] / fb[0]:.2f} ({hf[1] / fb[1]:.2f}) |")
    lines += ["", f"Peak RSS of the process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(ARGS.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ARGS.out).write_text(text)


if __name__ == "__main__":
    main()
