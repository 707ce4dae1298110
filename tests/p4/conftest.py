"""bmv2 tests: skipped with a one-line reason when the P4 tools are absent."""
import os

import pytest

from p4.control import compile_program, missing_tools

MISSING = missing_tools("simple_switch", "simple_switch_CLI", "p4c-bm2-ss")


def pytest_collection_modifyitems(config, items):
    reason = None
    if MISSING:
        reason = f"P4 tools not found on PATH or /opt/p4tools/bin: {', '.join(MISSING)}"
    elif os.geteuid() != 0:
        reason = "bmv2 tests need root (veth pairs, network namespaces)"
    if reason:
        for item in items:
            if "/tests/p4/" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def thc_json(tmp_path_factory):
    return compile_program(tmp_path_factory.mktemp("p4"))
