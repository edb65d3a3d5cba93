# Two commands for a fresh machine (see README.md):
#   make demo   install dependencies, build, run the shipped model
#   make test   build and run every test (C++ ctest + pytest), then the sanitizer and fuzz checks
VENV   := .venv
PY     := $(VENV)/bin/python
JOBS   ?= $(shell nproc)
PROMPT ?= Once upon a time, there was a little
# Seconds per fuzz target: the short run inside `make test`, and `make fuzz` for long runs.
FUZZ_SMOKE_TIME ?= 30
FUZZ_TIME       ?= 600
FUZZ_TARGETS    := safetensors json tokenizer_json bpe

# Sanitizer builds use clang (libFuzzer needs it), Debug at -O1, no -march=native (portable reports).
SAN_CMAKE := CC=clang CXX=clang++ cmake -S . -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-g -O1" \
             -DCMAKE_C_FLAGS_DEBUG="-g -O1" -DMIXLENS_NATIVE=OFF
# LeakSanitizer stays on; a UBSan report aborts (-fno-sanitize-recover) so the test fails.
export ASAN_OPTIONS  ?= detect_leaks=1:abort_on_error=1:strict_string_checks=1
export UBSAN_OPTIONS ?= print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS  ?= halt_on_error=1:second_deadlock_stack=1

.PHONY: demo test test-sanitize test-asan test-tsan fuzz-smoke fuzz setup setup-dev build bench bench-families bench-big bench-state-after bench-grad clean docs wheel stubs

# `setup`: what building and `make demo` need (requirements-build.txt: no torch / transformers);
# `setup-dev`: the test dependencies on top (requirements-dev.txt), for make test / docs / bench.
setup: $(VENV)/.setup-done
$(VENV)/.setup-done: scripts/setup.sh requirements-build.txt
	bash scripts/setup.sh
	touch $@
setup-dev: $(VENV)/.setup-dev-done
$(VENV)/.setup-dev-done: scripts/setup.sh requirements-build.txt requirements-dev.txt requirements-sae.txt
	bash scripts/setup.sh --dev
	touch $(VENV)/.setup-done $@

# One CMake build (build/py) serves the Python package, the native CLI and the C++ tests (wheel
# builds use a temporary folder and no tests: pyproject.toml). `make demo` builds it without the C++
# tests (TESTS=OFF: the same library objects, so a later `make test` compiles only the tests).
TESTS ?= ON
build: setup
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PY) -m pip install -q --no-build-isolation --no-deps \
	  -C build-dir=build/py -C cmake.define.MIXLENS_TESTS=$(TESTS) .

# A wheel that works on other Linux machines: built without tests or -march=native, its shared
# libraries (OpenBLAS, PCRE2, utf8proc, ...) bundled by auditwheel; lands in wheelhouse/.
wheel: setup-dev
	bash scripts/build_wheel.sh wheelhouse

# The committed type stubs of the native module (tests/python/test_packaging.py checks they are current).
stubs: build
	$(PY) -m nanobind.stubgen -q -m mixlens._core -o python/mixlens/_core.pyi

demo: setup
	$(MAKE) --no-print-directory build TESTS=OFF
	$(VENV)/bin/mixlens generate "$(PROMPT)" --max-new-tokens 60 --greedy

# SKIP_SANITIZE=1 leaves out the sanitizer / fuzz part for quick local iterations (CI never sets it).
test: setup-dev build
	ctest --test-dir build/py --output-on-failure -j $(JOBS)
	$(PY) -m pytest -q tests/python
	$(if $(SKIP_SANITIZE),@echo "test: sanitizer and fuzz checks skipped (SKIP_SANITIZE)",$(MAKE) --no-print-directory test-sanitize)

# ASan+UBSan build of every C++ test (build/asan), TSan build of the session and allocator tests (build/tsan), and a
# short run of each libFuzzer harness over its seed corpus (tests/fuzz/corpus).
test-sanitize: test-asan test-tsan fuzz-smoke

build/asan/.configured: CMakeLists.txt | setup
	$(SAN_CMAKE) -B build/asan -DMIXLENS_SANITIZE=address,undefined -DMIXLENS_FUZZ=ON
	touch $@

test-asan: build/asan/.configured
	cmake --build build/asan -j $(JOBS)
	ctest --test-dir build/asan --output-on-failure -j $(JOBS)

# OpenBLAS's own threads are not instrumented: one BLAS thread keeps TSan's reports to mixlens code.
test-tsan: setup
	$(SAN_CMAKE) -B build/tsan -DMIXLENS_SANITIZE=thread -DMIXLENS_TEST_GLOB="tests/cpp/test_session*.cpp;tests/cpp/test_arena.cpp"
	cmake --build build/tsan -j $(JOBS) --target mixlens_tests mixlens_cli
	OPENBLAS_NUM_THREADS=1 build/tsan/mixlens_tests

