#!/usr/bin/env python
"""Native gradients (issue 12), every family: forward + backward time against a forward, and against
transformers' autograd doing the same, with peak memory.

    .venv/bin/python bench/bench_grad.py --family mamba2 [qwen3_5 mamba qwen3_next nemotron_h bamba falcon_h1]
        [--layout NAME ...] [--tokens 1024] [--repeats 3] [--threads N] [--routes default recurrent chunked]
        [--no-transformers] [--memory all|fb|none] [--quick] [--out bench/results/grad.md]

--quick: 128 tokens, 1 repeat (a smoke run of the whole script). Each layout's section of --out is
replaced (the other sections are kept), so families measured in separate runs share one file.

Layouts (random weights; --family picks the first of its family's, --layout names any):
- mamba2-130m, mamba-130m, qwen3.5-0.8b (24 layers, the published 248320-token LM head), and the
  hybrids' published layouts (nemotron_h-published, bamba-published, falcon_h1-published): bench/harness.py
  ``checkpoints()``, the same folders the speed harness measures (bf16 on disk where the release is:
  both libraries compute in float32 from the same bf16-rounded weights).
- qwen3.5-0.8b-x4: Qwen3.5-0.8B's per-layer layout cut to 4 blocks (3 GDN + 1 attention) and a
  32768-token vocabulary; qwen3-next-moe-x4: the same with a Qwen3-Next MoE (8 experts, top 2, shared
  expert); mamba-tiny: the shipped models/mamba-tinystories; nemotron_h-small, bamba-small,
  falcon_h1-small: hidden 256, 6-8 blocks (mixlens_dev/fixtures/hybrids.py's builder).
Metric: log p(token 7) at the last position; the gradients of the embeddings and of every layer's
layer_output are computed (attribution patching's need; the embeddings' because transformers' leaf is
inputs_embeds, so both sides run every block's backward).
- mixlens forward: ``model.trace(ids)`` (nothing saved); forward + backward: ``model.trace(ids,
  grad=True)`` then ``tr.backward(LogProb(7), paths=embeddings + every layer_output)``; once per --routes entry
  (``route_kernels(family, route)``).
- transformers: its pure-torch forward with inputs_embeds as the leaf (weights frozen, so no weight
  gradients), retain_grad on every hidden state, then ``.backward()``; its no-grad forward for reference.
Timing: the measured calls alternate within each round (mixlens fwd, mixlens fwd+bwd, transformers fwd,
transformers fwd+bwd), after a warm-up (mixlens' calls, transformers' on 16 tokens); each call's process
CPU time (every thread) and wall time are recorded with the 1-minute load average. Ratios use the best
(least disturbed) of the rounds; CPU time is the better measure on a shared machine (wall time includes
waiting for a core).
Peak memory: each configuration runs once more in a fresh subprocess, which reports its RSS once the model
is loaded and the peak RSS during the call (VmHWM reset through /proc/self/clear_refs after loading, so the
load's own peak (bf16 -> float32 widening) is not counted); the increase is what the call needs beyond the
loaded model.
Not a test: absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

from mixlens_dev import timing

REPO = Path(__file__).resolve().parents[1]
TOKEN = 7  # the metric's target token
# layout -> family (route_kernels name). The first layout of a family is its default.
LAYOUTS = {
    "mamba2-130m": "mamba2",
    "qwen3.5-0.8b": "qwen3_5", "qwen3.5-0.8b-x4": "qwen3_5",
    "mamba-130m": "mamba", "mamba-tiny": "mamba",
    "qwen3-next-moe-x4": "qwen3_next",
    "nemotron_h-small": "nemotron_h", "nemotron_h-published": "nemotron_h",
    "bamba-small": "bamba", "bamba-published": "bamba",
    "falcon_h1-small": "falcon_h1", "falcon_h1-published": "falcon_h1",
}
FAMILIES = tuple(dict.fromkeys(LAYOUTS.values()))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", nargs="+", choices=FAMILIES, default=[])
    ap.add_argument("--layout", nargs="+", choices=list(LAYOUTS), default=[])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024])
    ap.add_argument("--routes", nargs="+", choices=["default", "recurrent", "chunked"], default=["default"])
    ap.add_argument("--quick", action="store_true", help="128 tokens, 1 repeat")
    ap.add_argument("--no-transformers", action="store_true", help="mixlens only")
    ap.add_argument("--memory", choices=["all", "fb", "none"], default="all",
                    help="peak-memory subprocesses for every call, the fwd+bwd calls only, or none")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "grad.md"))
    ap.add_argument("--child", nargs=4, metavar=("LAYOUT", "ROUTE", "WHAT", "TOKENS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.tokens, a.repeats = [128], 1
    a.layouts = list(dict.fromkeys(a.layout + [next(k for k, f in LAYOUTS.items() if f == fam) for fam in a.family]))
    if not a.layouts and not a.child:
        ap.error("name at least one --family or --layout")
    return a


ARGS = parse_args()
# Both libraries read their thread counts at start-up.
os.environ["MIXLENS_NUM_THREADS"] = str(ARGS.threads)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mixlens  # noqa: E402


torch.set_num_threads(ARGS.threads)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def status_mib(key: str) -> float:
    """VmRSS / VmHWM of this process from /proc/self/status, MiB."""
    import re

    m = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(m.group(1)) / 1024.0


def reset_peak() -> bool:
    """Resets VmHWM (the peak RSS) to the current RSS (Linux: clear_refs 5), so the peak measured after a
    call is the call's own, not the load's (bf16 -> float32 widening peaks above the loaded size)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def load_avg() -> float:
    return os.getloadavg()[0]


