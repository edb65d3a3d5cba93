"""The benchmark harness's own logic (bench/harness.py, scripts/build_llama_cpp.sh), without running a
benchmark: the llama.cpp build is skipped with a clear note when it cannot be built, and the table's
ratios compare equal weight dtypes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

from mixlens_dev.common import REPO


def _harness():
    spec = importlib.util.spec_from_file_location("harness", REPO / "bench" / "harness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_llama_build_is_skipped_with_a_note_without_a_toolchain(tmp_path):
    # A PATH with bash and coreutils only: no cmake, no compiler.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "mkdir", "ls", "cat", "nproc", "flock"):
        for d in ("/usr/bin", "/bin"):
            if os.path.exists(f"{d}/{tool}"):
                os.symlink(f"{d}/{tool}", bin_dir / tool)
                break
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "LLAMA_CPP_CACHE": str(tmp_path / "cache")}
    r = subprocess.run(["/bin/bash", str(REPO / "scripts" / "build_llama_cpp.sh")], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "SKIPPED" in r.stderr and "cmake not found" in r.stderr


def test_ratios_compare_equal_dtypes_and_the_table_formats():
    h = _harness()
    systems = ["mixlens f32", "mixlens bf16", "llama.cpp F32", "llama.cpp BF16", "transformers f32"]
    assert h.base_of("llama.cpp BF16", systems) == "mixlens bf16"
    assert h.base_of("llama.cpp F32", systems) == "mixlens f32"
    assert h.base_of("transformers f32", systems) == "mixlens f32"
    # Without a mixlens bf16 column the BF16 ratio falls back to float32 mixlens.
    assert h.base_of("llama.cpp BF16", ["mixlens f32", "llama.cpp BF16"]) == "mixlens f32"
    med, spread = h.summarize([10.0, 12.0, 11.0])
    assert med == 11.0 and abs(spread - 2 / 11) < 1e-12
    assert h.fmt(float("nan")) == "-"
    assert h.fmt(1234.5, 0.1) == "1,234 ±5%"


def test_unknown_models_and_routes_are_refused_before_any_work(capsys):
    h = _harness()
    for argv in (["--models", "mamba3"], ["--routes", "fast"]):
        try:
            h.main(argv + ["--no-llama"])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
        assert "--models takes" in capsys.readouterr().err


def test_a_forced_route_reaches_the_mixlens_worker():
    # The worker of a route column forces that kernel route for the model's family (route_kernels).
    r = subprocess.run([str(REPO / ".venv" / "bin" / "python"), str(REPO / "bench" / "_workers.py"), "mixlens",
                        "--model", str(REPO / "tests" / "fixtures" / "mamba2" / "g1_chunks"), "--prompts", "8",
                        "--decode", "2", "--route", "recurrent"], capture_output=True, text=True, timeout=300)
    out = json.loads(r.stdout.splitlines()[-1])
    assert r.returncode == 0 and out["route"] == "recurrent" and out["prompt8"] > 0 and out["decode"] > 0, (r.stdout, r.stderr)
    bad = subprocess.run([str(REPO / ".venv" / "bin" / "python"), str(REPO / "bench" / "_workers.py"), "mixlens",
                          "--model", "x", "--route", "fast"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'fast'" in bad.stderr
