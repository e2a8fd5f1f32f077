# cleanroom developer tasks. Every target sets up (or checks) .venv first; see scripts/setup.sh.

VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: all setup demo test lint bench fuzz clean distclean

all: test

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/cleanroom run examples/cartpole/manifests.jsonl --baseline examples/cartpole/baseline.toml --parallel 2

test: setup
	$(PY) -m pytest -ra $(PYTEST_ARGS)

# Coverage-guided fuzzing (atheris) of every target in tests/fuzz/targets.py, FUZZ_RUNS inputs
# each (the stream and spec targets take ~10-30 min each here); new corpus entries go to
# .cache/fuzz/, a crash's input to tests/fuzz/crashes/. `make test` runs each target briefly.
FUZZ_RUNS ?= 1000000
fuzz: setup
	@set -e; for t in $$($(PY) tests/fuzz/fuzz.py --list); do \
	  mkdir -p .cache/fuzz/$$t; echo "fuzz: $$t ($(FUZZ_RUNS) inputs)"; \
	  $(PY) tests/fuzz/fuzz.py $$t -runs=$(FUZZ_RUNS) -rss_limit_mb=2048 -max_len=65536 \
	    -print_final_stats=1 -artifact_prefix=tests/fuzz/crashes/$$t- .cache/fuzz/$$t tests/fuzz/corpus/$$t; \
	done

lint: setup
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy

bench: setup
	$(PY) bench/lifecycle.py
	$(PY) bench/start.py
	$(PY) bench/destroy.py
	$(PY) bench/drivers.py
	$(PY) bench/egress.py
	$(PY) bench/fork.py

# Build and cache leftovers; keeps .venv (distclean removes it too).
clean:
	rm -rf build dist .pytest_cache .mypy_cache .ruff_cache bench/tmp src/*.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
