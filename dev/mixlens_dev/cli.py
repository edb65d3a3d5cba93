"""Running the `mixlens` CLI from the Qwen3.5 tests (the shipped model, the published 0.8B layout,
the VLM layout): locate the binary, run it, read its --out file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def find_cli() -> str:
    """$MIXLENS_CLI, else the newest of the installed and build-tree binaries: several build folders
    coexist (build/q2, build/py, .venv), and the newest one is the one built from the current tree."""
    env = os.environ.get("MIXLENS_CLI")
    if env:
        return env
    cands = [Path(sys.executable).parent / "mixlens", REPO / ".venv" / "bin" / "mixlens",
             REPO / "build" / "q2" / "mixlens", REPO / "build" / "py" / "mixlens", REPO / "build" / "dev" / "mixlens"]
    found = [c for c in cands if c.is_file() and os.access(c, os.X_OK)]
    if not found:
        pytest.fail("the mixlens CLI is not built: cmake -S . -B build/q2 -G Ninja && ninja -C build/q2")
    return str(max(found, key=lambda c: c.stat().st_mtime))


def cli(*args, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([find_cli(), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def run_values(model_dir, ids: list[int], paths: list[str], out: Path) -> dict:
    """`mixlens run --ids` on one prompt, saving `paths`; returns {path: float32 array}."""
    from safetensors.numpy import load_file

    saves = sum((["--save", p] for p in paths), [])
    r = cli("run", "--model", model_dir, "--ids", ",".join(map(str, ids)), *saves, "--out", out)
    assert r.returncode == 0, r.stderr
    return load_file(str(out))
