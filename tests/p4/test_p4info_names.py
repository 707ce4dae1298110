"""Every name the control plane writes or reads (p4/entries.py) against the P4Info p4c writes:
each table with its key fields (order, width, exact match), each action it uses with its
parameters (order, width), the counters and registers with their sizes.  The same for the
Tofino program (p4/tna_entries.py: key match kinds, value set, registers) where p4c-barefoot
is there; and a Tofino job through the P4Runtime backend against a fake server, with a P4Info
made from the schema and with p4c-barefoot's."""
import dataclasses

import pytest

from thc_ps.p4 import entries as E
from thc_ps.p4 import tna_entries as T
from thc_ps.p4 import tools
from thc_ps.p4.control import compile_program, p4info_path
from thc_ps.p4.p4runtime import P4Info, client_problem

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


NO_BAREFOOT = f"p4c-barefoot not found on {tools.where_text()}: no TNA P4Info to check"


@pytest.fixture(scope="module")
def tna_p4info(tmp_path_factory):
    """The P4Info p4c-barefoot writes for p4/tofino/thc_tna.p4 (`thc p4 build --target tofino`'s,
    compiled once)."""
    if tools.find_tool("p4c-barefoot") is None:
        pytest.skip(NO_BAREFOOT)
    from thc_ps.p4.control import TNA_P4INFO, compile_tofino
    tmp = tmp_path_factory.mktemp("tna")
    proc = compile_tofino("tofino", tmp)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    return tmp / "tofino" / TNA_P4INFO


def test_every_name_the_tofino_control_plane_uses_is_in_the_tna_p4info(tna_p4info):
    from p4.config.v1 import p4info_pb2
    kinds = {"exact": p4info_pb2.MatchField.EXACT, "range": p4info_pb2.MatchField.RANGE}
    info = P4Info.load(tna_p4info)
    for table, (keys, actions) in T.TNA_SCHEMA.items():
        t = info.table(table)
        assert [(m.name, m.bitwidth, m.match_type) for m in t.match_fields] == \
            [(name, bits, kinds[kind]) for name, bits, kind in keys], table
        refs = {info.name_of(r.id) for r in t.action_refs}
        for action, params in actions.items():
            assert action in refs, (table, action)
            check_action(info, action, params)
    for name, size in T.TNA_COUNTERS.items():
        assert info.counter(name).size == size, name
    for name, (bits, size) in T.TNA_VALUE_SETS.items():
        vs = info.value_set(name)           # p4c-barefoot 9.13 lists no match field (the encoder uses id 1)
        assert vs.size == size and [m.bitwidth for m in vs.match] in ([], [bits]), name
    for name in T.SLOT_REGISTERS:
        assert info.register(name).type_spec.bitstring.bit.bitwidth == 32, name


def test_what_both_programs_share_has_one_shape():
    """The tables and counters both programs have (tna_entries.SHARED), under the same names:
    the same actions with the same parameters, the same keys but for bmv2's job id."""
    for name in T.SHARED:
        if name in E.COUNTERS:
            assert name in T.TNA_COUNTERS
            continue
        (keys, actions), (tkeys, tactions) = E.SCHEMA[name], T.TNA_SCHEMA[name]
        assert actions == tactions, name
        mine = [(n, b) for n, b in keys if n != "hdr.thc.job_id"]
        assert [(n.replace("eg_intr_md.", "sm."), b) for n, b, _ in tkeys] == mine, name


def tna_control(tmp_path, info):
    from thc_ps.p4.p4runtime import P4RuntimeControl
    from tests.p4.fakes import FakeServer
    (tmp_path / "tna.p4info.bin").write_bytes(info.SerializeToString())     # binary: it keeps the externs
    (tmp_path / "tna.config").write_bytes(b"")
    capacity = {t.preamble.id: 128 for t in info.tables}
    server = FakeServer(capacity)
    ctl = P4RuntimeControl("fake:0", tmp_path / "tna.p4info.bin", tmp_path / "tna.config", client=server)
    return ctl, server, {t.preamble.name: t.preamble.id for t in info.tables}, capacity


