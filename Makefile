# mopflow: two commands do all the set-up.
#   make demo   creates .venv if missing, installs, runs the pipeline end to end on MNIST-1D
#   make test   creates or updates .venv and runs the whole test suite
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mopflow-installed

.PHONY: demo test lint venv lock clean

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "mopflow needs $(PYTHON) on PATH" >&2; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24"
	# torch first, pinned: the CPU wheel (a looser range would pull a multi-GB CUDA build)
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	$(BIN)/python -m pip check
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/mopflow run --summary-json .mopflow/demo-summary.json

test: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Re-resolve the lock after changing dependencies (torch is excluded: it is pinned and installed first).
lock: $(STAMP)
	$(BIN)/python -m pip freeze --exclude-editable | grep -vE '^(torch|mopflow)==' > constraints.txt

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
