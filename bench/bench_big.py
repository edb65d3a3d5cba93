#!/usr/bin/env python
"""mixlens on 7-9B layouts against llama.cpp and transformers (`make bench-big`; issue 27 item 3).

    .venv/bin/python bench/bench_big.py [--models qwen3_5_9b,nemotron_h_8b,falcon_mamba_7b] [--repeats 3]
        [--threads N] [--layers N | --layers name=N,...] [--keep] [--no-transformers] [--out bench/results/big.md]

Opt-in and long (hours at full size on 2 cores; never part of `make test`). Per model, one at a time:
1. the layout: mixlens_dev.big_layouts writes a random-weight bfloat16 checkpoint at the published
   config, streamed (cached under build/big/ by a hash of config, seed and writer; --layers N keeps
   the first N layers at full width, for checking the bench itself);
2. llama.cpp's GGUFs from that folder with its own convert_hf_to_gguf.py: --outtype bf16 and
   --outtype q8_0 (build/big/gguf/; deleted after the model unless --keep); llama.cpp itself is built
   by scripts/build_llama_cpp.sh as for `make bench` (bench/harness.py);
3. engines, each measurement in its own child process, all engines once per round, --repeats rounds:
   mixlens bf16 (dtype="auto": the bf16 weights served from the mapped file), mixlens int8
   (dtype="int8", skipped with the reason where this build lacks it), llama.cpp BF16 and Q8_0
   (llama-bench -p 512 -n 64 -r 1: its users' measurement), transformers bf16 where it fits in memory
   and in --transformers-budget-s (projected from an 8-token prompt).

What each number is
- load: wall seconds of a child that loads the model and computes the logits of a 1-token prompt, from
  spawn to exit (interpreter start and imports included for the Python engines; llama-bench -p 1 -n 0
  -r 1 --no-warmup for llama.cpp). Cold: the engine's files are dropped from the page cache
  (posix_fadvise DONTNEED) before its load child, so every load reads from disk and every engine's
  pages come in as its own mapping asks (folio size matters: 2 MiB folios stream ~40% faster than 4 KiB
  pages here; the FileHugePages after each run is recorded). The prompt / decode child that follows
  finds the pages its load child brought in. mixlens' and transformers' in-process constructor time
  is given too.
- peak RSS through prompt + decode: llama-bench's wait4 ru_maxrss (it runs nothing else; this parent
  stays small, so no fork/exec high-water mark leaks in: its own peak is printed), the Python workers'
  VmHWM after the prompt and decode (per process image). mixlens also reports VmHWM after a plain
  1,024-token prompt, against weights + cache (the issue's 1.10x target), and after the states read.
- prompt 512: tokens/s of one call returning the last position's logits, after one warm-up call.
- decode: tokens/s of 64 single-token steps (mixlens: after a 16-token prompt, 2 untimed steps first;
  llama-bench: tg64 after its warm-up token; transformers: generate(65) - generate(1)).
- states: mixlens, one layer's per-token `states` (the middle recurrent layer) read in a trace of a
  1,024-token prompt, seconds, and over the plain 1,024-token prompt.
- decode bandwidth: weight bytes read per decode token (every text weight but the input embedding
  table, plus one row of it; from the safetensors / GGUF headers; mixlens int8: 1 byte per matmul
  weight + a float32 scale per 32) x tokens/s / the measured read bandwidth (numpy reductions over a
  1 GiB array on 1..N threads, best of 5, probed at start and end: see machine_report).
- file pages in 2 MiB folios: /proc/meminfo FileHugePages after the engine's prompt / decode child
  (every bench file was evicted before its load, so this is the engine's own file; int8 weights
  live in anonymous memory and do not count). The smallest over rounds.
Ratios: mixlens / llama.cpp at equal weight format (bf16 / BF16, int8 / Q8_0), > 1: mixlens better
(for load and RSS: llama.cpp's over mixlens', so > 1 is still mixlens better). Medians over rounds,
± half the spread (max - min) / median, as bench/harness.py.

Refusals, with the reason in the table: a model whose layout + GGUFs do not fit on the disk (other
cached big layouts are deleted first), an engine whose expected peak memory exceeds MemAvailable.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

# The environment the user started us with, for every measured child (bench/harness.py: a module's
# OMP_WAIT_POLICY=PASSIVE once leaked into llama-bench and halved its decode).
START_ENV = dict(os.environ)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "dev"))
sys.path.insert(0, str(REPO / "bench"))
import harness  # noqa: E402  (llama.cpp build, run_measured, formatting; imports no torch)

PY = sys.executable
MODELS = ("qwen3_5_9b", "nemotron_h_8b", "falcon_mamba_7b")
BIG = REPO / "build" / "big"
GGUF = BIG / "gguf"
GiB = 2**30
ENGINES = ("mixlens bf16", "mixlens int8", "llama.cpp BF16", "llama.cpp Q8_0", "transformers bf16")
PAIRS = (("mixlens bf16", "llama.cpp BF16"), ("mixlens int8", "llama.cpp Q8_0"))
# Expected peak of transformers' bf16 load over the checkpoint's bytes (measured 1.0-1.1x on the
# --layers runs; 1.2 leaves room) and the working memory every engine gets on top.
HF_FACTOR, SLACK = 1.2, 1 * GiB
# GGUFs whose default llama-bench run crashed: measured with `--repack 0` from then on (path -> why).
NO_REPACK: dict[str, str] = {}


def log(msg: str) -> None:
    harness.log(msg)


def child_env(threads: int) -> dict:
    # PYTHONPATH: this checkout's dev package (mixlens_dev.big_layouts), whatever the venv points at.
    return dict(START_ENV, MIXLENS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                OPENBLAS_NUM_THREADS=str(threads), PYTHONPATH=str(REPO / "dev"))


def why(err: str, rc: int) -> str:
    """The informative lines of a failed child's stderr (llama.cpp's last line is only "failed to load model")."""
    lines = [ln.strip() for ln in err.strip().splitlines() if ln.strip()]
    hits = [ln for ln in lines if any(w in ln.lower() for w in ("error", "failed", "assert", "unknown", "missing", "not supported"))]
    return ("; ".join(dict.fromkeys(hits[-3:])) or (lines[-1] if lines else f"exit {rc}"))[:400]


def run_json(cmd: list[str], env: dict, timeout: float) -> tuple[dict, int, float]:
    """(last JSON line of stdout or {"error"}, peak RSS bytes, wall seconds) of one child."""
    t0 = time.perf_counter()
    rc, out, err, rss = harness.run_measured(cmd, env=env, timeout=timeout)
    wall = time.perf_counter() - t0
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        return {"error": f"exit {rc}: {why(err, rc)}"}, rss, wall
    return json.loads(lines[-1]), rss, wall


# ---- machine ------------------------------------------------------------------------------------

BANDWIDTH_PROBE = r"""
import json, os, time
import numpy as np
from concurrent.futures import ThreadPoolExecutor
a = np.ones(1 << 27)  # 1 GiB of float64, far beyond the caches
best = {}
for threads in sorted({1, os.cpu_count() or 1}):
    parts = np.array_split(a, threads)
    for name, fn in (("f64 sum", np.sum), ("f32 max", lambda p: p.view(np.float32).max()),
                     ("int64 sum", lambda p: p.view(np.int64).sum())):
        with ThreadPoolExecutor(threads) as ex:  # numpy releases the GIL in these reductions
            for _ in range(5):
                t = time.perf_counter()
                list(ex.map(fn, parts))
                gbs = a.nbytes / (time.perf_counter() - t) / 1e9
                best[f"{name}, {threads} thread(s)"] = max(best.get(f"{name}, {threads} thread(s)", 0), gbs)
