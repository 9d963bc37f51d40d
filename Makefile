# `make demo` and `make test` create .venv themselves.
# On a machine without torch, the CPU build torch==2.13.0 is installed first, so that
# the unpinned `torch` requirement never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dtgen-installed

.PHONY: demo test test-gpu bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,tokenizers]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.hunyuan_t2i --world-size 4 --plan hybrid --check --report outputs/hunyuan_t2i.json

test: $(STAMP)
	$(PY) -m pytest -q tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) outputs .cache
