# The README's two set-up commands: `make serve` and `make test` (each creates the venv and installs).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install serve test lint vllm-venv bench

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/voxray serve

lint: install
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest -q

vllm-venv:
	bash loadtest/baselines/make_vllm_venv.sh

bench: install
	$(BIN)/python -m loadtest.decode_bench