print(json.dumps(best))
"""


def meminfo() -> dict:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        out[k] = int(v.split()[0]) * 1024
    return out


def evict(files: list[Path]) -> None:
    """Drops the files' pages from the page cache (posix_fadvise DONTNEED: advice, no root needed). It drops
    clean pages only, so a file just written (the layout, a GGUF) is written back first."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bandwidth(threads: int) -> tuple[float, dict]:
    r = subprocess.run([PY, "-c", BANDWIDTH_PROBE], capture_output=True, text=True, env=child_env(threads))
    bw = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-200:]}
    return max((v for v in bw.values() if isinstance(v, float)), default=float("nan")) * 1e9, bw


def machine_report(threads: int) -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    isa = {f: f in flags for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16")}
    best, bw = bandwidth(threads)
    m = meminfo()
    return {"cpu": model, "isa": isa, "cores": os.cpu_count(), "threads": threads, "mem_total": m["MemTotal"],
            "mem_available": m["MemAvailable"], "bandwidth_gbs": bw, "bandwidth": best, "nice": os.nice(0),
            "kernel": platform.release(), "python": platform.python_version()}


# ---- layouts, GGUFs, sizes -------------------------------------------------------------------------

def layout_sizes(name: str, layers: int | None) -> dict:
    cmd = [PY, "-m", "mixlens_dev.big_layouts", "--model", name, "--sizes"] + (["--layers", str(layers)] if layers else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env(1))
    if r.returncode != 0:
        raise SystemExit(f"big_layouts --sizes failed: {r.stderr[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def layout_dir(name: str, layers: int | None, key: str) -> Path:
    return BIG / f"{name}{f'-L{layers}' if layers else ''}-bfloat16-{key}"


def free_disk() -> int:
    BIG.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(BIG).free


def make_room(need: int, keep: Path) -> tuple[bool, str]:
    """Free `need` bytes under build/big by deleting other cached layouts and GGUFs, oldest first."""
    if free_disk() >= need:
        return True, ""
    victims = sorted((p for p in list(BIG.iterdir()) + (list(GGUF.iterdir()) if GGUF.is_dir() else [])
                      if p not in (keep, GGUF)), key=lambda p: p.stat().st_mtime)
    for v in victims:
        log(f"disk: deleting {v} to make room")
        shutil.rmtree(v, ignore_errors=True) if v.is_dir() else v.unlink(missing_ok=True)
        if free_disk() >= need:
            return True, ""
    return False, (f"needs {need / 1e9:.1f} GB free on {BIG} (layout + BF16 and Q8_0 GGUFs + 2 GB), has "
                   f"{free_disk() / 1e9:.1f} GB")


def build_layout(name: str, layers: int | None, threads: int) -> tuple[Path | None, str, dict]:
    cmd = [PY, "-m", "mixlens_dev.big_layouts", "--model", name, "--cached", "--out", str(BIG)]
    cmd += ["--layers", str(layers)] if layers else []
    log(f"{name}: layout ({' '.join(cmd[2:])}; first time: minutes)")
    t0 = time.perf_counter()
    rc, out, err, rss = harness.run_measured(cmd, env=child_env(threads), timeout=6 * 3600)
    if rc != 0:
        return None, why(err, rc), {}
    info = json.loads(out[out.index("{"):])
    info.update(wall_s=round(time.perf_counter() - t0, 1), child_peak_rss=rss)
    return Path(info["out_dir"]), "", info


# llama.cpp@0c1e57098's converter reads the config through transformers' AutoConfig, and transformers 5.18's
# NemotronHConfig carries every MoE field (num_experts_per_tok, ...) even for the dense 8B: the converter then
# writes the MoE architecture (nemotron_h_moe) and llama.cpp fails to load it ("tensor 'blk.1.ssm_in.weight' not
# found"). This runs the converter with config.json read as it is, its own fallback when AutoConfig fails.
CONVERT_FROM_CONFIG_JSON = r"""
import json, os, runpy, sys
from pathlib import Path
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
from conversion.base import ModelBase
ModelBase.load_hparams = staticmethod(lambda dir_model, is_mistral_format=False: json.loads((Path(dir_model) / "config.json").read_text()))
runpy.run_path(sys.argv[0], run_name="__main__")
"""
CONVERT_NOTES = {"nemotron_h": "converted with config.json read as it is (not through transformers 5.18's AutoConfig, "
                               "whose NemotronHConfig carries MoE fields that make llama.cpp's converter write the MoE "
                               "architecture, which then fails to load)"}


def convert(name: str, src: Path, outtype: str) -> tuple[Path | None, str, float]:
    GGUF.mkdir(parents=True, exist_ok=True)
    out = GGUF / f"{src.name}-{outtype}.gguf"
    if out.exists():
        return out, "", 0.0
    tmp = out.with_suffix(".partial")
    # The layouts have no multi-token-prediction tensors (mixlens does not run MTP).
    extra = ["--no-mtp"] if name.startswith("qwen3_5") else []
    cmd = [PY, str(harness.CACHE / "src" / "convert_hf_to_gguf.py"), str(src), "--outtype", outtype,
           "--outfile", str(tmp), *extra]
    if any(name.startswith(k) for k in CONVERT_NOTES):
        cmd[1:1] = ["-c", CONVERT_FROM_CONFIG_JSON]
    log(f"{name}: convert_hf_to_gguf.py --outtype {outtype}")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True,
                       env=dict(START_ENV, PYTHONPATH=str(harness.CACHE / "src" / "gguf-py")))
    if r.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        return None, why(r.stderr, r.returncode), 0.0
    tmp.rename(out)
    return out, "", time.perf_counter() - t0


GGUF_BYTES = r"""
import json, sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
t = {x.name: (int(x.n_bytes), [int(d) for d in x.shape]) for x in r.tensors}
print(json.dumps(t))
"""


def gguf_read_bytes(path: Path) -> tuple[int, int]:
    """(all tensor bytes, bytes a decode step reads: every tensor but token_embd, plus one row of it;
    token_embd whole when the output head is tied to it)."""
    r = subprocess.run([PY, "-c", GGUF_BYTES, str(path)], capture_output=True, text=True,
                       env=dict(START_ENV, PYTHONPATH=str(harness.CACHE / "src" / "gguf-py")))
    t = json.loads(r.stdout.strip().splitlines()[-1])
    total = sum(b for b, _ in t.values())
    emb, shape = t.get("token_embd.weight", (0, [1]))
    if "output.weight" not in t:
        return total, total
    return total, total - emb + emb // max(shape[-1] if len(shape) > 1 else 1, 1)


INT8_BYTES = 1 + 4 / 32  # mixlens int8 (main 2e3969a): int8 codes, a float32 scale per block of 32


def safetensors_read_bytes(folder: Path, int8: bool = False) -> tuple[int, int]:
    """(text weight bytes, bytes a decode step reads) from the safetensors headers: every text tensor
    but the input embedding table, plus one row of it. int8: the 2-D (matmul) weights at INT8_BYTES."""
    size = {"BF16": 2, "F16": 2, "F32": 4, "I8": 1, "U8": 1}
    header = {}
    for f in sorted(folder.glob("*.safetensors")):  # every shard first: the head may sit in another one
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header.update(json.loads(fh.read(n)))
    header.pop("__metadata__", None)
    tied = not any(k.endswith("lm_head.weight") for k in header)
    total = read = 0
    for k, v in header.items():
        if "visual" in k or k.startswith("mtp"):
            continue
        numel = 1
        for d in v["shape"]:
            numel *= d
        per = int(numel * (INT8_BYTES if int8 and len(v["shape"]) == 2 else size[v["dtype"]]))
        total += per
        if "embed" in k and not tied:
            per //= v["shape"][0]  # one row of the input table
        read += per
    return total, read


# ---- measurements ---------------------------------------------------------------------------------

def mixlens_int8_supported() -> tuple[bool, str]:
    """Asks the installed mixlens for dtype="int8" without loading anything (the dtype is checked first)."""
    code = ("import mixlens\ntry:\n    mixlens.StandardizedTransformer('/nonexistent-mixlens-int8-probe', dtype='int8')\n"
            "except Exception as e:\n    print(type(e).__name__ + ': ' + str(e))\n")
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=child_env(1))
    msg = r.stdout.strip()
    if "int8" in msg and "dtype" in msg:
        return False, f"not supported by this build ({msg[:160]})"
    return True, ""