# New inputs go to build/asan/fuzz-<target> (the first corpus folder); the committed seeds stay as they are.
fuzz-smoke: test-asan
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p build/asan/fuzz-$$t && cd build/asan/fuzz-$$t && \
	  echo "fuzz_$$t: $(FUZZ_SMOKE_TIME) s" && \
	  if ! ../fuzz_$$t -max_total_time=$(FUZZ_SMOKE_TIME) -timeout=30 -rss_limit_mb=4096 -artifact_prefix=../fuzz-$$t- \
	      . ../../../tests/fuzz/corpus/$$t > ../fuzz-$$t.log 2>&1; then \
	    tail -n 60 ../fuzz-$$t.log; echo "fuzz_$$t FAILED (log: build/asan/fuzz-$$t.log)"; exit 1; \
	  fi; tail -n 2 ../fuzz-$$t.log; \
	  cd ../../..; \
	done

fuzz: build/asan/.configured
	cmake --build build/asan -j $(JOBS) $(addprefix --target fuzz_,$(FUZZ_TARGETS))
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p build/asan/fuzz-$$t && cd build/asan/fuzz-$$t && \
	  ../fuzz_$$t -max_total_time=$(FUZZ_TIME) -timeout=30 -rss_limit_mb=4096 -jobs=$(JOBS) -workers=$(JOBS) -artifact_prefix=../fuzz-$$t- \
	      . ../../../tests/fuzz/corpus/$$t || exit 1; \
	  cd ../../..; \
	done

# One harness: mixlens vs llama.cpp (built from a pinned release by scripts/build_llama_cpp.sh into
# ~/.cache/mixlens, skipped with a note when it cannot be built) vs transformers, interleaved; table
# and plot in bench/results/harness.{md,png}. BENCH_QUICK=1: the quick mode (< 10 min once cached).
bench: setup-dev build
	$(PY) bench/harness.py $(if $(BENCH_QUICK),--quick)

# Every family (the Mamba-2 hybrids too) against transformers and llama.cpp (where it runs the architecture),
# with each kernel route forced as extra mixlens columns; bench/results/families.md. Per-token states: bench-state-after.
bench-families: setup-dev build
	$(PY) bench/harness.py --models mamba2,mamba,qwen3_5,falcon_h1,nemotron_h,bamba,granitemoehybrid,falcon_mamba,jamba,qwen3_5_moe,olmo_hybrid,zamba2,kimi_linear --routes recurrent,chunked \
	  --no-long $(if $(BENCH_QUICK),--quick) --out bench/results/families.md

# The mixer kinds of issue 25 (LFM2, RWKV-4, RecurrentGemma, MiniMax, xLSTM) on their published layouts;
# bench/results/kinds.md.
bench-kinds: setup-dev build
	$(PY) bench/harness.py --models lfm2,rwkv,recurrent_gemma,minimax,xlstm --routes recurrent,chunked \
	  --no-long $(if $(BENCH_QUICK),--quick) --out bench/results/kinds.md

# 7-9B layouts (issue 27 item 3; opt-in, hours at full size, never part of `make test`): random-weight Qwen3.5-9B,
# Nemotron-H-8B and FalconMamba-7B checkpoints streamed to build/big/ (one model at a time, ~15-19 GB each plus its
# GGUFs), mixlens bf16 / int8 vs llama.cpp BF16 / Q8_0 vs transformers bf16 where it fits; bench/results/big.{md,json}.
# BIG_ARGS passes flags, e.g. BIG_ARGS="--models falcon_mamba_7b --repeats 2"; --layers 2 checks the bench in minutes.
bench-big: setup-dev build
	$(PY) bench/bench_big.py $(BIG_ARGS)

# Per-token state cost (issue 7): states / state_after / set_state_after against a plain forward and
# transformers' token loop, 1,024 tokens, 3 layouts (~30 min on 2 quiet cores). BENCH_ARGS passes flags.
bench-state-after: setup-dev build
	$(PY) bench/bench_state_after.py $(BENCH_ARGS)

# Gradients (issue 12): forward + backward vs forward and vs transformers' autograd, per family;
# bench/results/grad.md (one section a layout). GRAD_FAMILIES picks the families.
GRAD_FAMILIES ?= mamba2 qwen3_5
bench-grad: setup-dev build
	$(PY) bench/bench_grad.py --family $(GRAD_FAMILIES) $(BENCH_ARGS)

# API reference generated from the docstrings (pdoc), into build/docs.
docs: setup-dev build
	$(PY) -m pdoc mixlens mixlens.interventions -o build/docs

clean:
	rm -rf build wheelhouse
