# cleanroom developer tasks. Every target sets up (or checks) .venv first; see scripts/setup.sh.

VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: all setup demo test lint docs bench soak fuzz fuzz-native mutation clean distclean

all: test

setup:
	@bash scripts/setup.sh

# On a new machine `cleanroom doctor` runs first (and stops the demo with the fix for anything
# missing); once it has passed on this host, --once keeps it quiet.
demo: setup
	$(PY) -m cleanroom doctor --once
	$(PY) -m cleanroom run examples/cartpole/manifests.jsonl --baseline examples/cartpole/baseline.toml --parallel 2
	@echo "The cleanroom command lives in $(VENV): run '. $(VENV)/bin/activate' to use it (or $(VENV)/bin/cleanroom)."

# The Harbor tests (tests/integrations, -m harbor) need Python >= 3.12: built once, then cached.
test: setup
	@bash scripts/harbor-python.sh >/dev/null
	$(PY) -m pytest -ra $(PYTEST_ARGS)

# Coverage-guided fuzzing (atheris) of every target in tests/fuzz/targets.py, FUZZ_RUNS inputs
# each (the stream and spec targets take ~10-30 min each here); new corpus entries go to
# .cache/fuzz/, a crash's input to tests/fuzz/crashes/. `make test` runs each target briefly.
# The native agent's frame reader first (fuzz-native, below).
FUZZ_RUNS ?= 1000000
fuzz: setup fuzz-native
	@set -e; for t in $$($(PY) tests/fuzz/fuzz.py --list); do \
	  mkdir -p .cache/fuzz/$$t; echo "fuzz: $$t ($(FUZZ_RUNS) inputs)"; \
	  $(PY) tests/fuzz/fuzz.py $$t -runs=$(FUZZ_RUNS) -rss_limit_mb=2048 -max_len=65536 \
	    -print_final_stats=1 -artifact_prefix=tests/fuzz/crashes/$$t- .cache/fuzz/$$t tests/fuzz/corpus/$$t; \
	done

lint: setup
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy

# The documentation site (MkDocs Material) into site/; the suite runs the same build --strict.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# libFuzzer (ASan, UBSan) over the native agent's frame reader (agent/native), FUZZ_RUNS inputs
fuzz-native: setup
	$(PY) scripts/fuzz_native.py --runs $(FUZZ_RUNS)

bench: setup
	$(PY) bench/lifecycle.py
	$(PY) bench/start.py
	$(PY) bench/destroy.py
	$(PY) bench/drivers.py
	$(PY) bench/egress.py
	$(PY) bench/fork.py
	$(PY) bench/session.py
	$(PY) bench/spares.py
	@if command -v perf >/dev/null 2>&1; then $(PY) bench/host_profile.py; \
	else echo "bench: bench/host_profile.py skipped: it needs perf (apt-get install linux-perf)"; fi

# The seeded soak (bench/soak.py; hours here): SOAK_EPISODES episodes of random work with random
# faults on SOAK_DRIVER, a fresh random seed unless SOAK_SEED is given. The seed is printed first;
# a failure prints it again with the command that reproduces it. Results: bench/results/soak.txt.
ifeq ($(origin SOAK_SEED),undefined)
SOAK_SEED := $(shell od -An -N2 -tu2 /dev/urandom | tr -d ' ')
endif
SOAK_EPISODES ?= 10000
SOAK_DRIVER ?= fake
soak: setup
	@echo "soak: seed $(SOAK_SEED) (make soak SOAK_SEED=$(SOAK_SEED) reproduces it)"
	$(PY) bench/soak.py --seed $(SOAK_SEED) --episodes $(SOAK_EPISODES) --driver $(SOAK_DRIVER) \
	  --out bench/results/soak$(if $(filter-out fake,$(SOAK_DRIVER)),-$(SOAK_DRIVER)).txt

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