def measure(engine: str, a, ckpt: Path, gguf: dict, load: bool) -> dict:
    env = child_env(a.threads)
    worker = [PY, str(REPO / "bench" / "_big_worker.py")]
    common = ["--model", str(ckpt), "--threads", str(a.threads), "--prompt", str(a.prompt), "--decode", str(a.decode)]
    if engine.startswith("mixlens"):
        cmd = worker + ["mixlens", "--dtype", "int8" if "int8" in engine else "auto", "--states-tokens", str(a.states_tokens)]
    elif engine.startswith("transformers"):
        cmd = worker + ["transformers", "--dtype", "bfloat16", "--budget-s", str(a.transformers_budget_s)]
    else:
        g = gguf[engine]
        lb = [str(harness.CACHE / "bin" / "llama-bench"), "-m", str(g), "-t", str(a.threads), "-r", "1", "-o", "json"]
        lb += ["--repack", "0"] if str(g) in NO_REPACK else []
        if load:
            res, rss, wall = run_json_array(lb + ["-p", "1", "-n", "0", "--no-warmup"], env)
            return dict(res, load_s=wall, load_rss=rss)
        res, rss, wall = run_json_array(lb + ["-p", str(a.prompt), "-n", str(a.decode)], env)
        if res.get("signal") and str(g) not in NO_REPACK:
            # llama.cpp's default repacks weights for this CPU's kernels (AMX on a Xeon); where that run
            # crashes, its users turn repacking off, and so does the bench (the caller re-measures the load).
            NO_REPACK[str(g)] = f"llama-bench's default run crashed ({res['error']}); measured with --repack 0"
            return dict(measure(engine, a, ckpt, gguf, load), repack_off=NO_REPACK[str(g)])
        return dict(res, rss=rss, wall_s=wall)
    cmd += common + (["--load-only"] if load else [])
    res, rss, wall = run_json(cmd, env, timeout=a.timeout)
    return dict(res, load_s=wall, load_rss=rss) if load else dict(res, rss=rss, wall_s=wall)


