# `make test` is the README's test command and what CI runs (.ci/run).
# It needs a Python >= 3.12: the machines' default python3 is 3.11, and 3.12 comes
# from pyenv; scripts/find_python.sh finds one.
PYTHON ?= $(shell ./scripts/find_python.sh)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test test-all venv lint gpu-test clean demo data

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), f"need Python >= 3.12, got {sys.version}"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# CI's tier: everything but the tests marked `extended` (pyproject.toml), which CI's
# 15 minutes on two cores do not hold (the whole CPU suite took 22.5 minutes at 536c0ce).
test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 -q -m "not extended"

# The whole CPU suite, the extended tier included.
test-all: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 -q

lint: venv
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# The main command: set up, prepare the corpus, train the byte-level GPT with our
# attention, print the loss falling and a sample. CPU: the tiny preset (a few minutes);
# a GPU: the small preset.
DEMO_ARGS ?= $(shell $(BIN)/python -c 'import jax; print("--preset small --steps 2000 --batch 16" if jax.default_backend() == "gpu" else "--preset tiny --steps 150 --batch 16")' 2>/dev/null)

data: venv
	test -f data/shakespeare/train.bin || $(BIN)/python -m models.data prepare shakespeare

demo: data
	$(BIN)/python -m models.train --attention flash --out runs/demo $(DEMO_ARGS)

# On the GPU machine (its python3 already has jax): the compiled kernel suite.
# Many small compiles: 8 processes share the GPU, XLA's GEMM autotuner is off (speed
# only), pytest-benchmark (on that image) is off since it refuses to run under xdist.
# The Mosaic (Hopper) kernels run apart, under a timeout: a barrier bug hangs.
gpu-test:
	XLA_FLAGS=--xla_gpu_autotune_level=0 XLA_PYTHON_CLIENT_PREALLOCATE=false \
	  PYTHONPATH=. python3 -m pytest -m "gpu and not mosaic" -q -p no:benchmark -n 8
	XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. timeout 900 \
	  python3 -m pytest -m gpu tests/test_mosaic.py tests/test_mosaic_backward.py \
	  tests/test_mosaic_fused.py -q \
	  -p no:benchmark -n 4

clean:
	rm -rf $(VENV) .pytest_cache
