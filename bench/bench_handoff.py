#!/usr/bin/env python
"""Python hand-off cost: what reading N values inside one ``with model.trace(...)`` block adds.

    .venv/bin/python bench/bench_handoff.py [--model DIR] [--repeats R] [--out bench/results/handoff.md]
    .venv/bin/python bench/bench_handoff.py --ab DIR [--rounds K]   # A/B against another build

For N in 0, 1, 10, 100 the block reads the first N small values of the model in forward order
(layer_input, layer_output, betas, decays, states, ...: a few KiB each, so the copy is small and the
time is the hand-off: Python attribute lookup, the binding, the forward pausing and resuming;
``--values computed`` leaves out the ``states`` stacks, whose read makes the forward run a per-token state
pass it otherwise skips). Two
ways of reading: ``full`` spells each read as a user does, ``model.layers[i].linear_attn.betas``
(every attribute looked up in the block) and drops each value, ``kept`` reads the same way and holds
every value until the block ends (each is then released read-only as the forward moves on: the in-place
edit bookkeeping), ``envoy`` reads through a ``model.layers[i].linear_attn`` object made before the
block. The per-value cost is (t(N) - t(0)) / N, the counts interleaved block by block: the median over
the R repeats of each N-value block against the empty block just before it (the typical cost), and the
fastest against the fastest; for wall time and for process CPU time (every thread counts: the block,
the forward, the pool's threads).

``--ab DIR``: DIR holds another build's ``mixlens`` package (e.g. a copy of main's installed one,
``cp -a .venv/lib/python3.11/site-packages/mixlens DIR/mixlens``); the script runs itself K rounds,
each round that build (``base``, via PYTHONPATH) and this one (``this``) in turn, numpy then torch
output, and writes every round's per-value time and the medians. Default model: a tiny random
24-layer Mamba-2 (hidden 64, made once with transformers under build/), whose 8-token forward takes
about a millisecond, so the forward's own jitter does not hide the hand-off; --model DIR measures
another checkpoint. Not a test: numbers depend on the machine and its load (printed with the result).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from mixlens_dev.timing import Timer, median

REPO = Path(__file__).resolve().parents[1]
COUNTS = (0, 1, 10, 100)
ACCESS = ("full", "kept", "envoy")


def tiny_model(out: Path) -> Path:
    """A random Mamba2ForCausalLM with 24 layers of width 64 (about 1,000 values per 8-token call)."""
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    cfg = Mamba2Config(hidden_size=64, num_hidden_layers=24, num_heads=8, head_dim=16, expand=2, state_size=16,
                       n_groups=1, vocab_size=256, chunk_size=8, tie_word_embeddings=True)
    Mamba2ForCausalLM(cfg).save_pretrained(out)
    return out


def small_paths(model, limit: int, max_numel: int = 1 << 16, computed_only: bool = False) -> list[str]:
    """The first `limit` values of up to max_numel elements in forward order. computed_only: without the
    `states` stacks, whose read makes the forward run a per-token state pass it otherwise skips (compute
    bought by the read, measured by bench_state_after.py, not hand-off)."""
    out = []
    for v in model.values(1, 8):
        n = 1
        for d in v["shape"]:
            n *= d
        if computed_only and v["path"].endswith(".states"):
            continue
        if n <= max_numel and not v["path"].endswith("state_input"):
            out.append(v["path"])
    return out[:limit]


def envoy_reader(model, path: str):
    """Through a model.layers[i].linear_attn object made beforehand (the attribute read alone)."""
    parts = path.split(".")
    if parts[0] == "layers":
        obj = model.layers[int(parts[1])]
        for p in parts[2:-1]:
            obj = getattr(obj, p)
    else:
        obj = getattr(model, parts[0])
    last = parts[-1]
    return lambda: getattr(obj, last)


def full_reader(model, path: str):
    """``model.layers[i].linear_attn.betas`` compiled as the user's own source line (attribute syntax, not
    getattr()): every lookup happens in the block."""
    parts = path.split(".")
    if not all(p.isidentifier() or p.isdigit() for p in parts):
        raise ValueError(f"unexpected value path {path!r}")
    if parts[0] == "layers":
        expr = f"model.layers[{int(parts[1])}]." + ".".join(parts[2:])
    else:
        expr = "model." + path
    return eval(f"lambda: {expr}", {"model": model})


def block_time(model, ids, readers, keep: bool = False) -> tuple[float, float]:
    """(wall, process CPU) seconds of one block; CPU time counts every thread (the forward's, a spinning wait).
    keep: every value is held until the block ends (as `h = ...` does), so each is released read-only when
    the forward moves on; otherwise each is dropped at once."""
    with Timer() as t, model.trace([ids]):
        if keep:
            held = [r() for r in readers]
            del held
        else:
            for r in readers:
                r()
    return t.wall, t.cpu


def measure(model, repeats: int, counts=COUNTS, computed_only: bool = False) -> dict:
    """{access: {"wall": {n: [...]}, "cpu": {n: [...]}}}, blocks of every (access, count) interleaved."""
    ids = [(i * 37 + 5) % 256 for i in range(8)]
    paths = small_paths(model, max(counts), computed_only=computed_only)
    if len(paths) < max(counts):
        raise SystemExit(f"the model has only {len(paths)} small values; need {max(counts)}")
    make = {"full": full_reader, "kept": full_reader, "envoy": envoy_reader}
    readers = {(a, n): [make[a](model, p) for p in paths[:n]] for a in ACCESS for n in counts}
    out = {a: {"wall": {n: [] for n in counts}, "cpu": {n: [] for n in counts}} for a in ACCESS}
    for k in range(repeats + 2):  # two warm-up rounds
        for a in ACCESS:
            for n in counts:
                w, c = block_time(model, ids, readers[(a, n)], keep=a == "kept")
                if k >= 2:
                    out[a]["wall"][n].append(w)
                    out[a]["cpu"][n].append(c)
    return out


def per_value(series: dict, n: int, pick=min) -> float:
    """(pick(t(N)) - pick(t(0))) / N in microseconds."""
    return (pick(series[n]) - pick(series[0])) / n * 1e6


def paired(series: dict, n: int) -> float:
    """The median over repeats of (t(N) - t(0)) / N in microseconds, each N-value block against the empty
    block run just before it: the typical cost, steadier than least against least on a machine whose
    blocks jitter by a millisecond (the two least blocks may come from different moments)."""
    return median(a - b for a, b in zip(series[n], series[0])) / n * 1e6


def child(a) -> int:
    """One measurement in this process (the build on sys.path), printed as JSON."""
    os.environ["MIXLENS_OUTPUT"] = a.output
    import mixlens

    model = mixlens.StandardizedTransformer(a.model_path)
    res = measure(model, a.repeats, computed_only=a.values == "computed")
    json.dump({"mixlens": mixlens.__file__, "output": model.output_format, "res": res}, sys.stdout)
    return 0


def run_child(a, output: str, pythonpath: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, __file__, "--child", "--output", output, "--repeats", str(a.repeats),
           "--model-path", a.model_path, "--threads", str(a.threads), "--values", a.values]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    r = json.loads(p.stdout)
    # JSON keys are strings
    r["res"] = {acc: {k: {int(n): v for n, v in d.items()} for k, d in x.items()} for acc, x in r["res"].items()}
    return r


def single_table(a, model_name: str, res: dict, fmt: str, where: str, load, load_after) -> str:
    rows = ["| access | values read | block wall (ms, fastest) | per value wall, paired median (us) "
            "| per value wall, fastest (us) | block CPU (ms, least) | per value CPU, paired median (us) |",
            "|---|---|---|---|---|---|---|"]
    for acc in ACCESS:
        wall, cpu = res[acc]["wall"], res[acc]["cpu"]
        for n in COUNTS:
            pm = "-" if n == 0 else f"{paired(wall, n):.1f}"
            pw = "-" if n == 0 else f"{per_value(wall, n):.1f}"
            pc = "-" if n == 0 else f"{paired(cpu, n):.1f}"
            rows.append(f"| {acc} | {n} | {min(wall[n]) * 1e3:.3f} | {pm} | {pw} | {min(cpu[n]) * 1e3:.3f} | {pc} |")
    return "\n".join([
        f"Model: {model_name}, 8-token prompt, {a.threads} threads, {a.repeats} repeats (counts interleaved block by "
        f"block), values as {fmt}, value set `{a.values}`, mixlens {where}. Load average {load[0]:.2f} before, {load_after[0]:.2f} after, "
        f"{os.cpu_count()} cores.",
        "",
        *rows,
    ])


BEGIN, END = "<!-- bench_handoff.py: latest run (rewritten by the script) -->", "<!-- end of the latest run -->"


def write_section(path: Path, text: str) -> None:
    """Puts `text` between the BEGIN / END markers of `path` (at its top when they are absent), keeping the
    rest: the file also holds each round's hand-written notes."""
    block = f"{BEGIN}\n{text.rstrip()}\n{END}\n"
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + block + "\n" + rest.split(END, 1)[1].lstrip("\n")
    else:
        new = block + ("\n" + old if old else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: a tiny 24-layer Mamba-2 built under build/")
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", choices=("auto", "torch", "numpy"), default=None,
                    help="value type read (MIXLENS_OUTPUT; default: $MIXLENS_OUTPUT, else auto = torch when installed)")
    ap.add_argument("--values", choices=("all", "computed"), default="all",
                    help="all: the first small values in forward order (9 of the 100 are `states` stacks); computed: "
                         "without `states`, whose read adds a per-token state pass (compute, not hand-off)")
    ap.add_argument("--ab", default=None, metavar="DIR", help="A/B: DIR holds the other build's mixlens package")
    ap.add_argument("--rounds", type=int, default=3, help="--ab: rounds (each: base and this, numpy and torch)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "handoff.md"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    os.environ["MIXLENS_NUM_THREADS"] = str(a.threads)
    a.model_path = a.model_path or a.model or str(tiny_model(REPO / "build" / "bench-handoff-mamba2-24l"))
    if a.child:
        return child(a)
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores", flush=True)
    name = Path(a.model_path).name
    if not a.ab:
        a.output = a.output or os.environ.get("MIXLENS_OUTPUT", "auto")
        r = run_child(a, a.output, None)
        text = "\n".join(["## Python hand-off: values read in one `with model.trace(...)` block", "",
                          single_table(a, name, r["res"], r["output"], r["mixlens"], load, os.getloadavg()), ""])
        print(text)
        write_section(Path(a.out), text)
        return 0
    outputs = [a.output] if a.output else ["numpy", "torch"]
    runs = []  # (round, output, label, result)
    for k in range(a.rounds):
        for output in outputs:
            for label, pp in (("base", a.ab), ("this", None)):
                r = run_child(a, output, pp)
                runs.append((k, output, label, r))
                w = r["res"]["full"]["wall"]
                print(f"round {k} {output:5s} {label}: full per value wall, paired median "
                      + ", ".join(f"N={n} {paired(w, n):.2f}" for n in COUNTS[1:]) + " us", flush=True)
    load_after = os.getloadavg()
    lines = ["| output | access | build | per value wall, N=1 (us) | N=10 | N=100 | N=100, each round "
             "| per value CPU, N=100 | block wall N=0 (ms, median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for output in outputs:
        for acc in ACCESS:
            for label in ("base", "this"):
                rs = [r for (_, o, lab, r) in runs if o == output and lab == label]
                per = {n: median(paired(r["res"][acc]["wall"], n) for r in rs) for n in COUNTS[1:]}
                each = ", ".join(f"{paired(r['res'][acc]['wall'], 100):.2f}" for r in rs)
                cpu = median(paired(r["res"][acc]["cpu"], 100) for r in rs)
                zero = median(median(r["res"][acc]["wall"][0]) for r in rs) * 1e3
                lines.append(f"| {output} | {acc} | {label} | {per[1]:.2f} | {per[10]:.2f} | {per[100]:.2f} | {each} "
                             f"| {cpu:.2f} | {zero:.3f} |")
    where = {lab: r["mixlens"] for (_, _, lab, r) in runs}
    text = "\n".join([
        "## Python hand-off: values read in one `with model.trace(...)` block (A/B)",
        "",
        f"A/B, {a.rounds} rounds, each round base then this build, numpy then torch output; model {name}, 8-token "
        f"prompt, value set `{a.values}`, {a.threads} threads, {a.repeats} repeats per run (access kinds and counts interleaved block by "
        f"block). base = {where.get('base')}, this = {where.get('this')}. Load average {load[0]:.2f} before, "
        f"{load_after[0]:.2f} after, {os.cpu_count()} cores.",
        "Per value = the median over repeats of (t(N) - t(0)) / N, each N-value block paired with the empty block "
        "run just before it (wall time; CPU: process CPU time, every thread); the median over the rounds. `full`: `model.layers[i].linear_attn.x` looked up in the block, each value dropped; `kept`: "
        "the same, every value held to the end of the block (released read-only as the forward moves on); "
        "`envoy`: through a `model.layers[i].linear_attn` made before the block.",
        "",
        *lines,
        "",
    ])
    print(text)
    write_section(Path(a.out), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