def tna_job_through(ctl, server, ids, capacity):
    """A job on the Tofino program through the P4Runtime backend and thc_ps.p4.control.apply: the
    pipe's writes, the job's, two registrations; a job the switch rejects (a full lookup
    table) leaves nothing; closing leaves only the pipe's L2 entries."""
    from thc_ps.p4.control import SwitchRejected, apply, switch_job
    from thc_ps.p4.entries import WorkerPort
    job = switch_job(2, job_id=5)
    apply(ctl, T.pipe_writes(68, {"00:00:00:00:00:01": 1, "00:00:00:00:00:02": 2}))
    capacity[ids[T.lut(9)]] = 3
    with pytest.raises(SwitchRejected, match=r"rejected 13 of .*ThcIngress.lut9 .*everything else"):
        apply(ctl, T.tna_job_writes(job, "00:00:00:00:00:fe", nonce=77, recirc_port=68))
    assert {i: rows for i, rows in server.tables.items() if rows} == {ids[T.L2]: server.tables[ids[T.L2]]}
    assert server.groups == {}
    capacity[ids[T.lut(9)]] = 128
    writes = T.tna_job_writes(job, "00:00:00:00:00:fe", nonce=77, recirc_port=68)
    apply(ctl, writes)
    members = ()
    for rank in range(2):
        w = WorkerPort(rank, f"10.0.0.{rank + 1}", 5000, f"00:00:00:00:00:{rank + 1:02x}", rank + 1)
        reg = T.tna_worker_writes(w, token=40 + rank, members=members)
        apply(ctl, reg, {T.GROUP: T.McGroup(T.GROUP, members)})
        writes += reg
        members = reg[1][1].replicas
    assert server.groups == {T.GROUP: [(1, 1), (2, 2)]}
    assert len(server.tables[ids[T.WORKERS]]) == 2 and len(server.tables[ids[T.lut(31)]]) == 16
    kinds = [e.WhichOneof("entity") for e in server.writes]
    assert kinds.count("register_entry") == 2 * len(T.SLOT_REGISTERS) and kinds.count("value_set_entry") == 1
    apply(ctl, [("delete", item) for op, item in reversed(writes) if op == "insert" and not isinstance(item, T.McGroup)]
          + [("delete", T.McGroup(T.GROUP))])
    assert {i: rows for i, rows in server.tables.items() if rows} == {ids[T.L2]: server.tables[ids[T.L2]]}
    assert server.groups == {}


def test_a_tofino_job_through_the_p4runtime_control_plane(tmp_path):
    """Against a P4Info made from TNA_SCHEMA (no compiler needed)."""
    from tests.p4.fakes import schema_p4info
    regs = {r: 4096 for r in T.SLOT_REGISTERS}
    info = schema_p4info(T.TNA_SCHEMA, T.TNA_COUNTERS, T.TNA_VALUE_SETS, regs)
    tna_job_through(*tna_control(tmp_path, info))


def test_a_tofino_job_against_the_p4info_p4c_barefoot_writes(tmp_path, tna_p4info):
    tna_job_through(*tna_control(tmp_path, P4Info.load(tna_p4info).message))


def test_tofino_entries_refuse_what_the_program_cannot_hold():
    from thc_ps.p4.control import switch_job
    with pytest.raises(ValueError, match="the switch aggregates codec thc with b=4"):
        T.tna_job_writes(dataclasses.replace(switch_job(2), lane_bits=16), "00:00:00:00:00:fe", nonce=1,
                         recirc_port=68)
    with pytest.raises(ValueError, match="recirc_port = 600 does not fit in 9 bits"):
        T.tna_job_writes(switch_job(2), "00:00:00:00:00:fe", nonce=1, recirc_port=600)
    with pytest.raises(ValueError, match="empty range 3..2"):
        T.tna_entry(T.WORKER_RANGE, ((3, 2),), f"{T.TING}.worker_in_range", (), priority=1)
    with pytest.raises(ValueError, match="a priority is needed with range keys"):
        T.tna_entry(T.WORKER_RANGE, ((0, 2),), f"{T.TING}.worker_in_range", ())
