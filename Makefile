# `make demo` and `make test` create .venv themselves.
# On a machine without torch, the CPU build torch==2.13.0 is installed first, so that
# the unpinned `torch` requirement never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dtgen-installed

.PHONY: demo test test-gpu test-gpu2 bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,serve,video]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.hunyuan_t2i --world-size 4 --plan hybrid --check --report outputs/hunyuan_t2i.json

# The suite in two more workers than there are cores, 4 at most (pytest-xdist), each worker on one
# thread (tests/conftest.py): many tests wait on spawned ranks or killed processes, so a core would
# otherwise idle (on 2 cores, 4 workers ran the cold suite 30-50 s faster than 3).
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, (os.cpu_count() or 1) + 2))")
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25 tests

# On a GPU machine: `make test-gpu` (one GPU), `make test-gpu2` (two GPUs, torchrun + NCCL).
# They use .venv when there is one, else the machine's python3 as it is (GPU images come
# with torch, triton and the rest, and often with no network to install from).
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))

test-gpu:
	$(GPU_PY) -m pytest -q -m "gpu and not multigpu" --durations=0 tests

test-gpu2:
	$(GPU_PY) -m pytest -q -m multigpu --durations=0 tests

# The benchmark suites, one line each (bench/suites.py); run one with `python -m bench SUITE`, their
# steps on a GPU machine with `bash bench/run_gpu.sh SUITE[,SUITE...]`.
bench:
	$(GPU_PY) -m bench --list

clean:
	rm -rf $(VENV) outputs .cache
