# flash_cuda developer targets, in a project venv (VENV, default .venv; created if missing):
#   make bench    installs the Python dependencies, builds, runs the benchmark grid
#   make test     installs, builds, runs the test suite (GPU tests skip without a GPU)
# torch is installed into the venv only if it has none, so a VENV that already holds a torch
# keeps it.  Build knobs pass through the environment, e.g.
#   FLASH_CUDA_ARCHS=90 FLASH_CUDA_HDIMS=128 MAX_JOBS=16 make build
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.11.0
REQUIREMENTS = nvidia-cutlass==4.2.0.0 ninja pybind11 setuptools wheel numpy pytest
BENCH_ARGS ?=
OUT ?= bench_out

.PHONY: deps build test test-fast bench clean

$(PY):
	python3 -m venv $(VENV)

deps: $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q $(REQUIREMENTS)

build: deps
	$(PY) -m pip install --no-build-isolation --no-deps -v -e . > build.log 2>&1 || { tail -40 build.log; exit 1; }
	grep -E "^ *flash_cuda: " build.log | sed "s/^ *//" | awk '!seen[$$0]++'

test: build
	$(PY) -m pytest tests -q

test-fast: build
	$(PY) -m pytest tests -q -m "fast or not cuda"

bench: build
	mkdir -p $(OUT)
	$(PY) benchmarks/bench_attn.py --json $(OUT)/bench.json --plot $(OUT)/bench.png $(BENCH_ARGS)

clean:
	rm -rf build csrc/generated flash_cuda/_C*.so *.egg-info build.log
