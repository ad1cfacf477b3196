# mopflow: two commands do all the set-up.
#   make demo   creates .venv if missing, installs, runs the pipeline end to end on MNIST-1D
#   make test   creates or updates .venv and runs the whole test suite
SHELL := /bin/bash
PYTHON ?= python3.11
# Where torch comes from; empty: pip's configured index. A CPU build on a fresh Linux machine:
#   make demo TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mopflow-installed

.PHONY: demo test test-fast chromium lint venv lock clean

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "mopflow needs $(PYTHON) on PATH" >&2; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24"
	# torch first, pinned, so that the constraints cannot pull another build (PyPI's Linux wheel is CUDA's)
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	$(BIN)/python -m pip check
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/mopflow run --summary-json "$${MOPFLOW_HOME:-$$HOME/.mopflow}/demo-summary.json"

# Two pytest-xdist workers (TEST_WORKERS=0: one process); each takes whole test files, and the
# files that hold the local PostgreSQL server's connections run on one, one after the other (tests/workers.py).
TEST_WORKERS ?= 2
test: $(STAMP) chromium
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The fast tier, the loop between commits: every test that starts no stack, no server and no whole
# pipeline (those are marked slow; docs/development.md says which and why). No chromium needed.
test-fast: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

# The browser test drives Debian's chromium through Playwright (never `playwright install`).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; \
	  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO=sudo; \
	  else echo "chromium is missing and this user cannot apt-get it: the browser test will be skipped" \
	    "(install it with: apt-get install chromium)" >&2; exit 0; fi; \
	  command -v apt-get >/dev/null 2>&1 || { echo "chromium is missing and there is no apt-get:" \
	    "the browser test will be skipped (install chromium at /usr/bin/chromium)" >&2; exit 0; }; \
	  echo "installing Debian's chromium for the browser test"; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends chromium \
	  || { echo "could not install chromium with apt-get: the browser test will be skipped" >&2; exit 0; }; }

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Re-resolve the lock after changing dependencies (torch is excluded: it is pinned and installed first).
lock: $(STAMP)
	$(BIN)/python -m pip freeze --exclude-editable | grep -vE '^(torch|mopflow)==' > constraints.txt

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
