"""Suite-wide settings."""
import os

import pytest

# `thc ps/worker/launch/train` print a note when other sessions load the host (deploy/hostload.py);
# on a shared CI host that would change the output the CLI tests read.  tests/test_hostload.py
# tests the note itself.
os.environ["THC_HOST_CHECK"] = "0"


#: Tests that wait tens of seconds on purpose (a worker or the PS stopped for 30-40 s, a
#: 20-job soak) run when THC_LONG_TESTS=1 (`make test-long`); `make test` stays under 30 min
#: on 2 cores.  Their shorter variants run in every suite.
LONG = os.environ.get("THC_LONG_TESTS") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "long: waits tens of seconds on purpose; runs with THC_LONG_TESTS=1")


def pytest_collection_modifyitems(config, items):
    if LONG:
        return
    skip = pytest.mark.skip(reason="a long wait: THC_LONG_TESTS=1 (make test-long) runs it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
