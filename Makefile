# `make test` and `make demo` work on a fresh machine with only python3:
# each creates .venv, installs the project into it, then runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo lint bench clean multihost

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e '.[dev]'
	@# Bytecode for the installed packages, once, with every core: with PYTHONDONTWRITEBYTECODE
	@# set (as on this project's machines) every process compiled jax, flax and orbax from
	@# source on each import, ~2 s apiece, and the suite starts dozens of processes.
	$(PY) -m compileall -q -j 0 $(VENV)/lib || echo "compileall: some files kept no bytecode"
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(STAMP) lint
	@$(PY) -m compileall -q -j 0 nan2safe_jax examples || true  # (see $(STAMP)), our own code
	$(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile

multihost: $(STAMP)
	$(PY) -m pytest -v tests/test_multihost.py

demo: $(STAMP)
	$(VENV)/bin/nan2safe demo

clean:
	rm -rf $(VENV) build *.egg-info
