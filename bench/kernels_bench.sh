#!/usr/bin/env bash
# Builds and runs bench/kernels_bench.cpp against build/py's libmixlens_core.a (run `make build`
# first). Optional: SCIPY_OPENBLAS=path/to/libscipy_openblas.so (pip download scipy-openblas32,
# unzip), and oneDNN when libdnnl-dev is installed. Prints a markdown table of GB/s. The bench binary
# itself uses -march=native (only its streaming-read loop: the kernels come from the library).
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/kernels_bench
dnnl=()
if [ -f /usr/include/oneapi/dnnl/dnnl.hpp ]; then dnnl=(-DMIXLENS_BENCH_DNNL -ldnnl); fi
g++ -std=c++20 -O3 -march=native -Iinclude -Isrc bench/kernels_bench.cpp build/py/libmixlens_core.a \
    $(pkg-config --cflags --libs openblas) "${dnnl[@]}" -ldl -lpthread -o "$out"
"$out" "${SCIPY_OPENBLAS:-}"
