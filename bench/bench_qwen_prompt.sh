#!/usr/bin/env bash
# Before/after prompt cost of the Qwen3.5-0.8B layout (issue 9): f32 and bf16 weights, 128 and
# 1,024 tokens, process CPU seconds per forward (the steady measure on a shared machine) plus wall
# seconds and peak RSS, "before" and "after" builds alternating run by run.
#   bench/bench_qwen_prompt.sh MODEL_DIR BEFORE_LIB_DIR [REPS] [ROUNDS]
# MODEL_DIR: bench/harness.py's checkpoint (mixlens_dev.published_layout.cached_qwen3_5_0_8b);
# BEFORE_LIB_DIR: a build dir holding the old libmixlens_core.a (and ../include of its checkout);
# the "after" library is build/py's.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1 before=$2 reps=${3:-2} rounds=${4:-2}
src_before=$(cd "$before/../.." && pwd)
libs="$(pkg-config --libs openblas libpcre2-8 libutf8proc) -lpthread"
g++ -std=c++20 -O2 -Iinclude bench/bench_qwen_prompt.cpp build/py/libmixlens_core.a $libs -o build/bench_qwen_prompt_after
g++ -std=c++20 -O2 -I"$src_before/include" bench/bench_qwen_prompt.cpp "$before/libmixlens_core.a" $libs \
    -o build/bench_qwen_prompt_before
export MIXLENS_NUM_THREADS=${MIXLENS_NUM_THREADS:-2}
echo "load average: $(cat /proc/loadavg); threads: $MIXLENS_NUM_THREADS; $reps timed forwards per run after a warm-up"
for round in $(seq "$rounds"); do
  for dtype in float32 bfloat16; do
    for tokens in 128 1024; do
      for build in before after; do
        echo "round $round | $build | $dtype | $(build/bench_qwen_prompt_$build "$model" "$dtype" "$tokens" "$reps")"
      done
    done
  done
done
echo "load average at end: $(cat /proc/loadavg)"
