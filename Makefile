# flash_cuda developer targets.  Build knobs pass through the environment, e.g.
#   FLASH_CUDA_ARCHS=90 FLASH_CUDA_HDIMS=128 MAX_JOBS=16 make build
SHELL := /bin/bash
PY ?= python3
BENCH_ARGS ?=
OUT ?= bench_out

.PHONY: build test test-fast test-cpu bench clean

build:
	$(PY) -m pip install --no-build-isolation --no-deps -v -e . > build.log 2>&1 || { tail -40 build.log; exit 1; }
	grep -E "^ *flash_cuda: " build.log | sed "s/^ *//" | awk '!seen[$$0]++'

test:
	$(PY) -m pytest tests -q

test-fast:
	$(PY) -m pytest tests -q -m "fast or not cuda"

test-cpu:
	$(PY) -m pytest tests -q -m "not cuda"

bench:
	mkdir -p $(OUT)
	$(PY) benchmarks/bench_attn.py --json $(OUT)/bench.json --plot $(OUT)/bench.png $(BENCH_ARGS)

clean:
	rm -rf build csrc/generated flash_cuda/_C*.so *.egg-info
