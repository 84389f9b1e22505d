# All set-up lives here: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo bench clean

install: $(STAMP)

# torch is pinned first to the CPU build (a looser request pulls a multi-GB
# CUDA build); pyproject.toml itself only asks for torch>=2.11.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 triton==3.7.1
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

test: install
	TRITON_INTERPRET=1 $(PY) -m pytest tests

demo: install
	$(PY) -m gpusolver demo

bench: install
	$(PY) benchmarks/solver_quality.py

clean:
	rm -rf $(VENV) build *.egg-info
