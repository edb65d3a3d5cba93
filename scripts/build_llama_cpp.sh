#!/usr/bin/env bash
# Build llama.cpp's CPU backend (llama-bench, llama-cli) from a pinned release, for bench/ only:
# llama.cpp is never a dependency of mixlens. The source comes from the llama-cpp-python 0.3.36 sdist
# on PyPI, which vendors llama.cpp at commit 0c1e57098 (its CHANGELOG: "update llama.cpp to
# ggml-org/llama.cpp@0c1e57098"); its convert_hf_to_gguf.py + gguf-py make the GGUFs.
#
# Output (outside the source tree): $LLAMA_CPP_CACHE (default ~/.cache/mixlens/llama.cpp-0c1e57098)
#   src/       the vendored llama.cpp tree (convert_hf_to_gguf.py, gguf-py/)
#   bin/       llama-bench, llama-cli
#   BUILD_OK   written last; its presence means the build is complete
# Exit 0 on success, 3 with a note on stderr when it cannot be built (no compiler, no network to
# the registry, ...): bench/ then skips llama.cpp and says so.
set -euo pipefail

LLAMA_CPP_PY_VERSION=0.3.36
LLAMA_CPP_COMMIT=0c1e57098
CACHE=${LLAMA_CPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mixlens/llama.cpp-$LLAMA_CPP_COMMIT}
JOBS=${JOBS:-$(nproc)}
PY=${PY:-python3}

skip() { echo "build_llama_cpp: SKIPPED: $*" >&2; exit 3; }

if [[ -f "$CACHE/BUILD_OK" ]]; then
  echo "build_llama_cpp: already built in $CACHE"
  exit 0
fi
command -v cmake >/dev/null || skip "cmake not found"
command -v c++ >/dev/null || skip "no C++ compiler"
mkdir -p "$CACHE"
# One build at a time per cache dir: a second caller waits for the first and reuses its result.
if command -v flock >/dev/null && [[ -z "${BUILD_LLAMA_CPP_LOCKED:-}" ]]; then
  export BUILD_LLAMA_CPP_LOCKED=1
  exec flock "$CACHE/.lock" "$0" "$@"
fi
if [[ -f "$CACHE/BUILD_OK" ]]; then
  echo "build_llama_cpp: already built in $CACHE"
  exit 0
fi

if [[ ! -f "$CACHE/src/convert_hf_to_gguf.py" ]]; then
  dl="$CACHE/download"
  mkdir -p "$dl"
  # --no-build-isolation: pip only reads the sdist's metadata, with the scikit-build-core we have.
  if ! ls "$dl"/llama_cpp_python-$LLAMA_CPP_PY_VERSION.tar.gz >/dev/null 2>&1; then
    "$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
      "llama-cpp-python==$LLAMA_CPP_PY_VERSION" -d "$dl" \
      || skip "could not download the llama-cpp-python $LLAMA_CPP_PY_VERSION sdist"
  fi
  tar xzf "$dl/llama_cpp_python-$LLAMA_CPP_PY_VERSION.tar.gz" -C "$dl"
  sdist="$dl/llama_cpp_python-$LLAMA_CPP_PY_VERSION"
  grep -q "llama.cpp@$LLAMA_CPP_COMMIT" "$sdist/CHANGELOG.md" \
    || skip "the sdist does not pin llama.cpp@$LLAMA_CPP_COMMIT"
  rm -rf "$CACHE/src"
  mv "$sdist/vendor/llama.cpp" "$CACHE/src"
  rm -rf "$sdist"
fi

# CPU backend only; GGML_NATIVE so llama.cpp gets its best kernels on this CPU (its users' build).
cmake -S "$CACHE/src" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_NUMBER=0 -DLLAMA_BUILD_COMMIT=$LLAMA_CPP_COMMIT >"$CACHE/cmake.log" 2>&1 \
  || { tail -n 30 "$CACHE/cmake.log" >&2; skip "cmake configure failed (log: $CACHE/cmake.log)"; }
cmake --build "$CACHE/build" -j "$JOBS" --target llama-bench >"$CACHE/build.log" 2>&1 \
  || { tail -n 30 "$CACHE/build.log" >&2; skip "build failed (log: $CACHE/build.log)"; }
mkdir -p "$CACHE/bin"
cp "$CACHE/build/bin/llama-bench" "$CACHE/bin/"
echo "$LLAMA_CPP_COMMIT" > "$CACHE/BUILD_OK"
echo "build_llama_cpp: built llama.cpp@$LLAMA_CPP_COMMIT in $CACHE"
