# Two set-up commands: `make run` (the main job) and `make test` (the test suite).
# Each creates .venv and installs the project into it when needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.thc-installed

.PHONY: test-long run test bench clean dataset test-deps

$(STAMP): pyproject.toml setup.py $(wildcard ps_server/*.c compression/*.c compression/*.h worker/*.c bench/*.c proto/*.h)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,docs]'
	@touch $@

FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
# Debian packages of the namespace and Mininet tests (kernel loss: nft; Mininet: mininet,
# ethtool; namespaces: ip).  p4lang's simple_switch and p4c are not here: see README.
TEST_DEBS := mininet nftables ethtool iproute2

# apt-get install ARGS, with apt-get update only when the first try fails.
apt_install = apt-get install -y -q $(1) >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q $(1) >/dev/null; }

# Fashion-MNIST comes from Debian's package; install it when missing and we are root.
dataset:
	@if [ -n "$$THC_FASHION_MNIST" ] || [ -f $(FMNIST) ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
	  $(call apt_install,dataset-fashion-mnist); \
	else \
	  echo "Fashion-MNIST is missing: run 'sudo apt-get install dataset-fashion-mnist'" \
	       "(or set THC_FASHION_MNIST to a directory with the idx files)"; exit 1; \
	fi

# The test packages: installed (without recommends) when missing and we are root; otherwise
# the tests that need them skip, naming what is missing.
test-deps:
	@missing=; for p in $(TEST_DEBS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
	  { $(call apt_install,--no-install-recommends $$missing); } || \
	    echo "could not install$$missing; the tests that need them skip"; \
	else \
	  echo "not root: the tests that need$$missing skip (sudo apt-get install --no-install-recommends$$missing)"; \
	fi

run: $(STAMP) dataset
	$(BIN)/thc train

test: $(STAMP) dataset test-deps
	$(BIN)/python -m pytest -q

# the tests that wait tens of seconds on purpose (marked `long`; skipped by `make test`)
test-long: $(STAMP) dataset test-deps
	THC_LONG_TESTS=1 $(BIN)/python -m pytest -q -m long

bench: $(STAMP)
	$(BIN)/python bench/bench_thc.py

clean:
	rm -rf $(VENV) build *.egg-info
