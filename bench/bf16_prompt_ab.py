"""mamba2-130m prompt cost per weight dtype, A/B against a base build and llama.cpp, interleaved.

For a shared machine: every cell is the process CPU time (all threads; our pool spins briefly
between ops, which counts, as do ggml's spinning barriers) and the wall time of one prompt call,
median over calls, and the cells alternate build by build and dtype by dtype within each round,
with llama-bench (F32 and BF16 GGUFs, CPU time of the child from getrusage) in the same rounds.
With --threads 1 neither side spins: the CPU times compare the work done, whatever the load. The load average is printed at
the start and end.

    python bench/bf16_prompt_ab.py --model build/mamba2-130m-layout-4fcda331eb61 \
        --build new= --build base=/tmp/base-mixlens-parent --threads 2 --rounds 3 \
        --llama ~/.cache/mixlens/llama.cpp-0c1e57098
(`--build LABEL=DIR`: DIR is put first on PYTHONPATH, so DIR/mixlens is imported; empty: the
installed one.)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from mixlens_dev import timing

HERE = Path(__file__).resolve().parent


def load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def worker(a) -> None:
    import numpy as np

    import mixlens

    kw = {} if a.dtype == "float32" else {"dtype": a.dtype}
    m = mixlens.StandardizedTransformer(a.model, **kw)
    vocab = min(50000, m.info["vocab_size"])
    out = {}
    for n in a.prompts:
        ids = np.random.default_rng(n).integers(3, vocab, size=n).tolist()
        m.run([ids], logits="last")  # warm-up: pages, pools, arena
        runs = timing.repeat(lambda: m.run([ids], logits="last"), a.calls)
        out[n] = {"cpu": timing.median(timing.cpus(runs)), "wall": timing.median(timing.walls(runs))}
    print(json.dumps(out))


def run_worker(pp: str, model: str, dtype: str, prompts: list[int], calls: int, threads: int) -> dict:
    env = dict(os.environ, MIXLENS_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS="1")
    if pp:
        env["PYTHONPATH"] = pp + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, __file__, "--worker", "--model", model, "--dtype", dtype,
                        "--prompts", ",".join(map(str, prompts)), "--calls", str(calls)],
                       capture_output=True, text=True, env=env, cwd="/tmp")
    if r.returncode != 0:
        raise SystemExit(r.stderr[-2000:])
    return {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


def run_llama(bench: Path, gguf: Path, prompts: list[int], calls: int, threads: int) -> dict:
    """CPU time per prompt: a run of 1 + `calls` prompts minus a run of 1 (cancels the model load
    and the warm-up); wall time: llama-bench's own average of the longer run."""
    out = {}
    for n in prompts:
        cpu, rows = [], None
        for reps in (1, 1 + calls):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            r = subprocess.run([str(bench), "-m", str(gguf), "-t", str(threads), "-r", str(reps), "-o", "json",
                                "-p", str(n), "-n", "0"], capture_output=True, text=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if r.returncode != 0:
                raise SystemExit(r.stderr[-2000:])
            rows = json.loads(r.stdout)
            cpu.append((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime))
        out[n] = {"cpu": max(cpu[1] - cpu[0], 0.0) / calls, "wall": n / rows[0]["avg_ts"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", default="128,1024")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--build", action="append", default=[], help="LABEL=PYTHONPATH-dir (empty: installed)")
    ap.add_argument("--llama", default="", help="llama.cpp cache dir (bin/llama-bench, gguf/)")
    a = ap.parse_args()
    a.prompts = [int(x) for x in a.prompts.split(",") if x]
    a.model = str(Path(a.model).resolve())
    if a.worker:
        worker(a)
        return 0
    builds = [b.split("=", 1) for b in a.build] or [["installed", ""]]
    cells: list[tuple[str, callable]] = []
    for label, pp in builds:
        for dt in a.dtypes.split(","):
            cells.append((f"mixlens {label} {dt}", lambda pp=pp, dt=dt: run_worker(pp, a.model, dt, a.prompts, a.calls, a.threads)))
    if a.llama:
        cache = Path(a.llama).expanduser()
        bench = cache / "bin" / "llama-bench"
        for g in sorted((cache / "gguf").glob("*mamba2*")):
            if "F32" in g.name.upper() or "BF16" in g.name.upper():
                cells.append((f"llama.cpp {g.stem}", lambda g=g: run_llama(bench, g, a.prompts, a.calls, a.threads)))
    print(f"load at start: {load()}", flush=True)
    res: dict[str, list[dict]] = {c[0]: [] for c in cells}
    for r in range(a.rounds):
        for name, fn in cells:
            res[name].append(fn())
            print(f"round {r} {name}: " + ", ".join(f"p{n} cpu {v['cpu'] * 1e3:.0f} ms wall {v['wall'] * 1e3:.0f} ms"
                                                   for n, v in res[name][-1].items()) + f"  (load {load()})", flush=True)
    print(f"load at end: {load()}")
    print("\n| cell | " + " | ".join(f"p{n} CPU ms (min / med) | p{n} wall ms (min / med)" for n in a.prompts) + " |")
    print("|---|" + "---|---|" * len(a.prompts))
    for name, rows in res.items():
        parts = []
        for n in a.prompts:
            c = [x[n]["cpu"] * 1e3 for x in rows]
            w = [x[n]["wall"] * 1e3 for x in rows]
            parts += [f"{min(c):.0f} / {timing.median(c):.0f}", f"{min(w):.0f} / {timing.median(w):.0f}"]
        print(f"| {name} | " + " | ".join(parts) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
