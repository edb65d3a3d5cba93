#!/usr/bin/env bash
# Builds and runs bench/gemm16_bench.cpp (prompt GEMM with bf16 weights; oneDNN where libdnnl-dev
# is installed). Usage: bench/gemm16_bench.sh [reps] [rows,rows...]   (results: bench/results/gemm16.md)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
dnnl=()
if [ -f /usr/include/oneapi/dnnl/dnnl.hpp ]; then dnnl=(-DMIXLENS_BENCH_DNNL -ldnnl); fi
g++ -O2 -std=c++20 -mavx2 -mfma -mf16c -Isrc bench/gemm16_bench.cpp src/ops/gemm16_avx2.cpp \
  -o "$out/gemm16_bench" -lopenblas "${dnnl[@]}"
echo "load: $(cut -d' ' -f1-3 /proc/loadavg); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
OMP_NUM_THREADS=1 DNNL_VERBOSE=0 "$out/gemm16_bench" "${1:-24}" "${2:-128,1024}"
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
rm -rf "$out"
