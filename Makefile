# Two entry points, each creating the environment first:
#   make run    set up, then run the main job on its embedded default data
#   make test   set up, then run the CPU test suite less its slow tests (what CI runs)
# and a third for the rest:
#   make test-all  the whole CPU suite, the slow tests too (run it before a change lands)
# The first interpreter that runs and is Python >= 3.12 (jax 0.11 needs it); override with PYTHON=...
PYTHON ?= $(shell for c in python3.12 "env PYENV_VERSION=3.12.1 python3" python3; do \
	$$c -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo $$c; break; }; done)
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "No Python >= 3.12 found; run make PYTHON=/path/to/python3.12"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $@

.PHONY: setup run test test-all
setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/python -m experiments.quickstart

PYTEST := $(VENV)/bin/python -m pytest -n 2 --dist loadfile -q --durations=15

test: $(STAMP)
	$(PYTEST) -m "not slow"

test-all: $(STAMP)
	$(PYTEST)