# ----------------------------------------------------------------------------------- the layouts
LIN, FULL = "linear_attention", "full_attention"
QWEN_X4 = dict(vocab_size=32768, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4,
               layer_types=[LIN, LIN, LIN, FULL], num_attention_heads=8, num_key_value_heads=2, head_dim=256,
               linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0,
               rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
QWEN_NEXT_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
                     shared_expert_intermediate_size=512, decoder_sparse_step=1)
SMALL = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)
HYBRIDS_SMALL = {
    "nemotron_h": dict(SMALL, hybrid_override_pattern="M-M*M-M-", mamba_num_heads=8, mamba_head_dim=32,
                       ssm_state_size=64, n_groups=2, head_dim=32, chunk_size=64),
    "bamba": dict(SMALL, num_hidden_layers=6, attn_layer_indices=[2], mamba_n_heads=8, mamba_d_head=64,
                  mamba_n_groups=1, mamba_d_state=64, mamba_chunk_size=64),
    "falcon_h1": dict(SMALL, num_hidden_layers=6, mamba_d_ssm=512, mamba_n_heads=8, mamba_d_head=64,
                      mamba_n_groups=1, mamba_d_state=64, mamba_chunk_size=64),
}


def built(name: str, make) -> Path:
    """A random-weight folder made once by ``make(folder)`` under build/grad-bench (a marker is written last)."""
    out = REPO / "build" / "grad-bench" / name
    if not (out / ".complete").is_file():
        make(out)
        (out / ".complete").write_text("ok\n")
    return out


def layout_path(layout: str) -> Path:
    import harness

    fam = LAYOUTS[layout]
    if layout in ("mamba2-130m", "mamba-130m", "qwen3.5-0.8b") or layout.endswith("-published"):
        return harness.checkpoints([fam])[fam]
    if layout == "mamba-tiny":
        return REPO / "models" / "mamba-tinystories"
    if layout.endswith("-small"):
        from mixlens_dev.fixtures import hybrids as mh

        return built(layout, lambda d: mh.build_model(fam, HYBRIDS_SMALL[fam], seed=1).save_pretrained(d))
    import transformers

    def make_qwen(d, cls, cfg_cls, extra):
        torch.manual_seed(0)
        getattr(transformers, cls)(getattr(transformers, cfg_cls)(**dict(QWEN_X4, **extra))).save_pretrained(d)

    if layout == "qwen3.5-0.8b-x4":
        return built(layout, lambda d: make_qwen(d, "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", {}))
    return built(layout, lambda d: make_qwen(d, "Qwen3NextForCausalLM", "Qwen3NextConfig", QWEN_NEXT_MOE))


