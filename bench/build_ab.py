#!/usr/bin/env python
"""Prompt and decode speed of two builds of mixlens (e.g. a commit before a change and after),
A/B interleaved in one run, on the harness layouts.

    .venv/bin/python bench/build_ab.py --a SRC_A:BUILD_A --b SRC_B:BUILD_B
        [--models mamba2,mamba,qwen3_5,falcon_h1,nemotron_h,bamba] [--rounds 5] [--prompts 128,1024]
        [--decode 32] [--calls 3] [--threads 2]

SRC is a source tree (its include/), BUILD a CMake build folder of it holding libmixlens_core.a
(e.g. `git worktree add /tmp/a COMMIT && cmake -S /tmp/a -B /tmp/a-build -DCMAKE_BUILD_TYPE=Release
-DMIXLENS_TESTS=OFF && cmake --build /tmp/a-build --target mixlens_core`). bench/speed_probe.cpp is
compiled against each; it loads the checkpoint once and times, in-process, `calls` prompt calls per
length (last-position logits) and a decode of --decode greedy tokens (generate(1 + n) less
generate(1)), printing medians. Every round runs every (model, build) once, the build order
alternating between rounds. Reported per (model, metric): tok/s by wall and by process-CPU time,
median over rounds with ± half the spread (max - min) / median, and B/A. Checkpoints: random
weights at the published configs (bench/harness.py `checkpoints`). Prints the load average before
and after. Not a test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from mixlens_dev.timing import median

REPO = Path(__file__).resolve().parents[1]


def compile_probe(src: Path, build: Path, out: Path) -> None:
    subprocess.run(["c++", "-O3", "-DNDEBUG", "-std=c++20", f"-I{src / 'include'}", f"-I{REPO / 'bench'}",
                    str(REPO / "bench" / "speed_probe.cpp"), "-o", str(out), str(build / "libmixlens_core.a"),
                    "-lpcre2-8", "-lutf8proc", "-L/usr/lib/x86_64-linux-gnu/openblas-pthread",
                    "-Wl,-rpath,/usr/lib/x86_64-linux-gnu/openblas-pthread", "-lopenblas", "-pthread"], check=True)


def probe(exe: Path, model: str, prompts: str, decode: int, calls: int, threads: int) -> dict[str, tuple[int, float, float]]:
    env = dict(os.environ, MIXLENS_NUM_THREADS=str(threads))
    out = subprocess.run([str(exe), model, prompts, str(decode), str(calls)], check=True, env=env,
                         capture_output=True, text=True).stdout
    got = {}
    for line in out.splitlines():
        name, n, wall, cpu = line.split()
        got[name] = (int(n), float(wall), float(cpu))
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="SRC:BUILD of the baseline")
    ap.add_argument("--b", required=True, help="SRC:BUILD of the candidate")
    ap.add_argument("--models", default="mamba2,mamba,qwen3_5")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", default="128,1024")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "bench"))
    import harness

    builds = {}
    for k, spec in (("A", a.a), ("B", a.b)):
        src, build = (Path(p) for p in spec.split(":"))
        exe = build / "speed_probe"
        compile_probe(src, build, exe)
        builds[k] = exe
    models = {k: str(v) for k, v in harness.checkpoints(a.models.split(",")).items()}
    metrics = [f"prompt{n}" for n in a.prompts.split(",")] + ["decode"]
    rate = {(m, x, k, c): [] for m in models for x in metrics for k in builds for c in ("wall", "cpu")}
    load0 = os.getloadavg()
    print(f"load average before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} on {os.cpu_count()} cores", flush=True)
    for r in range(a.rounds):
        for m, path in models.items():
            for k in (["A", "B"] if r % 2 == 0 else ["B", "A"]):
                for x, (n, wall, cpu) in probe(builds[k], path, a.prompts, a.decode, a.calls, a.threads).items():
                    rate[(m, x, k, "wall")].append(n / wall)
                    rate[(m, x, k, "cpu")].append(n / cpu)
            line = ", ".join(f"{x} {rate[(m, x, 'B', 'wall')][-1] / rate[(m, x, 'A', 'wall')][-1]:.3f}" for x in metrics)
            print(f"round {r} {m} B/A wall: {line}", flush=True)
    load1 = os.getloadavg()
    print()
    print(f"A = {a.a}, B = {a.b}; {a.threads} threads, {a.rounds} rounds (build order alternating), each a process "
          f"timing {a.calls} calls per metric in-process (median); decode = {a.decode} greedy tokens after an 8-token "
          f"prompt. Load average {load0[0]:.2f} / {load0[1]:.2f} / {load0[2]:.2f} before, {load1[0]:.2f} / "
          f"{load1[1]:.2f} / {load1[2]:.2f} after (1 / 5 / 15 min), {os.cpu_count()} cores.")
    print()
    print("| model | metric | A tok/s wall | B tok/s wall | B/A wall | A tok/s CPU | B tok/s CPU | B/A CPU |")
    print("|---|---|---|---|---|---|---|---|")
    for m in models:
        for x in metrics:
            cells = []
            for c in ("wall", "cpu"):
                va, vb = rate[(m, x, "A", c)], rate[(m, x, "B", c)]
                half = [(max(v) - min(v)) / median(v) / 2 for v in (va, vb)]
                cells += [f"{median(va):.1f} ±{half[0]:.0%}", f"{median(vb):.1f} ±{half[1]:.0%}", f"{median(vb) / median(va):.3f}"]
            print(f"| {m} | {x} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
