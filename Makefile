# cleanroom developer tasks. Every target sets up (or checks) .venv first; see scripts/setup.sh.

VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: all setup demo test lint bench mutation fuzz-native clean distclean

all: test

setup:
	@bash scripts/setup.sh

# On a new machine `cleanroom doctor` runs first (and stops the demo with the fix for anything
# missing); once it has passed on this host, --once keeps it quiet.
demo: setup
	$(PY) -m cleanroom doctor --once
	$(PY) -m cleanroom run examples/cartpole/manifests.jsonl --baseline examples/cartpole/baseline.toml --parallel 2
	@echo "The cleanroom command lives in $(VENV): run '. $(VENV)/bin/activate' to use it (or $(VENV)/bin/cleanroom)."

test: setup
	$(PY) -m pytest -ra $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy

# libFuzzer (ASan, UBSan) over the native agent's frame reader: 1,000,000 inputs
fuzz-native: setup
	$(PY) scripts/fuzz_native.py --runs 1000000

bench: setup
	$(PY) bench/lifecycle.py
	$(PY) bench/start.py
	$(PY) bench/destroy.py
	$(PY) bench/drivers.py
	$(PY) bench/egress.py
	$(PY) bench/fork.py

# Mutation testing of reaper.py, store/, ledger/ against their fast tests ([tool.mutmut] in
# pyproject.toml); the report, with every survivor, goes to bench/results/mutation.txt.
mutation: setup
	$(PY) -m pip install -q -e '.[mutation]'
	$(VENV)/bin/mutmut run --max-children 2
	$(PY) bench/mutation_report.py > bench/results/mutation.txt

# Build and cache leftovers; keeps .venv (distclean removes it too).
clean:
	rm -rf build dist .pytest_cache .mypy_cache .ruff_cache bench/tmp src/*.egg-info mutants
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
