#!/usr/bin/env python
"""Native gradients (issue 12): forward + backward time against a forward, and against transformers'
autograd doing the same, with peak memory, on the mamba2-130m and Qwen3.5-0.8B layouts.

    .venv/bin/python bench/bench_grad.py [--layout mamba2-130m qwen3.5-0.8b] [--tokens 1024] [--repeats 3]
                                         [--threads N] [--quick] [--out bench/results/grad.md]

--quick: 128 tokens, 1 repeat (a smoke run of the whole script).

Models: random weights in the published layouts (scripts/published_layout_cache.py for mamba2-130m;
scripts/make_published_layout.py's cached_qwen3_5_0_8b for Qwen3.5-0.8B, bf16 on disk: both libraries
compute in float32 from the same bf16-rounded weights). Metric: log p(token 7) at the last position;
the gradients of every layer's layer_output are computed (attribution patching's need).
- mixlens forward: ``model.trace(ids)`` (nothing saved); forward + backward: ``model.trace(ids,
  grad=True)`` then ``tr.backward(LogProb(7), paths=every layer_output)``.
- transformers: its pure-torch forward with inputs_embeds as the leaf (weights frozen, so no weight
  gradients), retain_grad on every hidden state, then ``.backward()``; its no-grad forward for reference.
Timing: the measured calls alternate within each round (mixlens fwd, mixlens fwd+bwd, transformers fwd,
transformers fwd+bwd), after a warm-up (mixlens' calls, transformers' on 16 tokens); each call's process
CPU time (every thread) and wall time are recorded with the 1-minute load average. Ratios use the best (least disturbed) of the rounds; CPU
time is the better measure on a shared machine (wall time includes waiting for a core).
Peak memory: each configuration runs once more in a fresh subprocess, which reports its peak RSS after
loading the model and at the end (the increase is what the call needs beyond the weights).
A layout whose family has no backward yet reports "backward not implemented" (with the library's
message) in place of its fwd+bwd numbers; its forward and transformers' numbers are still measured.
Not a test: absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = ("mamba2-130m", "qwen3.5-0.8b")
TOKEN = 7  # the metric's target token


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", nargs="+", choices=LAYOUTS, default=["mamba2-130m"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024])
    ap.add_argument("--quick", action="store_true", help="128 tokens, 1 repeat")
    ap.add_argument("--no-transformers", action="store_true", help="mixlens only")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "grad.md"))
    ap.add_argument("--child", nargs=3, metavar=("LAYOUT", "WHAT", "TOKENS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.tokens, a.repeats = [128], 1
    return a


ARGS = parse_args()
# Both libraries read their thread counts at start-up.
os.environ["MIXLENS_NUM_THREADS"] = str(ARGS.threads)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mixlens  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))

torch.set_num_threads(ARGS.threads)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def load_avg() -> float:
    return os.getloadavg()[0]


# ----------------------------------------------------------------------------------- the layouts
def layout_path(layout: str) -> Path:
    if layout == "mamba2-130m":
        import published_layout_cache

        return published_layout_cache.cached_layout()
    import make_published_layout

    return make_published_layout.cached_qwen3_5_0_8b(REPO / "build" / "published")


def load_mixlens(path: Path):
    return mixlens.StandardizedTransformer(str(path), output="torch")


def load_transformers(layout: str, path: Path):
    if layout == "mamba2-130m":
        from transformers import Mamba2ForCausalLM

        hf = Mamba2ForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        from transformers import AutoConfig, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

        cls = (Qwen3_5ForConditionalGeneration if AutoConfig.from_pretrained(path).model_type == "qwen3_5"
               else Qwen3_5ForCausalLM)
        hf = cls.from_pretrained(str(path), dtype=torch.bfloat16).float()  # the bf16-rounded weights, in float32
    hf.eval()
    for p in hf.parameters():
        p.requires_grad_(False)
    return hf


def vocab_of(path: Path) -> int:
    cfg = json.loads((path / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["vocab_size"])


def prompt(path: Path, n: int) -> list[int]:
    return np.random.default_rng(n).integers(3, min(vocab_of(path), 50000), size=n).tolist()


# ----------------------------------------------------------------------------------- the calls
def ml_calls(ml, ids):
    paths = [f"layers.{i}.layer_output" for i in range(ml.num_layers)]

    def fwd():
        with ml.trace([ids]):
            pass

    def fwd_bwd():
        with ml.trace([ids], grad=True) as tr:
            pass
        tr.backward(mixlens.metrics.LogProb(TOKEN), paths=paths)
        assert tr.grad(paths[0]).shape[1] == len(ids)

    return fwd, fwd_bwd


def hf_calls(hf, ids):
    x = torch.tensor([ids])

    def fwd():
        with torch.no_grad():
            hf(input_ids=x, use_cache=False)

    def fwd_bwd():
        emb = hf.get_input_embeddings()(x).detach().requires_grad_(True)
        out = hf(inputs_embeds=emb, output_hidden_states=True, use_cache=False)
        for h in out.hidden_states:
            if h.requires_grad:
                h.retain_grad()
        torch.log_softmax(out.logits[0, -1], -1)[TOKEN].backward()

    return fwd, fwd_bwd


def backward_support(ml, ids) -> str | None:
    """None when this model's backward runs, else the library's message."""
    try:
        ml_calls(ml, ids[:4])[1]()
    except mixlens.UnsupportedError as e:
        return str(e)
    return None


def timed(fn) -> dict:
    load = load_avg()
    c, w = time.process_time(), time.perf_counter()
    fn()
    return {"cpu": time.process_time() - c, "wall": time.perf_counter() - w, "load": load}


# ----------------------------------------------------------------------------------- memory (child)
def child(layout: str, what: str, n: int) -> None:
    """One call in a fresh process: prints {"loaded": MiB, "peak": MiB} (peak RSS after loading, at the end)."""
    path = layout_path(layout)
    ids = prompt(path, n)
    if what.startswith("ml"):
        ml = load_mixlens(path)
        loaded = rss_mib()
        fwd, fb = ml_calls(ml, ids)
    else:
        hf = load_transformers(layout, path)
        loaded = rss_mib()
        fwd, fb = hf_calls(hf, ids)
    (fb if what.endswith("fb") else fwd)()
    print(json.dumps({"loaded": loaded, "peak": rss_mib()}))


def peak_memory(layout: str, what: str, n: int) -> dict | None:
    cmd = [sys.executable, __file__, "--threads", str(ARGS.threads), "--child", layout, what, str(n)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------- the report
def fmt_mem(m: dict | None) -> str:
    return "failed" if m is None else f"{m['peak']:.0f} (+{m['peak'] - m['loaded']:.0f})"


def run_layout(layout: str) -> list[str]:
    path = layout_path(layout)
    ml = load_mixlens(path)
    hf = None if ARGS.no_transformers else load_transformers(layout, path)
    unsupported = backward_support(ml, prompt(path, 8))
    lines = [f"## {layout} layout", ""]
    if unsupported:
        lines += [f"mixlens: backward not implemented for this layout ({unsupported}).", ""]
    rows = []
    for n in ARGS.tokens:
        ids = prompt(path, n)
        calls = {}
        calls["ml_fwd"], ml_fb = ml_calls(ml, ids)
        if not unsupported:
            calls["ml_fb"] = ml_fb
        if hf is not None:
            calls["hf_fwd"], calls["hf_fb"] = hf_calls(hf, ids)
        # Warm-up: mixlens' calls as measured (first touch of the mapped weights); transformers' on 16
        # tokens (its first call initialises lazily; a full one costs minutes at 1,024 tokens on 2 cores).
        for k, fn in calls.items():
            if k.startswith("ml"):
                fn()
        if hf is not None:
            for fn in hf_calls(hf, ids[:16]):
                fn()
        runs = {k: [] for k in calls}
        for _ in range(ARGS.repeats):
            for k, fn in calls.items():
                runs[k].append(timed(fn))
        best = {k: {m: min(r[m] for r in v) for m in ("cpu", "wall")} for k, v in runs.items()}
        loads = [r["load"] for v in runs.values() for r in v]
        mem = {k: peak_memory(layout, k, n) for k in calls}
        rows.append((n, best, runs, loads, mem))

    def ratio(best, a, b, m):
        return f"{best[a][m] / best[b][m]:.2f}" if a in best and b in best else "n/a"

    lines += ["| tokens | mixlens fwd s (cpu / wall) | mixlens fwd+bwd s (cpu / wall) | fwd+bwd / fwd, cpu (wall) "
              "[target <= 3] | transformers fwd s (cpu / wall) | transformers fwd+bwd s (cpu / wall) | "
              "transformers / mixlens fwd+bwd, cpu (wall) [target >= 2] | load (min-max) |",
              "|---|---|---|---|---|---|---|---|"]
    na = "backward not implemented" if unsupported else "n/a"
    for n, best, runs, loads, mem in rows:
        def cell(k):
            return f"{best[k]['cpu']:.3f} / {best[k]['wall']:.3f}" if k in best else (na if k == "ml_fb" else "n/a")
        lines.append(f"| {n} | {cell('ml_fwd')} | {cell('ml_fb')} | {ratio(best, 'ml_fb', 'ml_fwd', 'cpu')} "
                     f"({ratio(best, 'ml_fb', 'ml_fwd', 'wall')}) | {cell('hf_fwd')} | {cell('hf_fb')} | "
                     f"{ratio(best, 'hf_fb', 'ml_fb', 'cpu')} ({ratio(best, 'hf_fb', 'ml_fb', 'wall')}) | "
                     f"{min(loads):.1f}-{max(loads):.1f} |")
    lines += ["", "Peak RSS in MiB of one call in a fresh process (increase over the loaded model in brackets):", "",
              "| tokens | mixlens fwd | mixlens fwd+bwd | transformers fwd | transformers fwd+bwd |", "|---|---|---|---|---|"]
    for n, best, runs, loads, mem in rows:
        lines.append(f"| {n} | {fmt_mem(mem.get('ml_fwd'))} | "
                     f"{fmt_mem(mem['ml_fb']) if 'ml_fb' in mem else na} | "
                     f"{fmt_mem(mem['hf_fwd']) if 'hf_fwd' in mem else 'n/a'} | "
                     f"{fmt_mem(mem['hf_fb']) if 'hf_fb' in mem else 'n/a'} |")
    lines += ["", "Every round (s, cpu / wall, load):", ""]
    for n, best, runs, loads, mem in rows:
        for k, v in runs.items():
            lines.append(f"- {n} tokens, {k}: " + ", ".join(f"{r['cpu']:.2f} / {r['wall']:.2f} @{r['load']:.1f}"
                                                             for r in v))
    del ml, hf
    return lines + [""]


def main():
    if ARGS.child:
        layout, what, n = ARGS.child
        child(layout, what, int(n))
        return
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Gradients: forward + backward vs forward, and vs transformers' autograd", "",
             f"{when}, {platform.machine()}, {os.cpu_count()} cores, {ARGS.threads} threads for both libraries, "
             f"best of {ARGS.repeats} interleaved rounds after a warm-up; load = 1-minute load average at each call. "
             f"`.venv/bin/python bench/bench_grad.py {' '.join(sys.argv[1:])}`.", ""]
    for layout in ARGS.layout:
        lines += run_layout(layout)
    text = "\n".join(lines) + "\n"
    print(text)
    Path(ARGS.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ARGS.out).write_text(text)


if __name__ == "__main__":
    main()
