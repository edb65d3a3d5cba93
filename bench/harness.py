#!/usr/bin/env python
"""mixlens against llama.cpp and transformers, interleaved in one run (`make bench`; issue 9 item 6).

    .venv/bin/python bench/harness.py [--quick] [--threads 2] [--repeats R] [--models mamba2,mamba,qwen3_5]
                                      [--routes recurrent,chunked] [--no-llama] [--no-long] [--out FILE]

What runs
- Checkpoints: the random-weight stand-ins at the published layouts (mixlens_dev/published_layout.py:
  mamba2-130m, mamba-130m, Qwen3.5-0.8B), built once and cached under build/; --models may add the
  Mamba-2 hybrids (mixlens_dev/published_hybrids.py: falcon_h1 = Falcon-H1-0.5B, nemotron_h =
  Nemotron-H-8B's layer shapes in 8 blocks, bamba = Bamba-9B's in 2 layers, granitemoehybrid =
  granite-4.0-h-350m, jamba = a Jamba-tiny-dev class layout, qwen3_5_moe = Qwen3.5-35B-A3B's widths in 2 layers,
  olmo_hybrid = Olmo-Hybrid-7B's in 4 layers,
  zamba2 = Zamba2-1.2B, kimi_linear = Kimi-Linear-48B-A3B's widths in 2 layers with 16 of its 256
  experts) and falcon_mamba (falcon-mamba-7b's widths in 2 layers).
- --routes: extra mixlens columns with one kernel route forced on every call (`route_kernels`:
  `recurrent` = the token-by-token scan, `chunked` = the chunked scan even for decode), float32.
  `make bench-families` runs the families with both routes against transformers, and against
  llama.cpp where its converter and runtime take the architecture (elsewhere its columns say why not).
- llama.cpp: scripts/build_llama_cpp.sh builds its CPU backend from a pinned release (the
  llama-cpp-python 0.3.36 sdist, llama.cpp@0c1e57098) into a cache dir outside the tree; the GGUFs
  come from that release's own convert_hf_to_gguf.py (with its gguf-py) at F32 and BF16, cached
  next to it. When it cannot be built or a model cannot be converted, its columns say why and the
  rest still runs.
- mixlens (bench/_workers.py, Python API, logits of the last position) and transformers (same
  worker, float32), each measurement in its own process; llama-bench (-r 1 per round).
- Every round runs every (model, system) once, in a fixed interleaved order; rounds repeat R times.
  The table gives the median over rounds, the spread as (max - min) / median, and each process's
  peak RSS (wait4's ru_maxrss). Threads: --threads (default 2) for all three.
- mamba2-130m prompt of 32,768 tokens (and 4,096 to check time is linear): the mixlens CLI
  (`mixlens generate --ids-file`, chunked prefill) and llama-bench, peak RSS against weights + cache.
- Prints the load first (and warns when the machine is busy); writes bench/results/harness.md and
  bench/results/harness.png (matplotlib).

--quick (`make bench BENCH_QUICK=1`): 2 rounds, decode 16 tokens, everything else the same; meant
to finish in under 10 minutes on a quiet 2-core machine once the GGUFs are cached. Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The environment the user started us with, for every measured child. Modules imported later set
# process-wide defaults for their own torch work (mixlens_dev.published_layout sets
# OMP_WAIT_POLICY=PASSIVE), and a child that inherits them is slowed: passive OpenMP made
# llama-bench's decode 2.1x slower (72 -> 34 tok/s on mamba2-130m F32, 2 threads).
START_ENV = dict(os.environ)

from mixlens_dev import timing  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
LLAMA_COMMIT = "0c1e57098"
CACHE = Path(os.environ.get("LLAMA_CPP_CACHE", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                            / "mixlens" / f"llama.cpp-{LLAMA_COMMIT}"))
GGUF_DIR = CACHE / "gguf"
# Families whose stand-in comes from mixlens_dev/published_hybrids.py (FalconMamba's too: falcon-mamba-7b's
# widths in 2 layers).
HYBRID_LAYOUTS = {"falcon_h1": "falcon_h1_0_5b", "nemotron_h": "nemotron_h_8b_8blocks", "bamba": "bamba_9b_2layers",
                  "falcon_mamba": "falcon_mamba_7b_2layers", "granitemoehybrid": "granite_4_0_h_350m",
                  "jamba": "jamba_tiny_dev_class",
                  "qwen3_5_moe": "qwen3_5_moe_35b_a3b_2layers", "olmo_hybrid": "olmo_hybrid_7b_4layers",
                  "zamba2": "zamba2_1_2b",
                  "kimi_linear": "kimi_linear_48b_a3b_2layers",
                  # issue 25's mixer kinds (llama.cpp runs LFM2 only: its converter takes RWKV 6 / 7, not RWKV-4)
                  "lfm2": "lfm2_350m", "rwkv": "rwkv_4_169m_pile", "recurrent_gemma": "recurrent_gemma_2b_3layers",
                  "minimax": "minimax_text_01_2layers", "xlstm": "xlstm_7b_2blocks"}
MODELS = ("mamba2", "mamba", "qwen3_5", *HYBRID_LAYOUTS)
ROUTES = ("chunked", "recurrent")


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


def load_line() -> str:
    la = os.getloadavg()
    return f"load average {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f} (1 / 5 / 15 min) on {os.cpu_count()} cores"


def run_measured(cmd: list[str], env=None, timeout: float = 1800, stdin_path: str | None = None) -> tuple[int, str, str, int]:
    """(returncode, stdout, stderr, peak RSS in bytes) of one child process (wait4's ru_maxrss)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        stdin = open(stdin_path, "rb") if stdin_path else subprocess.DEVNULL
        p = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=stdin, env=START_ENV if env is None else env)
        t0 = time.time()
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.time() - t0 > timeout:
                p.kill()
                pid, status, ru = os.wait4(p.pid, 0)
                break
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status)
        if stdin_path:
            stdin.close()
        out.seek(0)
        err.seek(0)
        return p.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"), ru.ru_maxrss * 1024


