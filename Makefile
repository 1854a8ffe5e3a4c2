# `make test` is the README's test command and what CI runs (.ci/run).
# It needs a Python >= 3.12: the machines' default python3 is 3.11, and 3.12 comes
# from pyenv; scripts/find_python.sh finds one.
PYTHON ?= $(shell ./scripts/find_python.sh)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test test-sm90 test-sm90-all test-all venv venv-sm90 lint gpu-test clean demo data

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), f"need Python >= 3.12, got {sys.version}"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# Compiling for the H200 without a GPU (benchmarks/deviceless.py: ptxas's registers,
# spills and serialized wgmmas, PTX and SASS of every kernel, on this machine): JAX's
# CUDA plugin and nvdisasm but no CUDA libraries, so nothing runs on a GPU. Apart from
# $(VENV): CPU tests run without a GPU plugin (tests/conftest.py). It holds only those
# two and reads the rest from $(VENV) (a .pth that adds $(VENV)'s site-packages, its
# editable install included): a second copy of JAX and the project's other needs took
# 0.9 GB more, and CI once ran out of disk installing it.
VENV_SM90 ?= .venv-sm90

$(VENV_SM90)/.installed: $(VENV)/.installed
	$(PYTHON) -m venv $(VENV_SM90)
	$(VENV_SM90)/bin/python scripts/layer_venv.py $(VENV)
	$(VENV_SM90)/bin/pip install -q 'jax-cuda13-plugin==0.11.2' 'nvidia-cuda-nvdisasm==13.5.37'
	touch $@

venv-sm90: $(VENV_SM90)/.installed

# CI's tier: everything but the tests marked `extended` (pyproject.toml), which CI's
# 15 minutes on two cores do not hold (the whole CPU suite took 22.5 minutes at 536c0ce).
test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 -q -m "not extended"
	$(MAKE) test-sm90

# The kernels compiled for the H200 without a GPU (tests/test_deviceless.py), in the
# environment with JAX's CUDA plugin; the CPU suite above skips them. The builds of
# options that are off are `extended` here too: test-sm90-all runs them.
test-sm90: venv-sm90
	JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \
	  $(VENV_SM90)/bin/python -m pytest -n 2 -q -m "sm90 and not extended" tests/test_deviceless.py

test-sm90-all: venv-sm90
	JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \
	  $(VENV_SM90)/bin/python -m pytest -n 2 -q -m sm90 tests/test_deviceless.py

# The whole CPU suite, the extended tier included, and every deviceless build.
test-all: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 -q
	$(MAKE) test-sm90-all

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
	rm -rf $(VENV) $(VENV_SM90) .pytest_cache
