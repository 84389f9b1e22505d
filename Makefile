# All set-up lives here: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo bench gpu-check clean

install: $(STAMP)

# torch is pinned first to the CPU build (a looser request pulls a multi-GB
# CUDA build); pyproject.toml itself only asks for torch>=2.11.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 triton==3.7.1
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# two workers: the interpreted Triton tests are CPU-bound and independent
test: install
	TRITON_INTERPRET=1 $(PY) -m pytest -n 2 tests

# P = 8 simulated ranks in one process, 4 layers of fresh packed-document masks,
# forward and backward checked against dense attention; well under 2 minutes on 2 cores
demo: install
	$(PY) -m gpusolver demo --out build/demo_plan.png

bench: install
	$(PY) benchmarks/solver_quality.py

# On a CUDA machine with its own torch and triton (no venv): the CUDA tests
# (every solver path equal to the CPU one, sync-free, CUDA-graph replay), then
# every solver path timed side by side and the attention kernels. The timeouts
# guard the persistent kernel's grid barrier, which no CPU test can run.
gpu-check:
	TRITON_INTERPRET=0 timeout 300 $(PYTHON) -m pytest tests/gpu -x
	timeout 420 $(PYTHON) benchmarks/solver_latency.py --P 8,64 --repeats 5 --md benchmarks/results/solver_latency_gpu.md
	timeout 240 $(PYTHON) benchmarks/solver_latency.py --P 8 --tiles 4 --repeats 5 --json benchmarks/results/solver_latency_gpu_tiles.json --md benchmarks/results/solver_latency_gpu_tiles.md
	timeout 120 $(PYTHON) benchmarks/kernel_bench.py

clean:
	rm -rf $(VENV) build *.egg-info
