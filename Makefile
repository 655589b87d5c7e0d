# `make chat` and `make test` set up .venv themselves (idempotent) and run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup chat test test-slow test-all clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh
	@PYTHON=$(PYTHON) VENV=$(VENV) sh scripts/setup_env.sh
	@touch $(STAMP)

chat: $(STAMP)
	$(PY) -m app $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

test-all: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
