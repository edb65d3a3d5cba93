#!/usr/bin/env bash
# Before/after speed of the mamba2-130m layout per weight dtype: prompt of 1,024 tokens (last-position
# logits) and 32 decode steps, best of REPS, "before" and "after" builds alternating run by run.
#   bench/bench_dtype.sh MODEL_DIR BEFORE_LIB_DIR [REPS]
# MODEL_DIR: dev/mixlens_dev/published_layout.py output; BEFORE_LIB_DIR: a build dir holding the old
# libmixlens_core.a (configured from an older checkout); the "after" library is build/py's.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1 before=$2 reps=${3:-3}
src_before=$(cd "$before/.." && pwd)
libs="$(pkg-config --libs openblas libpcre2-8 libutf8proc) -lpthread"
g++ -std=c++20 -O2 -Iinclude bench/bench_dtype.cpp build/py/libmixlens_core.a $libs -o build/bench_dtype_after
g++ -std=c++20 -O2 -I"$src_before/include" -DMIXLENS_BENCH_NO_DTYPE bench/bench_dtype.cpp "$before/libmixlens_core.a" $libs \
    -o build/bench_dtype_before
echo "load average: $(cat /proc/loadavg); threads: ${MIXLENS_NUM_THREADS:-all}; best of $reps"
echo
echo "| build | dtype | prompt 1024 tok/s | decode tok/s |"
echo "|---|---|---|---|"
for round in 1 2; do
  for dtype in float32 bfloat16; do
    out=$(build/bench_dtype_before "$model" "$dtype" "$reps"); [ -n "$out" ] && echo "| before (round $round) $out"
    echo "| after (round $round) $(build/bench_dtype_after "$model" "$dtype" "$reps")"
  done
done
echo
echo "load average at end: $(cat /proc/loadavg)"