def run_json_array(cmd: list[str], env: dict) -> tuple[dict, int, float]:
    """llama-bench -o json: its rows as {"prompt": tok/s, "decode": tok/s}."""
    t0 = time.perf_counter()
    rc, out, err, rss = harness.run_measured(cmd, env=env, timeout=6 * 3600)
    wall = time.perf_counter() - t0
    if rc != 0:
        return {"error": why(err, rc), "signal": rc < 0}, rss, wall
    res = {}
    for row in json.loads(out):
        if row.get("n_gen", 0) and not row.get("n_prompt", 0):
            res["decode"] = row["avg_ts"]
        elif row.get("n_prompt", 0) > 1:
            res["prompt"] = row["avg_ts"]
    return res, rss, wall


# ---- report ---------------------------------------------------------------------------------------

def med(xs: list[float]) -> tuple[float, float]:
    return harness.summarize(xs)


def cell(xs: list[float], digits: int = 1) -> str:
    if not xs:
        return "-"
    m, s = med(xs)
    txt = f"{m:,.{digits}f}"
    return txt + (f" ±{s * 50:.0f}%" if len(xs) > 1 and s == s else "")


def peak(s: dict) -> int:
    """Peak RSS through prompt + decode: the Python workers' VmHWM at that point (mixlens goes on to the
    1,024-token prompts), llama-bench's whole-process peak (it runs nothing else)."""
    return max(s.get("hwm_prompt_decode") or s.get("rss") or [0])


