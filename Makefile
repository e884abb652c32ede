# The two commands of the README: `make demo` and `make test`. Each creates .venv and
# installs what it needs on first use.
PY ?= python3
VENV ?= .venv
# Installed before the project so that pip does not resolve a several-GB CUDA build on
# CPU-only machines. On a GPU machine override it, e.g. `make demo TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test test-fast lint clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/swarm demo

test: $(BIN)/.installed
	$(BIN)/pytest -q

test-fast: $(BIN)/.installed
	$(BIN)/pytest -q -m "not slow"

lint: $(BIN)/.installed
	$(BIN)/ruff check swarm tests
	$(BIN)/mypy swarm

clean:
	rm -rf $(VENV) .demo .pytest_cache .mypy_cache .ruff_cache
