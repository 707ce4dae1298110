"""P4 tests.  Those marked `bmv2` need p4lang's tools (found by p4/tools.py) and skip with a
one-line reason naming what is missing; every test here that builds namespaces needs root.
The switch tests run once per control plane (the `control` fixture): `thrift` and
`p4runtime`, which also needs simple_switch_grpc and the P4Runtime client library."""
import os

import pytest

from thc_ps.p4 import tools
from thc_ps.p4.control import CONTROLS, compile_program
from thc_ps.p4.p4runtime import client_problem

MISSING = tools.missing_tools(*tools.BMV2_HALF)
#: what keeps a simple_switch_CLI that is there from running (its interpreter lacks bmv2's modules)
BROKEN = "" if MISSING else tools.cli_problem(tools.find_tool("simple_switch_CLI"))
#: what the P4Runtime control plane lacks here ('' when nothing)
NO_P4RUNTIME = (f"simple_switch_grpc not found on {tools.where_text()}" if tools.find_tool("simple_switch_grpc") is None
                else client_problem())


def pytest_configure(config):
    config.addinivalue_line("markers", "bmv2: needs simple_switch, simple_switch_CLI and p4c-bm2-ss")
    config.addinivalue_line("markers", "root: needs root (veth pairs, network namespaces)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/p4/" not in str(item.fspath):
            continue
        if item.get_closest_marker("bmv2") and MISSING:
            item.add_marker(pytest.mark.skip(reason=f"P4 tools not found on {tools.where_text()}: "
                                                    f"{', '.join(MISSING)} (see `thc p4 doctor`)"))
        elif item.get_closest_marker("bmv2") and BROKEN:
            item.add_marker(pytest.mark.skip(reason=f"simple_switch_CLI cannot run: {BROKEN} "
                                                    f"(see `thc p4 doctor`)"))
        elif (item.get_closest_marker("bmv2") or item.get_closest_marker("root")) and os.geteuid() != 0:
            item.add_marker(pytest.mark.skip(reason="needs root (veth pairs, network namespaces)"))
        elif getattr(item, "callspec", None) and item.callspec.params.get("control") == "p4runtime" and NO_P4RUNTIME:
            item.add_marker(pytest.mark.skip(reason=f"P4Runtime control plane: {NO_P4RUNTIME} (see `thc p4 doctor`)"))


@pytest.fixture(scope="session")
def thc_json(tmp_path_factory):
    return compile_program(tmp_path_factory.mktemp("p4"))


@pytest.fixture(scope="module", params=CONTROLS)
def control(request):
    """The control plane a switch test programs its switch with."""
    return request.param