def gib(b: float) -> str:
    return f"{b / GiB:,.2f}"


def report(a, started: float, machine: dict, load0: str, load1: str, models: dict, cmdline: str) -> str:
    L = [f"# mixlens on 7-9B layouts vs llama.cpp and transformers (`make bench-big`)", ""]
    scaled = any(m.get("layers_cut") for m in models.values())
    if scaled:
        L += ["**Scaled-down run** (`--layers`): the first layers only, at the published widths. It checks the",
              "bench, not the targets.", ""]
    L += [f"Run {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, {a.repeats} interleaved "
          f"round(s), {a.threads} threads, batch 1. Command: `{cmdline}`.", "",
          "## Machine", "",
          f"- CPU: {machine['cpu']}, {machine['cores']} cores; ISA: "
          + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in machine["isa"].items()),
          f"- Memory: {gib(machine['mem_total'])} GiB, {gib(machine['mem_available'])} GiB available at start; "
          f"kernel {machine['kernel']}, Python {machine['python']}",
          f"- Read bandwidth: **{machine['bandwidth'] / 1e9:.1f} GB/s**, the higher of two probes (start, end) of numpy "
          "reductions (float64 sum, float32 max, int64 sum) over a 1 GiB array split over 1 and all threads, best of 5 "
          "passes each; at start: " + ", ".join(f"{k} {v:.1f}" for k, v in machine["bandwidth_gbs"].items()
                                               if isinstance(v, float)) + f" GB/s; at end best {machine['bandwidth_end'] / 1e9:.1f} GB/s. "
          "A lower bound of what the memory delivers (a C streaming read may see more).",
          f"- Load at start: {load0}; at end: {load1}." + (" **Busy machine: other work was running; the numbers are "
                                                           "noisy.**" if busy(load0) or busy(load1, own=a.threads) else ""),
          f"- Nice value of the bench: {machine['nice']}" + (" (**lowered priority: under contention OpenMP engines such as "
                                                              "llama.cpp lose far more than their share; measure at nice 0 on a "
                                                              "quiet machine**)" if machine["nice"] > 0 else "") + ".",
          f"- This process's own peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB "
          "(children's peaks cannot inherit more than that).",
          f"- llama.cpp: llama.cpp@{harness.LLAMA_COMMIT} CPU backend, GGML_NATIVE (scripts/build_llama_cpp.sh); "
          "children run with the environment the bench started with (OMP_WAIT_POLICY "
          f"{START_ENV.get('OMP_WAIT_POLICY', 'unset')}).", ""]
    for name, m in models.items():
        L += [f"## {name}" + (f" (first {m['layers']} layers)" if m.get("layers_cut") else ""), ""]
        if m.get("refused"):
            L += [f"Not measured: {m['refused']}", ""]
            continue
        sz = m["sizes"]
        L += [f"Layout: `{m['ckpt']}` ({gib(sz['total_bytes'])} GiB bf16, text model {gib(sz['text_bytes'])} GiB; "
              f"written in {m['layout'].get('seconds', 0):.0f} s by a child peaking at "
              f"{m['layout'].get('peak_rss_mib', 0):,} MiB" + (", reused from the cache" if m["layout"].get("reused") else "")
              + "). GGUF: " + ", ".join(f"{k} {gib(v['bytes'])} GiB" + (f" (converted in {v['convert_s']:.0f} s)" if v.get("convert_s") else "")
                                       for k, v in m["gguf"].items()) + ".", ""]
        L += [f"| engine | load to first logits s | peak RSS through prompt + decode GiB | prompt {a.prompt} tok/s | decode ({a.decode}) tok/s | "
              "bytes read / decode token GB | decode bandwidth | file pages in 2 MiB folios GiB |", "|---|---|---|---|---|---|---|---|"]
        for e in m["engines"]:
            s = m["samples"].get(e, {})
            if e in m["errors"] and not s.get("decode"):
                L.append(f"| {e} | not measured: {m['errors'][e]} | | | | | | |")
                continue
            rb = m["read_bytes"].get(e)
            dec = med(s.get("decode", []))[0] if s.get("decode") else float("nan")
            frac = rb * dec / machine["bandwidth"] if rb and dec == dec else float("nan")
            L.append(f"| {e} | {cell(s.get('load_s', []))} | {gib(peak(s)) if peak(s) else '-'} | "
                     f"{cell(s.get('prompt', []))} | {cell(s.get('decode', []), 2)} | "
                     f"{f'{rb / 1e9:.2f}' if rb else '-'} | {f'{frac:.0%}' if frac == frac else '-'} | "
                     f"{gib(min(s['file_huge'])) if s.get('file_huge') else '-'} |")
        ml = [e for e in m["engines"] if e.startswith("mixlens") and m["samples"].get(e, {}).get("plain_s")]
        if ml:
            wc = m["weights_cache"]
            L += ["", f"mixlens at {a.states_tokens:,} tokens: weights (text model, as served) + cache "
                      f"= {gib(wc['mixlens bf16'])} GiB for bf16; one layer's states stack is "
                      f"{gib(sz['state_bytes_per_token'] * a.states_tokens)} GiB.", "",
                  "| engine | constructor s | peak RSS through the plain prompt GiB | / (weights + cache) | plain prompt s | "
                  "states of one layer s | states / plain | peak RSS with the states GiB |",
                  "|---|---|---|---|---|---|---|---|"]
            for e in ml:
                s = m["samples"][e]
                hw = max(s["hwm_states_tokens"])
                pl, st = med(s["plain_s"])[0], med(s["states_s"])[0]
                L.append(f"| {e} | {cell(s['construct_s'])} | {gib(hw)} | {hw / wc[e]:.2f}x | {cell(s['plain_s'])} | "
                         f"{cell(s['states_s'])} | {st / pl:.2f}x | {gib(max(s['hwm_states']))} |")
        ratio_rows = []
        for mine, other in PAIRS:
            a_s, b_s = m["samples"].get(mine, {}), m["samples"].get(other, {})
            if not a_s.get("decode") or not b_s.get("decode"):
                continue
            r = {k: med(a_s[k])[0] / med(b_s[k])[0] for k in ("prompt", "decode") if a_s.get(k) and b_s.get(k)}
            r["load"] = med(b_s["load_s"])[0] / med(a_s["load_s"])[0] if a_s.get("load_s") and b_s.get("load_s") else float("nan")
            r["rss"] = peak(b_s) / peak(a_s) if peak(a_s) and peak(b_s) else float("nan")
            ratio_rows.append(f"| {mine} / {other} | " + " | ".join(f"{r.get(k, float('nan')):.2f}x" for k in ("prompt", "decode", "load", "rss")) + " |")
        if ratio_rows:
            L += ["", f"| ratio (> 1: mixlens better) | prompt {a.prompt} | decode | load (theirs / ours) | peak RSS (theirs / ours) |",
                  "|---|---|---|---|---|"] + ratio_rows
        bad = {e: s for e, s in m["samples"].items() if s.get("logits_ok") and not all(s["logits_ok"])}
        L += ["", "Logits finite and not constant on every measured run: "
              + ("yes" if not bad else "NO: " + ", ".join(bad)) + "."]
        notes = {e: NO_REPACK[g["path"]] for e, g in m["gguf"].items() if e in m["engines"] and g["path"] in NO_REPACK}
        if notes:
            L += ["", "Measured differently from the default:", ""] + [f"- {e}: {msg}" for e, msg in notes.items()]
        if m["errors"]:
            L += ["", "Not measured / errors:", ""] + [f"- {e}: {msg}" for e, msg in m["errors"].items()]
        L += [""]
    L += ["## Commands", "", "```"] + [c for m in models.values() for c in m.get("commands", [])] + ["```", "",
          f"Total bench time {time.time() - started:,.0f} s.", ""]
    return "\n".join(L)


