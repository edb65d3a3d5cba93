#!/usr/bin/env bash
# Builds bench/prompt_loop.cpp against build/py's static library (or $1's) into build/prompt_loop.
set -euo pipefail
cd "$(dirname "$0")/.."
lib=${1:-build/py}
g++ -std=c++20 -O2 -Iinclude bench/prompt_loop.cpp "$lib/libmixlens_core.a" \
  $(pkg-config --libs openblas libpcre2-8 libutf8proc) -lpthread -o build/prompt_loop
