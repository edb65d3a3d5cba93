"""Packaging (issue 10 item 5): one version source, current type stubs and py.typed, and the wheel
(scripts/build_wheel.sh: no tests, no -march=native, shared libraries bundled by auditwheel) installed
into a clean venv that then runs the CLI on the shipped model and imports the package from another
directory, without torch or transformers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import mixlens
from mixlens_dev.common import REPO

CMAKE_VERSION = re.search(r"project\(mixlens VERSION ([0-9.]+)", (REPO / "CMakeLists.txt").read_text()).group(1)
# The wheel is packaged from `make build`'s CMake folder (build/py, same sources and flags: nothing to
# compile, so this stays quick on 2 cores); its C++ tests are built there but never installed, so the
# wheel's content is that of a test-free build. MIXLENS_TEST_WHEEL_CLEAN=1 builds it the way
# `make wheel` does instead (build/wheel, MIXLENS_TESTS=OFF: a full compile).
CLEAN = os.environ.get("MIXLENS_TEST_WHEEL_CLEAN") == "1"
WHEEL_BUILD_DIR = REPO / "build" / ("wheel" if CLEAN else "py")


def run(cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def test_version_has_one_source():
    from importlib.metadata import version

    assert mixlens.__version__ == mixlens._core.__version__ == CMAKE_VERSION == version("mixlens")
    cli = Path(sys.executable).parent / "mixlens"
    assert run([cli, "--version"]).stdout.strip() == f"mixlens {CMAKE_VERSION}"
    assert 'dynamic = ["version"]' in (REPO / "pyproject.toml").read_text()


def test_stubs_are_current_and_typed(tmp_path):
    """python/mixlens/_core.pyi is what nanobind's stubgen writes for the built module (`make stubs`
    regenerates it after a binding changes)."""
    committed = REPO / "python" / "mixlens" / "_core.pyi"
    assert (REPO / "python" / "mixlens" / "py.typed").is_file()
    out = tmp_path / "_core.pyi"
    run([sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "mixlens._core", "-o", out], cwd=tmp_path)
    assert out.read_text() == committed.read_text(), "python/mixlens/_core.pyi is stale: run `make stubs`"
    installed = Path(mixlens.__file__).parent
    assert (installed / "_core.pyi").is_file() and (installed / "py.typed").is_file()


def test_pyproject_builds_wheels_without_tests_or_native():
    text = (REPO / "pyproject.toml").read_text()
    assert 'MIXLENS_TESTS = "OFF"' in text and 'MIXLENS_NATIVE = "OFF"' in text
    assert "build-dir" not in text  # scikit-build-core's default: a temporary folder out of the tree


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheelhouse")
    env = dict(os.environ, MIXLENS_WHEEL_BUILD_DIR=str(WHEEL_BUILD_DIR), PY=sys.executable)
    if not CLEAN:
        if not (WHEEL_BUILD_DIR / "CMakeCache.txt").is_file():
            pytest.fail("build/py is missing: run `make build` first")
        env["MIXLENS_WHEEL_PIP_ARGS"] = "-C cmake.define.MIXLENS_TESTS=ON"  # make build's settings
    run(["bash", REPO / "scripts" / "build_wheel.sh", out], cwd=REPO, env=env, timeout=1800)
    wheels = list(out.glob("mixlens-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_is_manylinux_and_self_contained(wheel):
    assert re.search(r"-manylinux_2_\d+_x86_64\.whl$", wheel.name), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    # Bundled by auditwheel: the BLAS, regex and Unicode libraries the core links.
    libs = [n for n in names if n.startswith("mixlens.libs/")]
    for lib in ("libopenblas", "libpcre2-8", "libutf8proc"):
        assert any(lib in n for n in libs), (lib, libs)
    assert "mixlens/models/mamba2-tinystories/model.safetensors" in names
    assert "mixlens/py.typed" in names and "mixlens/_core.pyi" in names
    # The CLI: auditwheel moves the binary to mixlens.scripts/ (its RPATH reaches mixlens.libs/) and
    # installs a launcher as bin/mixlens.
    assert "mixlens.scripts/mixlens" in names and any(n.endswith(".data/scripts/mixlens") for n in names)
    assert not any("mixlens_tests" in n or "gtest" in n for n in names)
    cache = (WHEEL_BUILD_DIR / "CMakeCache.txt").read_text()
    assert "MIXLENS_NATIVE:BOOL=OFF" in cache
    assert ("MIXLENS_TESTS:BOOL=OFF" in cache) == CLEAN


def test_wheel_in_a_clean_venv_runs_the_cli_and_imports_from_elsewhere(wheel, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv])
    py, bindir = venv / "bin" / "python", venv / "bin"
    # numpy from the package mirror (pip's configured index), everything else from the local wheel only.
    deps = tmp_path / "deps"
    import numpy

    run([py, "-m", "pip", "download", "-q", "--no-deps", "-d", deps, f"numpy=={numpy.__version__}"])
    run([py, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheel.parent, "--find-links", deps, "mixlens"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MIXLENS_", "PYTHON", "LD_"))}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert run([bindir / "mixlens", "--version"], cwd=elsewhere, env=env).stdout.strip() == f"mixlens {CMAKE_VERSION}"
    r = run([bindir / "mixlens", "generate", "Once upon a time", "--max-new-tokens", 5, "--greedy"], cwd=elsewhere, env=env)
    assert r.stdout.startswith("Once upon a time") and len(r.stdout.strip()) > len("Once upon a time")
    # The same text as the development build (same model, greedy).
    dev = run([Path(sys.executable).parent / "mixlens", "generate", "Once upon a time", "--max-new-tokens", 5,
               "--greedy"], env=dict(env, MIXLENS_MODEL=str(REPO / "models" / "mamba2-tinystories")))
    assert r.stdout == dev.stdout
    code = (
        "import json, mixlens, numpy\n"
        "m = mixlens.load()\n"
        "with m.trace('Once upon a time'):\n"
        "    b = m.layers[0].linear_attn.betas\n"
        "print(json.dumps({'file': mixlens.__file__, 'path': m.info['path'], 'version': mixlens.__version__,\n"
        "                  'numpy': isinstance(b, numpy.ndarray), 'shape': list(b.shape),\n"
        "                  'default': mixlens.default_model_path()}))\n"
    )
    got = json.loads(run([py, "-c", code], cwd=elsewhere, env=env).stdout)
    assert got["file"].startswith(str(venv)) and got["path"].startswith(str(venv)), got  # not the build tree
    assert got["version"] == CMAKE_VERSION and got["numpy"] and got["shape"][:2] == [1, 4]
    # Neither torch nor transformers came with it.
    r = subprocess.run([py, "-c", "import torch"], capture_output=True, cwd=elsewhere, env=env)
    assert r.returncode != 0
    # Dataset extraction from the wheel: the CLI writes shards the package reads back.
    (elsewhere / "p.txt").write_text("Once upon a time\nThe cat sat\n")
    run([bindir / "mixlens", "extract", "p.txt", "--values", "logits", "--out", "ex"], cwd=elsewhere, env=env)
    n = run([py, "-c", "import mixlens; print(len(mixlens.open_extraction('ex')))"], cwd=elsewhere, env=env)
    assert n.stdout.strip() == "2"