def load_mixlens(path: Path):
    return mixlens.StandardizedTransformer(str(path), output="torch")


def load_transformers(path: Path):
    """transformers' model in float32 from the folder's weights (bf16-rounded where stored in bf16)."""
    import transformers

    cfg = json.loads((path / "config.json").read_text())
    cls = (transformers.Qwen3_5ForConditionalGeneration if cfg.get("model_type") == "qwen3_5"
           else transformers.AutoModelForCausalLM)
    hf = cls.from_pretrained(str(path), dtype="auto").float()
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
    # The embeddings too: transformers' leaf is inputs_embeds, so its autograd runs block 0's backward;
    # without them mixlens would stop at block 0's output (GradSink::needs_below) and do less work.
    paths = ["embed_tokens.output"] + [f"layers.{i}.layer_output" for i in range(ml.num_layers)]

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
    s = timing.timed(fn)
    return {"cpu": s.cpu, "wall": s.wall, "load": load}


# ----------------------------------------------------------------------------------- memory (child)
def child(layout: str, route: str, what: str, n: int) -> None:
    """One call in a fresh process: prints {"loaded": MiB, "peak": MiB}: the RSS once loaded, and the peak RSS
    during the call (VmHWM reset after loading; where the kernel refuses the reset, the process's peak)."""
    path = layout_path(layout)
    ids = prompt(path, n)
    if what.startswith("ml"):
        mixlens.route_kernels(LAYOUTS[layout], route)
        ml = load_mixlens(path)
        fwd, fb = ml_calls(ml, ids)
    else:
        hf = load_transformers(path)
        fwd, fb = hf_calls(hf, ids)
    import gc

    gc.collect()
    loaded = status_mib("VmRSS")
    exact = reset_peak()
    (fb if what.endswith("fb") else fwd)()
    print(json.dumps({"loaded": loaded, "peak": status_mib("VmHWM") if exact else rss_mib(), "exact": exact}))


