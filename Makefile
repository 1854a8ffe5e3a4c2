# `make test` is the README's test command and what CI runs (.ci/run).
# It needs a Python >= 3.12: the machines' default python3 is 3.11, and 3.12 comes
# from pyenv; scripts/find_python.sh finds one.
PYTHON ?= $(shell ./scripts/find_python.sh)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test venv lint gpu-test clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), f"need Python >= 3.12, got {sys.version}"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 -q

lint: venv
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# On the GPU machine (its python3 already has jax): the compiled kernel suite.
gpu-test:
	PYTHONPATH=. python3 -m pytest -m gpu -q

clean:
	rm -rf $(VENV) .pytest_cache