# ---- checkpoints ------------------------------------------------------------------------------

def checkpoints(names: list[str]) -> dict[str, Path]:
    """Built in a child process: building imports torch and grows a process by gigabytes, and a child
    spawned from a big parent reports the parent's size as its own peak RSS (the kernel carries the
    old image's high-water mark across exec), which spoiled every peak-RSS cell."""
    r = subprocess.run([PY, str(Path(__file__).resolve()), "--checkpoints-only", "--models", ",".join(names)],
                       stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise SystemExit(f"building the checkpoints failed (exit {r.returncode})")
    lines = r.stdout.strip().splitlines()
    print("\n".join(lines[:-1]), flush=True)
    return {n: Path(p) for n, p in json.loads(lines[-1]).items()}


def build_checkpoints(names: list[str]) -> dict[str, Path]:
    from mixlens_dev import published_layout as mpl
    from mixlens_dev.published_layout import cached_layout

    out = {}
    for n in names:
        log(f"checkpoint {n}: building / finding the published layout (first time: minutes)")
        if n == "mamba2":
            out[n] = cached_layout()
        elif n == "mamba":
            out[n] = mpl.cached_mamba1_130m(REPO / "build" / "published")
        elif n == "qwen3_5":
            out[n] = mpl.cached_qwen3_5_0_8b(REPO / "build" / "published")
        elif n in HYBRID_LAYOUTS:
            from mixlens_dev import published_hybrids as make_published_hybrids

            out[n] = make_published_hybrids.cached(HYBRID_LAYOUTS[n])
        else:
            raise SystemExit(f"unknown model {n} ({', '.join(MODELS)})")
    return out


def weight_bytes(ckpt: Path) -> int:
    """float32 bytes of the text model's weights (what mixlens holds), from the safetensors headers."""
    import struct

    total = 0
    for f in ckpt.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k == "__metadata__" or "visual" in k or "mtp" in k:
                continue
            numel = 1
            for d in v["shape"]:
                numel *= d
            total += 4 * numel
    return total


# ---- llama.cpp --------------------------------------------------------------------------------

def build_llama() -> tuple[Path | None, str]:
    log("llama.cpp: scripts/build_llama_cpp.sh (cached after the first build; the first takes long on 2 cores)")
    env = dict(os.environ, PY=PY)
    r = subprocess.run(["bash", str(REPO / "scripts" / "build_llama_cpp.sh")], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        note = (r.stderr.strip().splitlines() or ["unknown reason"])[-1]
        log(f"llama.cpp SKIPPED: {note}")
        return None, note
    return CACHE / "bin" / "llama-bench", ""


# Converters that read a Llama-style vocabulary (a byte-fallback BPE tokenizer.json of exactly
# vocab_size entries) rather than a GPT-2-style one.
LLAMA_VOCAB = {"jamba"}


def synth_llama_vocab(dst: Path, vocab_size: int) -> None:
    """A byte-fallback BPE tokenizer.json of vocab_size tokens (specials, the 256 byte tokens, filler
    pieces; no merges): the random-weight layouts ship none, and llama-bench runs random token ids, so
    only the vocabulary's size matters to the timing."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({f"\u2581t{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def gguf_source(name: str, ckpt: Path) -> Path:
    """The folder convert_hf_to_gguf.py reads: the checkpoint, plus a tokenizer where it has none.
    The random layouts ship no tokenizer; the converters need one whose ids fit the vocabulary:
    Qwen3's (151,669 entries, padded to the vocabulary by the converter) where it fits, else
    GPT-NeoX-20B's (50,280), or a synthetic Llama-style one for the converters in LLAMA_VOCAB."""
    if (ckpt / "tokenizer.json").exists():
        return ckpt
    cfg = json.loads((ckpt / "config.json").read_text())
    vocab_size = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or 0)
    if name in LLAMA_VOCAB:
        kind, cands = "llama", []
    else:
        kind, cands = "", []
        for tname, size in (("qwen3", 151669), ("gpt-neox-20b", 50280)):
            if size <= vocab_size:
                kind = tname
                cands = [REPO.parent / "shared" / "data" / "tokenizers" / tname,
                         REPO / "tests" / "fixtures" / "tokenizer" / tname]
                break
    src = GGUF_DIR / f"src-{name}-{ckpt.name}-{kind or 'none'}"
    src.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():
        if f.is_file() and not (src / f.name).exists():
            os.symlink(f, src / f.name)
    if name == "granitemoehybrid":
        # transformers 5.18 saves layer_types as full_ / linear_attention; the published config.json,
        # which llama.cpp's converter reads, spells them attention / mamba.
        cfg["layer_types"] = ["attention" if t == "full_attention" else "mamba" for t in cfg["layer_types"]]
        (src / "config.json").unlink()
        (src / "config.json").write_text(json.dumps(cfg, indent=2))
    if (src / "tokenizer.json").exists():
        return src
    if kind == "llama":
        synth_llama_vocab(src, vocab_size)
    for cand in cands:
        if (cand / "tokenizer.json").exists():
            for f in ("tokenizer.json", "tokenizer_config.json"):
                if (cand / f).exists():
                    shutil.copy(cand / f, src / f)
            break
    return src


def convert(name: str, ckpt: Path, outtype: str) -> tuple[Path | None, str]:
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    out = GGUF_DIR / f"{name}-{ckpt.name}-{outtype}.gguf"
    if out.exists():
        return out, ""
    log(f"convert_hf_to_gguf.py {name} --outtype {outtype}")
    env = dict(os.environ, PYTHONPATH=str(CACHE / "src" / "gguf-py"))
    tmp = out.with_suffix(".partial")
    # The random Qwen3.5 layouts have no multi-token-prediction tensors (mixlens does not run MTP).
    extra = ["--no-mtp"] if name in ("qwen3_5", "qwen3_5_moe") else []
    r = subprocess.run([PY, str(CACHE / "src" / "convert_hf_to_gguf.py"), str(gguf_source(name, ckpt)),
                        "--outtype", outtype, "--outfile", str(tmp), *extra], capture_output=True, text=True, env=env)
    if r.returncode != 0 or not tmp.exists():
        note = (r.stderr.strip().splitlines() or ["unknown error"])[-1][:200]
        log(f"conversion of {name} to {outtype} failed: {note}")
        return None, note
    tmp.rename(out)
    return out, ""


def llama_bench(bench: Path, gguf: Path, threads: int, prompts: list[int], decode: int) -> tuple[dict, int]:
    args = [str(bench), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json",
            "-p", ",".join(map(str, prompts)) if prompts else "0", "-n", str(decode)]
    if max(prompts or [0]) > 4096:
        # One cold run, like the mixlens CLI measured next to it (llama-bench's warm-up would run the
        # whole prompt a second time).
        args += ["-b", "2048", "-ub", "512", "--no-warmup"]
    rc, out, err, rss = run_measured(args)
    if rc != 0:
        return {"error": (err.strip().splitlines() or ["llama-bench failed"])[-1][:200]}, rss
    res = {}
    for row in json.loads(out):
        n_p, n_g = row.get("n_prompt", 0), row.get("n_gen", 0)
        key = f"prompt{n_p}" if n_p and not n_g else "decode" if n_g and not n_p else None
        if key:
            res[key] = row["avg_ts"]
    return res, rss


# ---- mixlens / transformers ------------------------------------------------------------------

def worker(system: str, ckpt: Path, threads: int, prompts: list[int], decode: int, dtype: str,
           route: str = "default") -> tuple[dict, int]:
    env = dict(START_ENV, MIXLENS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads))
    cmd = [PY, str(REPO / "bench" / "_workers.py"), system, "--model", str(ckpt), "--threads", str(threads),
           "--prompts", ",".join(map(str, prompts)), "--decode", str(decode), "--dtype", dtype]
    if system == "mixlens":
        cmd += ["--route", route]
    rc, out, err, rss = run_measured(cmd, env=env)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        return {"error": (err.strip().splitlines() or [f"exit {rc}"])[-1][:200]}, rss
    return json.loads(lines[-1]), rss