def peak_memory(layout: str, route: str, what: str, n: int) -> dict | None:
    if ARGS.memory == "none" or (ARGS.memory == "fb" and not what.endswith("fb")):
        return None
    cmd = [sys.executable, __file__, "--threads", str(ARGS.threads), "--child", layout, route, what, str(n)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"failed": (r.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(r.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------- the report
def fmt_mem(m: dict | None) -> str:
    if m is not None and "failed" in m:
        return f"failed ({m['failed']})"
    return "not measured" if m is None else f"{m['peak']:.0f} (+{m['peak'] - m['loaded']:.0f})"


def run_layout(layout: str) -> list[str]:
    fam = LAYOUTS[layout]
    path = layout_path(layout)
    ml = load_mixlens(path)
    hf = None if ARGS.no_transformers else load_transformers(path)
    unsupported = backward_support(ml, prompt(path, 8))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## {layout} ({fam})", "",
             f"{when}, {platform.machine()}, {os.cpu_count()} cores, {ARGS.threads} threads for both libraries, "
             f"best of {ARGS.repeats} interleaved rounds after a warm-up; load = 1-minute load average at each call. "
             f"`.venv/bin/python bench/bench_grad.py {' '.join(sys.argv[1:])}`.", ""]
    if unsupported:
        lines += [f"mixlens: backward not implemented for this layout ({unsupported}).", ""]
    rows = []
    for n in ARGS.tokens:
        ids = prompt(path, n)
        calls = {}  # "ml_fwd@route" / "ml_fb@route" / "hf_fwd" / "hf_fb"
        for route in ARGS.routes:
            def routed(fn, route=route):
                def call():
                    mixlens.route_kernels(fam, route)
                    try:
                        fn()
                    finally:
                        mixlens.route_kernels(fam, "default")
                return call
            fwd, fb = ml_calls(ml, ids)
            calls[f"ml_fwd@{route}"] = routed(fwd)
            if not unsupported:
                calls[f"ml_fb@{route}"] = routed(fb)
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
        mem = {k: peak_memory(layout, k.partition("@")[2] or "default", k.partition("@")[0], n) for k in calls}
        rows.append((n, best, runs, loads, mem))

    def ratio(best, a, b, m):
        return f"{best[a][m] / best[b][m]:.2f}" if a in best and b in best else "n/a"

    na = "backward not implemented" if unsupported else "n/a"

    def cell(best, k):
        return f"{best[k]['cpu']:.3f} / {best[k]['wall']:.3f}" if k in best else (na if k.startswith("ml_fb") else "n/a")

    lines += ["| tokens | route | mixlens fwd s (cpu / wall) | mixlens fwd+bwd s (cpu / wall) | fwd+bwd / fwd, cpu "
              "(wall) [target <= 3] | transformers fwd s (cpu / wall) | transformers fwd+bwd s (cpu / wall) | "
              "transformers / mixlens fwd+bwd, cpu (wall) [target >= 2] | load (min-max) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for n, best, runs, loads, mem in rows:
        for route in ARGS.routes:
            f, fb = f"ml_fwd@{route}", f"ml_fb@{route}"
            lines.append(f"| {n} | {route} | {cell(best, f)} | {cell(best, fb)} | {ratio(best, fb, f, 'cpu')} "
                         f"({ratio(best, fb, f, 'wall')}) | {cell(best, 'hf_fwd')} | {cell(best, 'hf_fb')} | "
                         f"{ratio(best, 'hf_fb', fb, 'cpu')} ({ratio(best, 'hf_fb', fb, 'wall')}) | "
                         f"{min(loads):.1f}-{max(loads):.1f} |")
    if ARGS.memory != "none":
        lines += ["", "Peak RSS in MiB during one call in a fresh process (increase over the loaded model's RSS in "
                  "brackets; the peak is reset after loading):", "",
                  "| tokens | route | mixlens fwd | mixlens fwd+bwd | transformers fwd | transformers fwd+bwd |",
                  "|---|---|---|---|---|---|"]
        for n, best, runs, loads, mem in rows:
            for route in ARGS.routes:
                fb = f"ml_fb@{route}"
                lines.append(f"| {n} | {route} | {fmt_mem(mem.get(f'ml_fwd@{route}'))} | "
                             f"{fmt_mem(mem[fb]) if fb in mem else na} | "
                             f"{fmt_mem(mem['hf_fwd']) if 'hf_fwd' in mem else 'n/a'} | "
                             f"{fmt_mem(mem['hf_fb']) if 'hf_fb' in mem else 'n/a'} |")
    lines += ["", "Every round (s, cpu / wall, load):", ""]
    for n, best, runs, loads, mem in rows:
        for k, v in runs.items():
            lines.append(f"- {n} tokens, {k}: " + ", ".join(f"{r['cpu']:.2f} / {r['wall']:.2f} @{r['load']:.1f}"
                                                             for r in v))
    del ml, hf
    return lines + [""]


HEADER = ["# Gradients: forward + backward vs forward, and vs transformers' autograd (bench/bench_grad.py)", "",
          "One section a layout, each replaced when that layout is measured again (the machine is shared: the "
          "CPU-time ratios measured interleaved are the figures to read; the load is recorded per call).", ""]


def merge_sections(old: str, new: dict[str, list[str]]) -> str:
    """--out's text with the sections of `new` (by their "## layout" heading) replaced or appended."""
    sections: dict[str, list[str]] = {}
    cur = None
    for line in old.splitlines():
        if line.startswith("## "):
            cur = line[3:].split(" (")[0]
            sections[cur] = []
        if cur is not None:
            sections[cur].append(line)
    for k, v in new.items():
        sections[k] = v
    order = sorted(sections, key=lambda k: k.startswith("Earlier runs"))  # the historical section stays last
    sections = {k: sections[k] for k in order}
    return "\n".join(HEADER + [ln for v in sections.values() for ln in v]).rstrip() + "\n"


def main():
    if ARGS.child:
        layout, route, what, n = ARGS.child
        child(layout, route, what, int(n))
        return
    new = {layout: run_layout(layout) for layout in ARGS.layouts}
    out = Path(ARGS.out)
    text = merge_sections(out.read_text() if out.exists() else "", new)
    print("\n".join(ln for v in new.values() for ln in v))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
