# `make chat` and `make test` set up .venv themselves (idempotent) and run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup chat test test-slow test-all test-gpu mutants docs docs-serve clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh
	@PYTHON=$(PYTHON) VENV=$(VENV) sh scripts/setup_env.sh
	@touch $(STAMP)

chat: $(STAMP)
	$(PY) -m app $(ARGS)

# The suite runs on every core (pytest-xdist), a test file per worker (its module fixtures built once), each
# worker's OpenBLAS on one thread (workers on every core already; 16.3 -> 13.2 min here); -rs lists why a
# test was skipped. PYTEST_ARGS="-n 0" runs it in one process (then OPENBLAS_NUM_THREADS= lifts the cap).
XDIST := -n auto --dist loadfile -rs
BLAS  := OPENBLAS_NUM_THREADS=$${OPENBLAS_NUM_THREADS-1}

test: $(STAMP)
	$(BLAS) $(PY) -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BLAS) $(PY) -m pytest -m slow $(XDIST) $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

test-all: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# On a GPU machine, with MLX's CUDA or Metal back-end importable by $(GPU_PY) (no venv needed; for the
# lent CUDA machines see docs/gpu.md "On a GPU"): the fast suite minus the Metal emulator and the TUI, in the
# GPU's own arithmetic (tests marked cpu_exact skip themselves there).
GPU_PY ?= python3
test-gpu:
	$(GPU_PY) -m pytest -m "not slow" -p no:cacheprovider --ignore=tests/test_app.py --ignore=tests/test_metal_emulator.py $(PYTEST_ARGS)

# Deliberate bugs put into a temporary copy of the tree, one at a time (scripts/mutants.py): each must turn its
# tests red. ARGS="--only NAME" runs one; ARGS="--list" lists them. Exit status 1 if one survives.
mutants: $(STAMP)
	$(PY) scripts/mutants.py $(ARGS)

# The manual (docs/, mkdocs.yml): the docs extra installed once into the venv, then a --strict build into site/
# (a broken link or anchor, or a page outside the nav, fails it). `make docs-serve` serves it with live reload.
DOCS_STAMP := $(VENV)/.docs-stamp

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e ".[docs]"
	@touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) scripts/bench_tables.py --check
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

clean:
	rm -rf $(VENV) build site *.egg-info
