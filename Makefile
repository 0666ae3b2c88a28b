# Two commands set everything up on a fresh machine with only Python:
#   make demo   creates .venv, installs, fits the models on their papers' toy problems
#   make test   same install, runs the whole test suite
#   make docs   same install plus Sphinx, builds the user guide and API reference into docs/_build/html
#   make notebooks  rebuilds and executes the teaching notebooks (full mode, outputs committed)
#   make install-test  a new user's install: the wheel into a fresh venv, README examples, sdist tests
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The public-data cache: ../shared/data on the project's machines, else ~/.cache/pyro_trees.
SHARED_DATA := $(abspath ../shared/data)
PYRO_TREES_DATA ?= $(if $(wildcard $(SHARED_DATA)),$(SHARED_DATA),$(HOME)/.cache/pyro_trees)
export PYRO_TREES_DATA
DEMO_OUT ?= demo_output

.PHONY: install demo test install-test docs lint clean notebooks

install: $(VENV)/.installed

# torch is installed first, pinned to the CPU build, only when the venv has none:
# an unpinned torch would pull several GB of CUDA packages.
$(VENV)/.installed: setup.cfg setup.py pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q -c constraints.txt torch
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: install
	$(BIN)/python -m pyro_trees.demo --out $(DEMO_OUT)

# One pytest worker per core, at most four (each holds its own torch, about 1 GB), each
# given whole test files so that a module's fitted fixtures are built once; the workers
# split the cores between them (tests/conftest.py). TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, os.cpu_count() or 1))")

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# Builds the sdist and the wheel, installs the wheel into a fresh virtual environment outside
# the repository (torch pinned by constraints.txt), imports every module, runs the README's
# examples and the sdist's tests there, and uninstalls: about two minutes, needs the index.
install-test: install
	PYRO_TREES_INSTALL_TEST=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_install.py

# The user guide and API reference; -W: any Sphinx warning fails the build.
docs: $(VENV)/.docs-installed
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html

$(VENV)/.docs-installed: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[docs]'
	touch $@

lint: install
	$(BIN)/ruff check pyro_trees tests benchmarks
	$(BIN)/ruff format --check pyro_trees tests benchmarks

clean:
	rm -rf $(VENV) $(DEMO_OUT) *.egg-info .pytest_cache docs/_build build dist

# Rebuild every teaching notebook from its builder and execute it in full mode
# (at most 3 minutes each); the outputs are written into the committed notebooks.
notebooks: install
	$(BIN)/python notebooks/build.py
