"""Every name the control plane writes or reads (p4/entries.py) against the P4Info p4c writes:
each table with its key fields (order, width, exact match), each action it uses with its
parameters (order, width), the counters and registers with their sizes.  The same for the
Tofino program's names (entries.TNA_NAMES) where p4c-barefoot is there."""
import subprocess

import pytest

from p4 import entries as E
from p4 import tools
from p4.control import HERE, compile_program, p4info_path
from p4.p4runtime import P4Info, client_problem

pytestmark = pytest.mark.skipif(bool(client_problem()), reason=client_problem() or "")


def check_table(info: P4Info, table: str, keys, actions: dict) -> None:
    from p4.config.v1 import p4info_pb2
    t = info.table(table)
    assert [(m.name, m.bitwidth) for m in t.match_fields] == list(keys), table
    assert {m.match_type for m in t.match_fields} == {p4info_pb2.MatchField.EXACT}, table
    refs = {info.name_of(r.id) for r in t.action_refs}
    for action, params in actions.items():
        assert action in refs, (table, action)
        check_action(info, action, params)


def check_action(info: P4Info, action: str, params) -> None:
    assert [(p.name, p.bitwidth) for p in info.action(action).params] == list(params), action


@pytest.mark.skipif(tools.find_tool("p4c-bm2-ss") is None,
                    reason=f"p4c-bm2-ss not found on {tools.where_text()} (see `thc p4 doctor`)")
def test_every_name_the_control_plane_uses_is_in_the_v1model_p4info(tmp_path):
    info = P4Info.load(p4info_path(compile_program(tmp_path)))
    for table, (keys, actions) in E.SCHEMA.items():
        check_table(info, table, keys, actions)
    for name, size in E.COUNTERS.items():
        c = info.counter(name)
        assert c.size == size and c.spec.unit in (c.spec.PACKETS, c.spec.BOTH), name
    for name, size in E.REGISTERS.items():
        assert info.register(name).size == size, name
    assert info.register(f"{E.ING}.owner_reg").type_spec.bitstring.bit.bitwidth == 32   # an epoch per slot
    with pytest.raises(ValueError, match="the P4Info has no table ThcIngress.nope"):
        info.table("ThcIngress.nope")


@pytest.mark.skipif(tools.find_tool("p4c-barefoot") is None,
                    reason=f"p4c-barefoot not found on {tools.where_text()}: no TNA P4Info to check")
def test_the_tofino_programs_names_for_what_it_shares(tmp_path):
    out = tmp_path / "tofino"
    proc = subprocess.run([tools.require("p4c-barefoot"), "--target", "tofino", "--arch", "tna", "-o", str(out),
                           "--p4runtime-files", str(tmp_path / "tna.p4info.txtpb"),
                           str(HERE / "tofino" / "thc_tna.p4")], capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = P4Info.load(tmp_path / "tna.p4info.txtpb")
    for ours, (theirs, shape) in E.TNA_NAMES.items():
        if ours in E.SCHEMA:
            assert info.table(theirs) and (shape is None or
                                           [(m.name, m.bitwidth) for m in info.table(theirs).match_fields]
                                           == list(shape)), ours
        elif ours in E.COUNTERS:
            assert info.counter(theirs), ours
        else:
            check_action(info, theirs, shape)
