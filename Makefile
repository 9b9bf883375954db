# Two set-up commands matter: `make demo` and `make test`. Both create .venv
# and install the project into it when needed, so a fresh clone with only
# Python 3.11 and make works.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUNTIME_STAMP := $(VENV)/.installed-runtime

.PHONY: install lint test e2e demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The demo needs only the runtime dependencies, not the test extras.
$(RUNTIME_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $(RUNTIME_STAMP)

install: $(STAMP)

lint: install
	$(BIN)/ruff format --check trio_failover tests scripts examples e2e
	$(BIN)/ruff check trio_failover tests scripts examples e2e
	$(BIN)/mypy --strict trio_failover
	$(BIN)/lint-imports

test: lint
	$(BIN)/pytest

# The proxy in front of real engines (llama-server, llama-cpp-python) and a
# real model, all on CPU. The first run builds both engines into a cache
# outside the checkout (~15 min on two cores); later runs take minutes.
# Writes build/e2e/report.md.
e2e: install
	$(BIN)/python e2e/prepare.py
	$(BIN)/pytest -c e2e/pytest.ini e2e $(E2E_ARGS)

demo: $(RUNTIME_STAMP)
	$(BIN)/trio-failover demo

bench: install
	$(BIN)/python scripts/bench.py
	$(BIN)/python scripts/bench_burst.py
	$(BIN)/python scripts/bench_workers.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