def mixlens_cli() -> str | None:
    for c in (REPO / ".venv" / "bin" / "mixlens", REPO / "build" / "py" / "mixlens"):
        if c.exists():
            return str(c)
    return shutil.which("mixlens")


def long_prompt(ckpt: Path, bench: Path | None, gguf: Path | None, threads: int, lengths: list[int]) -> list[dict]:
    """mamba2-130m long prompts: mixlens CLI (ids file, chunked prefill) and llama-bench."""
    import numpy as np

    rows = []
    cli = mixlens_cli()
    env = dict(START_ENV, MIXLENS_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    for n in lengths:
        ids = np.random.default_rng(n).integers(3, 5000, size=n)
        with tempfile.NamedTemporaryFile("w", suffix=".ids", delete=False) as f:
            f.write(" ".join(map(str, ids)))
            path = f.name
        row = {"tokens": n}
        if cli:
            with timing.Timer() as t:
                rc, out, err, rss = run_measured([cli, "generate", "--model", str(ckpt), "--ids-file", path,
                                                  "--max-new-tokens", "1"], env=env)
            dt = t.wall
            row["mixlens"] = {"seconds": dt, "rss": rss} if rc == 0 else {"error": err.strip()[-200:]}
        # The same command on a 1-token prompt: load time and the base RSS, subtracted below.
        if bench and gguf:
            res, rss = llama_bench(bench, gguf, threads, [n], 0)
            row["llama.cpp"] = ({"seconds": n / res[f"prompt{n}"], "rss": rss} if f"prompt{n}" in res
                                else {"error": res.get("error", "no result")})
        os.unlink(path)
        rows.append(row)
    if cli:  # load-only baseline: a 1-token generate
        with tempfile.NamedTemporaryFile("w", suffix=".ids", delete=False) as f:
            f.write("5")
            path = f.name
        with timing.Timer() as t:
            rc, _, _, rss = run_measured([cli, "generate", "--model", str(ckpt), "--ids-file", path,
                                          "--max-new-tokens", "1"], env=env)
        base = t.wall
        os.unlink(path)
        for row in rows:
            if "seconds" in row.get("mixlens", {}):
                row["mixlens"]["prefill_s"] = row["mixlens"]["seconds"] - base
        rows.append({"tokens": 1, "mixlens": {"seconds": base, "rss": rss}})
    return rows


# ---- report -----------------------------------------------------------------------------------

def mixlens_has_dtype() -> bool:
    r = subprocess.run([PY, "-c", "import inspect, mixlens; "
                        "print('dtype' in inspect.signature(mixlens.StandardizedTransformer).parameters)"],
                       capture_output=True, text=True)
    return r.stdout.strip() == "True"


def base_of(system: str, systems: list[str]) -> str:
    """The mixlens column a ratio compares with: equal weight dtype where mixlens has it."""
    if ("BF16" in system or "bf16" in system) and "mixlens bf16" in systems:
        return "mixlens bf16"
    if ("Q8_0" in system or "int8" in system) and "mixlens int8" in systems:
        return "mixlens int8"
    return "mixlens f32"


def weight_format(system: str) -> str:
    """The GGUF outtype / mixlens dtype a column's weights are in: f32, bf16 or q8_0 (int8)."""
    if "BF16" in system or system.endswith("bf16"):
        return "bf16"
    if "Q8_0" in system or system.endswith("int8"):
        return "q8_0"
    return "f32"


MIXLENS_DTYPE = {"f32": "float32", "bf16": "bfloat16", "q8_0": "int8"}


def summarize(samples: list[float]) -> tuple[float, float]:
    if not samples:
        return float("nan"), float("nan")
    return timing.median(samples), timing.spread(samples)


def fmt(v: float, spread: float | None = None) -> str:
    if v != v:
        return "-"
    s = f"{v:,.1f}" if v < 1000 else f"{v:,.0f}"
    return s + (f" ±{spread * 50:.0f}%" if spread is not None and spread == spread else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--models", default="mamba2,mamba,qwen3_5", help=f"comma-separated, of {','.join(MODELS)}")
    ap.add_argument("--routes", default="", help=f"extra mixlens f32 columns with a forced kernel route: {','.join(ROUTES)}")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-llama", action="store_true", help="leave llama.cpp out (no build, no GGUFs)")
    ap.add_argument("--no-long", action="store_true", help="skip the 32k mamba2 prompt")
    ap.add_argument("--int8", action="store_true", help="add mixlens int8 and llama.cpp Q8_0 columns (issue 27)")
    ap.add_argument("--decode", type=int, default=None, help="decode tokens per run (default 64; --quick 16)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "harness.md"))
    ap.add_argument("--checkpoints-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.checkpoints_only:  # the child of checkpoints(): build, then print the paths as JSON
        print(json.dumps({n: str(p) for n, p in build_checkpoints([n for n in a.models.split(",") if n]).items()}))
        return 0
    routes = [r for r in a.routes.split(",") if r]
    if set(routes) - set(ROUTES) or set(a.models.split(",")) - set(MODELS) - {""}:
        ap.error(f"--routes takes {','.join(ROUTES)}; --models takes {','.join(MODELS)}")
    repeats = a.repeats or (2 if a.quick else 5)
    # llama.cpp's users time generation over 64+ tokens (llama-bench's default tg is 128).
    decode = a.decode or (16 if a.quick else 64)
    prompts = [128, 1024]
    started = time.time()

    load = load_line()
    log(f"machine: {platform.processor() or platform.machine()}, {load}")
    busy = os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1)
    if busy:
        log("WARNING: the machine is busy; ratios measured now are noisy (run again on a quiet machine)")

    names = [n for n in a.models.split(",") if n]
    ckpts = checkpoints(names)
    bench, llama_note = (None, "left out (--no-llama)") if a.no_llama else build_llama()
    ggufs: dict[tuple[str, str], Path | None] = {}
    gguf_notes: dict[tuple[str, str], str] = {}
    if bench:
        for n in names:
            for t in ("f32", "bf16") + (("q8_0",) if a.int8 else ()):
                ggufs[(n, t)], gguf_notes[(n, t)] = convert(n, ckpts[n], t)

    systems = ["mixlens f32"]
    if mixlens_has_dtype():  # issue 9 item 1 (weights kept in bf16), where this build has it
        systems += ["mixlens bf16"]
    if a.int8:
        systems += ["mixlens int8"]
    systems += [f"mixlens f32 {r}" for r in routes]
    if bench:
        systems += ["llama.cpp F32", "llama.cpp BF16"] + (["llama.cpp Q8_0"] if a.int8 else [])
    if not a.no_transformers:
        systems += ["transformers f32"]
    # samples[(model, system, metric)] -> list; rss[(model, system)] -> max
    samples: dict[tuple[str, str, str], list[float]] = {}
    rss: dict[tuple[str, str], int] = {}
    errors: dict[tuple[str, str], str] = {}
    for r in range(repeats):
        for n in names:
            for s in systems:
                log(f"round {r + 1}/{repeats}: {n} / {s}")
                if s.startswith("mixlens"):
                    route = s.split()[2] if s.startswith("mixlens f32 ") else "default"
                    res, m = worker("mixlens", ckpts[n], a.threads, prompts, decode, MIXLENS_DTYPE[weight_format(s)], route)
                elif s.startswith("transformers"):
                    res, m = worker("transformers", ckpts[n], a.threads, prompts, decode, "float32")
                else:
                    g = ggufs.get((n, weight_format(s)))
                    if g is None:
                        errors[(n, s)] = "GGUF conversion failed: " + gguf_notes.get((n, weight_format(s)), "")
                        continue
                    res, m = llama_bench(bench, g, a.threads, prompts, decode)
                if "error" in res:
                    errors[(n, s)] = res["error"]
                    log(f"  error: {res['error']}")
                    continue
                log("  " + ", ".join(f"{k} {v:,.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items())
                    + f"; peak RSS {m / 2**20:,.0f} MiB")
                rss[(n, s)] = max(rss.get((n, s), 0), m)
                for k, v in res.items():
                    if k.startswith("prompt") or k == "decode":
                        samples.setdefault((n, s, k), []).append(v)

    long_rows = []
    if "mamba2" in names and not a.no_long:
        lengths = [4096, 32768]
        log(f"mamba2 long prompts {lengths}: mixlens CLI (chunked prefill) and llama-bench F32")
        long_rows = long_prompt(ckpts["mamba2"], bench, ggufs.get(("mamba2", "f32")), a.threads, lengths)
        for row in long_rows:
            log(f"  {row}")
    load_end = load_line()

    # ---- table
    metrics = ["decode"] + [f"prompt{p}" for p in prompts]
    others = [s for s in systems if not s.startswith("mixlens")]
    lines = [
        "# mixlens vs llama.cpp vs transformers (`make bench`)",
        "",
        f"Run {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, "
        f"{'quick mode, ' if a.quick else ''}{repeats} interleaved rounds, {a.threads} threads, batch 1, "
        f"decode = {decode} single-token steps after a 16-token prompt, prompt = tokens/s of one call "
        "(logits of the last position). Random weights at the published layouts. Tokens/s: median over rounds, "
        "± half the spread (max - min) / median. Ratios: mixlens / other (> 1: mixlens faster).",
        "",
        f"Load at start: {load}; at end: {load_end}." + (" **Busy machine: other work was running; numbers are "
                                                           "noisy.**" if busy else ""),
        f"llama.cpp: llama.cpp@{LLAMA_COMMIT} (llama-cpp-python 0.3.36 sdist), CPU backend, GGML_NATIVE"
        + (f" — SKIPPED: {llama_note}" if not bench else ""),
        "Every child runs with the environment the harness started with: OMP_WAIT_POLICY "
        + START_ENV.get("OMP_WAIT_POLICY", "unset") + ", OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MIXLENS_NUM_THREADS = --threads"
        " for the mixlens and transformers workers.",
        "",
        "| model | metric | " + " | ".join(f"{s} tok/s" for s in systems) + " |"
        + "".join(f" {base_of(s, systems)} / {s} |" for s in others),
        "|---|---|" + "---|" * (len(systems) + len(others)),
    ]
    ratios_for_plot = []
    for n in names:
        for k in metrics:
            med = {s: summarize(samples.get((n, s, k), [])) for s in systems}
            cells = [fmt(*med[s]) for s in systems]
            ratio_cells = []
            for s in others:
                m, mine = med[s][0], med[base_of(s, systems)][0]
                r = mine / m if m == m and m else float("nan")
                ratio_cells.append("-" if r != r else f"{r:.2f}x")
                ratios_for_plot.append((n, k, f"{base_of(s, systems).split()[1]} / {s}", r))
            lines.append(f"| {n} | {k} | " + " | ".join(cells) + " |" + "".join(f" {c} |" for c in ratio_cells))
    lines += ["", "Peak RSS per process (MiB; the largest over rounds):", "",
              "| model | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(f"{rss[(n, s)] / 2**20:,.0f}" if (n, s) in rss else "-" for s in systems) + " |")
    if errors:
        lines += ["", "Not measured:", ""] + [f"- {n} / {s}: {e}" for (n, s), e in sorted(errors.items())]
    if long_rows:
        wb = weight_bytes(ckpts["mamba2"])
        cache_b = 24 * (128 * 64 * 24 * 4 + 4 * (2 * 128 + 1536) * 4)  # SSM states + conv windows, batch 1
        lines += ["", f"mamba2-130m long prompts (one process each; weights {wb / 2**20:,.0f} MiB float32, cache "
                      f"{cache_b / 2**20:.1f} MiB; target: mixlens peak RSS <= 1.3x weights + cache = "
                      f"{1.3 * (wb + cache_b) / 2**20:,.0f} MiB, time linear):", "",
                  "| tokens | mixlens s (prefill s) | mixlens peak RSS MiB | / (weights + cache) | llama.cpp s | llama.cpp peak RSS MiB |",
                  "|---|---|---|---|---|---|"]
        for row in long_rows:
            ml, lc = row.get("mixlens", {}), row.get("llama.cpp", {})
            lines.append(
                f"| {row['tokens']:,} | "
                + (f"{ml['seconds']:.1f}" + (f" ({ml['prefill_s']:.1f})" if "prefill_s" in ml else "") if "seconds" in ml else ml.get("error", "-"))
                + f" | {ml['rss'] / 2**20:,.0f} | {ml['rss'] / (wb + cache_b):.2f}x" if "rss" in ml else " | - | -")
            lines[-1] += (f" | {lc['seconds']:.1f} | {lc['rss'] / 2**20:,.0f} |" if "seconds" in lc
                          else f" | {lc.get('error', '-')} | - |")
        pre = {r["tokens"]: r["mixlens"].get("prefill_s") for r in long_rows if "prefill_s" in r.get("mixlens", {})}
        if 4096 in pre and 32768 in pre and pre[4096]:
            lines += ["", f"mixlens prefill time 32k / 4k = {pre[32768] / pre[4096]:.2f} (8.00 = linear)."]
    lines += ["", f"Total harness time {time.time() - started:.0f} s.", ""]
    text = "\n".join(lines)
    print(text)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({
        "samples": [[n, s, k, v] for (n, s, k), v in samples.items()], "rss": [[n, s, v] for (n, s), v in rss.items()],
        "errors": [[n, s, e] for (n, s), e in errors.items()], "long": long_rows, "ratios": ratios_for_plot,
        "busy": busy, "load_start": load, "load_end": load_end}, indent=1))
    plot(ratios_for_plot, out.with_suffix(".png"), busy)
    log(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot(ratios, path: Path, busy: bool) -> None:
    """Grouped bars: one group per (model, metric), one bar (colour) per comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = [r for r in ratios if r[3] == r[3]]
    groups = list(dict.fromkeys((n, k) for n, k, _, _ in ratios))
    labels = list(dict.fromkeys(s for _, _, s, _ in ratios))
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(groups) + 2), 4.8))
    width = 0.8 / max(len(labels), 1)
    for j, lab in enumerate(labels):
        xs, ys = [], []
        for i, g in enumerate(groups):
            for n, k, s, r in ratios:
                if (n, k) == g and s == lab:
                    xs.append(i + (j - (len(labels) - 1) / 2) * width)
                    ys.append(r)
        ax.bar(xs, ys, width=width, label=f"mixlens {lab}")
    ax.set_xticks(range(len(groups)), [f"{n}\n{k}" for n, k in groups], fontsize=8)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylabel("mixlens / other (tokens/s)")
    ax.set_title("mixlens speed ratio, > 1: mixlens faster" + (" (busy machine: noisy)" if busy else ""))
    if labels:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
