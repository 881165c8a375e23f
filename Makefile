# The two README commands: `make demo` (main job) and `make test` (test suite).
# Each creates its own virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
# CPU wheel on this machine's local disk; GPU users: make TORCH_SPEC='torch>=2.9' ...
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup demo test bench-quality sweep-cpu clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/mapl-swarm launch --config peers/demo.toml

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

bench-quality: $(VENV)/.installed
	$(BIN)/python bench/quality.py

sweep-cpu: $(VENV)/.installed   # ~1 h on 2 cores; resumable (re-run to continue)
	$(BIN)/mapl-swarm sweep --grid bench/grids/cpu.toml --publish bench/results/sweep-cpu --benchmarks BENCHMARKS.md

clean:
	rm -rf $(VENV)
