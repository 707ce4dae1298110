# Two set-up commands: `make run` (the main job) and `make test` (the test suite).
# Each creates .venv and installs the project into it when needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.thc-installed

.PHONY: run test bench clean

$(STAMP): pyproject.toml setup.py $(wildcard ps_server/*.c)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,docs]'
	@touch $@

run: $(STAMP)
	$(BIN)/thc demo-nmse

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/bench_thc.py

clean:
	rm -rf $(VENV) build *.egg-info
