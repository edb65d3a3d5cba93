"""A/B timing of one mixlens build against another on the SSM prompt paths (bench/results/ssm_prompt.md).

usage: python bench/ssm_prompt_ab.py PKGDIR FAMILY TOKENS REPEATS [plain|one|all|pair]
PKGDIR: a folder holding a `mixlens` package (e.g. a saved copy of main's site-packages/mixlens, or
this build's site-packages); FAMILY mamba or mamba2 (the random-weight published layouts under
build/, made by bench/harness.py's checkpoints()). Prints wall and process CPU seconds per run
(CPU: all threads, the steadier measure on a shared machine). Run two builds interleaved.
Variants: plain forward (logits of the last position), one = also read layer 12's `states` in a
trace and reduce it to its norm, all = every layer's, pair = plain and one alternating.
"""
import os, sys
pkg, fam, T, R = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
variant = sys.argv[5] if len(sys.argv) > 5 else "plain"
if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != pkg:  # import PKGDIR's mixlens: rerun with it first
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pkg] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)
import numpy as np, mixlens
from mixlens_dev.timing import Timer
assert mixlens.__file__.startswith(pkg), mixlens.__file__
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
paths = {"mamba": str(next((REPO / "build" / "published").glob("mamba-130m-layout-*"))),
         "mamba2": str(next((REPO / "build").glob("mamba2-130m-layout-*")))}
ml = mixlens.StandardizedTransformer(paths[fam])
ids = np.random.default_rng(T).integers(3, 50000, size=T).tolist()
mid = 12
def plain(): ml.run([ids], logits="last")
def one():
    with ml.trace([ids], logits="last"):
        s = ml.layers[mid].linear_attn.states
        float(s.norm()) if hasattr(s, "norm") else float(np.linalg.norm(s)); del s
def allst():
    with ml.trace([ids], logits="last"):
        for i in range(24):
            s = ml.layers[i].linear_attn.states
            float(s.norm()) if hasattr(s, "norm") else float(np.linalg.norm(s)); del s
fns = {"plain": [plain], "one": [one], "all": [allst], "pair": [plain, one]}[variant]
names = {plain: "plain", one: "one", allst: "all"}
for fn in fns: fn()
for _ in range(R):
    for fn in fns:
        with Timer() as t:
            fn()
        print(f"{names[fn]} wall {t.wall:.3f} cpu {t.cpu:.3f}", flush=True)
