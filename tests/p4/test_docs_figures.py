"""docs/p4.md's figures against what this checkout produces: the number of tests in
tests/p4, and the resource table against the JSON p4c-bm2-ss compiles p4/thc.p4 into."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from thc_ps.p4 import tools
from thc_ps.p4.resources import resources

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "p4.md").read_text()


def _row(label: str) -> str:
    """The value cell of the resource table's row that starts with `label`."""
    m = re.search(rf"^\| {re.escape(label)}[^|]* \| ([^|]+) \|$", DOC, re.M)
    assert m, f"docs/p4.md has no resource row '{label}'"
    return m.group(1)


def _ints(text: str) -> list:
    return [int(x.replace(",", "")) for x in re.findall(r"\d[\d,]*", text)]


def test_the_stated_test_count_is_the_collected_one():
    m = re.findall(r"`tests/p4` holds (\d+) tests", DOC)
    assert len(m) == 1, "docs/p4.md states the test count once, as '`tests/p4` holds N tests'"
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests" / "p4")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    collected = re.search(r"(\d+) tests? collected", out.stdout)
    assert collected, out.stdout[-2000:] + out.stderr[-2000:]
    assert int(m[0]) == int(collected.group(1))


@pytest.mark.skipif(tools.find_tool("p4c-bm2-ss") is None,
                    reason=f"p4c-bm2-ss not found on {tools.where_text()}")
def test_the_resource_table_is_what_the_compiler_produces(tmp_path):
    from thc_ps.p4.control import compile_program
    res = resources(compile_program(tmp_path))
    assert _ints(_row("index lanes per packet"))[0] == res["lanes_per_packet"]
    declared = _row("declared match-action tables")
    assert _ints(declared)[0] == res["declared_tables"]
    assert f"{res['lookup_tables']} per-lane lookup tables" in declared
    assert _ints(_row("compiler-generated tables"))[0] == res["compiler_tables"]
    assert _ints(_row("register arrays"))[:2] == [res["register_arrays"], res["lane_registers"]]
    assert _ints(_row("register state"))[:2] == [res["register_bits"], res["lane_register_bits"]]
    assert _ints(_row("actions / conditionals")) == [res["actions"], res["conditionals"]]
