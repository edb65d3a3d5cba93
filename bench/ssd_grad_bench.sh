#!/usr/bin/env bash
# Builds and runs bench/ssd_grad_bench.cpp against build/py's libmixlens_core.a (run `make build`
# first). Arguments: repeats (default 5), backward chunk length (default 64). Threads:
# MIXLENS_NUM_THREADS. Prints a markdown table (CPU and wall ms per call).
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/ssd_grad_bench
g++ -std=c++20 -O3 -march=native -Iinclude -Isrc bench/ssd_grad_bench.cpp build/py/libmixlens_core.a \
    $(pkg-config --cflags --libs openblas) -ldl -lpthread -o "$out"
"$out" "$@"
