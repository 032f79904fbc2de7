# Two entry points, each creating the environment first:
#   make run    set up, then run the main job on its embedded default data
#   make test   set up, then run the CPU test suite (what CI runs)
PYTHON ?= $(shell command -v python3.12 2>/dev/null || echo env PYENV_VERSION=3.12.1 python3)
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $@

.PHONY: setup run test
setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/python -m experiments.kda_demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 -q --durations=15