def busy(load: str, own: int = 0) -> bool:
    """Whether a load average line shows other work: at the end, `own` (the bench's threads, whose
    children just ran) is part of the 1-minute figure and is not counted against the machine."""
    return float(load.split()[2]) - own > 0.5 * (os.cpu_count() or 1)


def parse_layers(text: str | None) -> dict:
    if not text:
        return {}
    if text.isdigit():
        return {m: int(text) for m in MODELS}
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--layers", default=None, help="N for every model, or name=N,...: the first N layers only (checks)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--states-tokens", type=int, default=1024)
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {','.join(ENGINES)}")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--transformers-budget-s", type=float, default=1800,
                    help="skip transformers where its prompt + decode would take longer (projected from 8 tokens)")
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per child before it is killed")
    ap.add_argument("--keep", action="store_true", help="keep the GGUFs after each model")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "big.md"))
    a = ap.parse_args(argv)
    names = [n for n in a.models.split(",") if n]
    engines = [e for e in a.engines.split(",") if e and not (a.no_transformers and e.startswith("transformers"))]
    layers = parse_layers(a.layers)
    if set(names) - set(MODELS) or set(engines) - set(ENGINES) or set(layers) - set(MODELS):
        ap.error(f"--models takes {','.join(MODELS)}; --engines {','.join(ENGINES)}")
    cmdline = " ".join([Path(PY).name, *sys.argv]) if argv is None else "bench_big.py " + " ".join(argv)
    started = time.time()
    load0 = harness.load_line()
    log(f"{load0}")
    if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        log("WARNING: the machine is busy; numbers measured now are noisy (run again on a quiet machine)")
    machine = machine_report(a.threads)
    log(f"machine: {machine['cpu']}, {machine['cores']} cores, {gib(machine['mem_total'])} GiB, "
        f"read bandwidth {machine['bandwidth'] / 1e9:.1f} GB/s")
    bench, llama_note = (None, "not asked for") if not any(e.startswith("llama") for e in engines) else harness.build_llama()
    int8_ok, int8_note = mixlens_int8_supported()
    models = {}
    for name in names:
        m = models[name] = {"layers": layers.get(name), "layers_cut": bool(layers.get(name)), "errors": {},
                            "samples": {}, "gguf": {}, "read_bytes": {}, "weights_cache": {}, "commands": []}
        sz = m["sizes"] = layout_sizes(name, layers.get(name))
        ckpt = layout_dir(name, layers.get(name), sz["key"])
        cached = (ckpt / ".complete").is_file()
        want = [e for e in engines if e.startswith("llama")]
        need = (0 if cached else sz["total_bytes"]) + int(sz["text_bytes"] * (1 + 8.5 / 16) * bool(want)) + 2 * GiB
        ok, why = make_room(need, ckpt)
        if not ok:
            m["refused"] = why
            log(f"{name}: REFUSED: {why}")
            continue
        path, err, info = build_layout(name, layers.get(name), a.threads)
        if path is None:
            m["refused"] = f"the layout could not be written: {err}"
            continue
        m["ckpt"], m["layout"] = str(path), dict(info, reused=cached)
        m["commands"].append(f"PYTHONPATH=dev {Path(PY).name} -m mixlens_dev.big_layouts --model {name} --cached --out {BIG}"
                             + (f" --layers {layers[name]}" if layers.get(name) else ""))
        total, read = safetensors_read_bytes(path)
        m["read_bytes"]["mixlens bf16"] = m["read_bytes"]["transformers bf16"] = read
        total8, m["read_bytes"]["mixlens int8"] = safetensors_read_bytes(path, int8=True)
        m["weights_cache"]["mixlens bf16"] = total + cache_bytes(path, a.states_tokens)
        m["weights_cache"]["mixlens int8"] = total8 + cache_bytes(path, a.states_tokens)
        gguf = {}
        for e, outtype in (("llama.cpp BF16", "bf16"), ("llama.cpp Q8_0", "q8_0")):
            if e not in engines:
                continue
            if bench is None:
                m["errors"][e] = f"llama.cpp unavailable: {llama_note}"
                continue
            g, note, secs = convert(name, path, outtype)
            if g is None:
                m["errors"][e] = f"GGUF conversion failed: {note}"
                continue
            gguf[e] = g
            gtotal, gread = gguf_read_bytes(g)
            m["gguf"][e] = {"path": str(g), "bytes": g.stat().st_size, "convert_s": secs}
            m["read_bytes"][e] = gread
            note = next((v for k, v in CONVERT_NOTES.items() if name.startswith(k)), "")
            m["commands"].append(f"{Path(PY).name} convert_hf_to_gguf.py {path} --outtype {outtype} --outfile {g}"
                                 + (" --no-mtp" if name.startswith("qwen3_5") else "") + (f"   # {note}" if note else ""))
        # Memory: refuse what cannot fit (the reason goes in the table).
        avail = meminfo()["MemAvailable"]
        states = sz["state_bytes_per_token"] * a.states_tokens
        expect = {"mixlens bf16": sz["text_bytes"] + states + SLACK, "mixlens int8": sz["text_bytes"] + states + SLACK,
                  "transformers bf16": HF_FACTOR * sz["total_bytes"] + SLACK}
        expect.update({e: m["gguf"][e]["bytes"] + SLACK for e in gguf})
        run = []
        for e in engines:
            if e in m["errors"]:
                continue
            if e == "mixlens int8" and not int8_ok:
                m["errors"][e] = int8_note
                continue
            if expect.get(e, 0) > avail:
                m["errors"][e] = (f"expected peak {gib(expect[e])} GiB > {gib(avail)} GiB available"
                                  + (" (bf16 weights x1.2 + 1 GiB)" if e.startswith("transformers") else ""))
                continue
            run.append(e)
        m["engines"] = [e for e in engines if e in run or e in m["errors"]]
        for e in run:
            if e.startswith("llama"):
                m["commands"].append(f"llama-bench -m {gguf[e].name} -t {a.threads} -r 1 -o json -p {a.prompt} -n {a.decode}"
                                     f"   # load: -p 1 -n 0 -r 1 --no-warmup")
            else:
                eng = "mixlens --dtype " + ("int8" if "int8" in e else "auto") if e.startswith("mixlens") else "transformers --dtype bfloat16"
                m["commands"].append(f"{Path(PY).name} bench/_big_worker.py {eng} --model {path.name} --threads {a.threads} "
                                     f"--prompt {a.prompt} --decode {a.decode}   # load: --load-only")
        for r in range(a.repeats):
            for e in run:
                if e in m["errors"] and not m["samples"].get(e, {}).get("decode"):
                    continue  # failed or refused in an earlier round: not tried again
                s = m["samples"].setdefault(e, {})
                # Each engine starts from disk: its pages come in with its own mapping advice (mixlens asks
                # for 2 MiB folios), not in whatever folios the previous child or the layout writer left.
                # Every engine's files go, so FileHugePages after the run counts this engine's only.
                evict(sorted(path.glob("*.safetensors")) + list(gguf.values()))
                for load in (True, False):
                    log(f"{name} round {r + 1}/{a.repeats}: {e} {'load' if load else 'run'}")
                    res = measure(e, a, path, gguf, load)
                    if not load:
                        res["file_huge"] = meminfo().get("FileHugePages", 0)
                    if "error" in res:
                        m["errors"][e] = res["error"]
                        log(f"  error: {res['error']}")
                        break
                    if res.get("repack_off"):  # this round's load ran with repacking: measure it again without
                        log(f"  {res['repack_off']}")
                        for k in ("load_s", "construct_s", "load_rss"):
                            if s.get(k):
                                s[k].pop()
                        evict(list(gguf.values()))
                        again = measure(e, a, path, gguf, True)
                        if "error" in again:
                            m["errors"][e] = again["error"]
                            break
                        for k in ("load_s", "load_rss"):
                            s.setdefault(k, []).append(again[k])
                    keys = (("load_s", "construct_s", "load_rss") if load else
                            ("prompt", "decode", "rss", "plain_s", "states_s", "hwm_states_tokens", "hwm_states",
                             "hwm_prompt_decode", "file_huge"))
                    for k in keys:
                        if k in res:
                            s.setdefault(k, []).append(res[k])
                    if "logits_ok" in res:
                        s.setdefault("logits_ok", []).append(res["logits_ok"])
                    log("  " + ", ".join(f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in res.items() if k in keys + ("logits_ok",)))
        if not a.keep:
            for g in gguf.values():
                g.unlink(missing_ok=True)
    load1 = harness.load_line()
    # Probed again at the end: the fractions use the higher figure (the lower fraction).
    machine["bandwidth_end"], machine["bandwidth_gbs_end"] = bandwidth(a.threads)
    machine["bandwidth"] = max(machine["bandwidth"], machine["bandwidth_end"])
    text = report(a, started, machine, load0, load1, models, cmdline)
    print(text)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"machine": machine, "load_start": load0, "load_end": load1,
                                                    "models": models, "args": vars(a)}, indent=1, default=str))
    log(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


def cache_bytes(ckpt: Path, tokens: int) -> int:
    """mixlens' cache after `tokens` tokens, batch 1: every recurrent layer's state (float32) and
    conv window, every attention layer's K and V (float32), from config.json."""
    cfg = json.loads((ckpt / "config.json").read_text())
    t = cfg.get("text_config", cfg)
    n = t["num_hidden_layers"]
    if "layer_types" in t:  # Qwen3.5: gated DeltaNet / gated attention
        kinds = ["attn" if k == "full_attention" else "rec" for k in t["layer_types"][:n]]
        key, val = t["linear_num_key_heads"] * t["linear_key_head_dim"], t["linear_num_value_heads"] * t["linear_value_head_dim"]
        rec = t["linear_num_value_heads"] * t["linear_key_head_dim"] * t["linear_value_head_dim"] + (2 * key + val) * (t["linear_conv_kernel_dim"] - 1)
        kv = 2 * t["num_key_value_heads"] * t["head_dim"]
    elif "hybrid_override_pattern" in t:  # Nemotron-H: Mamba-2 / attention / MLP blocks
        kinds = ["rec" if c == "M" else "attn" if c == "*" else "mlp" for c in t["hybrid_override_pattern"][:n]]
        inner = t["mamba_num_heads"] * t["mamba_head_dim"]
        rec = inner * t["ssm_state_size"] + (inner + 2 * t["n_groups"] * t["ssm_state_size"]) * (t["conv_kernel"] - 1)
        kv = 2 * t["num_key_value_heads"] * t["head_dim"]
    else:  # Mamba-1 / FalconMamba
        kinds = ["rec"] * n
        rec = t["intermediate_size"] * (t["state_size"] + t["conv_kernel"] - 1)
        kv = 0
    return 4 * sum(rec if k == "rec" else kv * tokens if k == "attn" else 0 for k in kinds)


if __name__ == "__main__":
    raise SystemExit(main())
