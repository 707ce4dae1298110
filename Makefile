# Two set-up commands: `make run` (the main job) and `make test` (the test suite).
# Each creates .venv and installs the project into it when needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.thc-installed

.PHONY: run test bench clean dataset

$(STAMP): pyproject.toml setup.py $(wildcard ps_server/*.c compression/*.c worker/*.c)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,docs]'
	@touch $@

FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

# Fashion-MNIST comes from Debian's package; install it when missing and we are root.
dataset:
	@if [ -n "$$THC_FASHION_MNIST" ] || [ -f $(FMNIST) ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
	  apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q dataset-fashion-mnist >/dev/null; }; \
	else \
	  echo "Fashion-MNIST is missing: run 'sudo apt-get install dataset-fashion-mnist'" \
	       "(or set THC_FASHION_MNIST to a directory with the idx files)"; exit 1; \
	fi

run: $(STAMP) dataset
	$(BIN)/thc train

test: $(STAMP) dataset
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/bench_thc.py

clean:
	rm -rf $(VENV) build *.egg-info
