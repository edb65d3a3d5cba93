# Two commands for a fresh machine (see README.md):
#   make demo   install dependencies, build, run the shipped model
#   make test   build and run every test (C++ ctest + pytest)
VENV   := .venv
PY     := $(VENV)/bin/python
JOBS   ?= $(shell nproc)
PROMPT ?= Once upon a time, there was a little

.PHONY: demo test setup build bench clean docs

setup: $(VENV)/.setup-done
$(VENV)/.setup-done: scripts/setup.sh requirements-dev.txt
	bash scripts/setup.sh
	touch $@

# One CMake build (build/py) serves the Python package, the native CLI and the C++ tests.
build: setup
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PY) -m pip install -q --no-build-isolation --no-deps .

demo: build
	$(VENV)/bin/mixlens generate "$(PROMPT)" --max-new-tokens 60 --greedy

test: build
	ctest --test-dir build/py --output-on-failure -j $(JOBS)
	$(PY) -m pytest -q tests/python

# Speed vs transformers, measured in the same run (not tests); tables land in bench/results/.
bench: build
	$(PY) bench/bench_mamba2.py
	$(PY) bench/bench_mamba.py
	$(PY) bench/bench_qwen3_5.py

# API reference generated from the docstrings (pdoc), into build/docs.
docs: build
	$(PY) -m pdoc mixlens mixlens.interventions -o build/docs

clean:
	rm -rf build
