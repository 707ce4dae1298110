"""The two control-plane backends without a switch: what p4/entries.py writes for a job, the
Thrift CLI text of it, and the P4Runtime backend against a fake P4Runtime server that keeps
tables and groups and rejects what a full table or an unknown id would (bmv2's answers), so
the take-back of a rejected batch is checked exactly."""
import itertools

import pytest

from thc_ps.p4 import entries as E
from thc_ps.p4.control import SwitchEngine, SwitchRejected, job_commands, switch_job
from thc_ps.p4.p4runtime import P4RuntimeControl, client_problem, encode
from thc_ps.p4.spec import EVENT_CELLS, LANES
from tests.p4.fakes import FakeServer, schema_p4info

pytestmark = pytest.mark.skipif(bool(client_problem()), reason=client_problem() or "")

PS_MAC = "00:00:00:00:00:fe"
TOPOLOGY = {f"10.0.0.{i + 1}": (i + 1, f"00:00:00:00:00:{i + 1:02x}") for i in range(4)}


def test_a_job_in_entries_and_in_cli_text():
    job = switch_job(3, slots=6, norm_slots=2, job_id=5, granularity=30)
    writes = E.job_writes(job, PS_MAC, nonce=0xA11CE, base=10, cell=2, epoch=7)
    config = writes[0][1]
    assert dict(config.params) == {"nonce": 0xA11CE, "n": 3, "quorum": 3, "base": 10, "data_slots": 6,
                                   "norm_slots": 2, "group": 2, "event_base": 2 * EVENT_CELLS, "ps_mac": 0xFE,
                                   "epoch": 7}
    luts = [item for _, item in writes if item.__class__ is E.TableEntry and "lut" in item.table]
    assert len(luts) == LANES * 16 and {dict(e.match)["hdr.thc.job_id"] for e in luts} == {5}
    assert [dict(e.params)["v"] for e in luts[:16]] == list(job.table)
    assert writes[-2:] == [("insert", E.McGroup(2)), ("modify", E.CounterCells(E.EVENTS_COUNTER, 32, EVENT_CELLS))]
    cmds = job_commands(job, PS_MAC, 0xA11CE, 10, 2, 7)
    assert cmds[0] == f"table_add ThcIngress.thc_config ThcIngress.set_config 5 => {0xA11CE} 3 3 10 6 2 2 32 254 7"
    assert cmds[1] == f"table_add ThcIngress.lut0 ThcIngress.set_v0 5 0 => {job.table[0]}"
    assert cmds[-EVENT_CELLS - 1] == "mc_mgrp_create 2" and cmds[-1] == "counter_write ThcIngress.events 47 0 0"


def test_values_that_do_not_fit_their_field_are_refused_naming_it():
    w = E.WorkerPort(0, "10.0.0.1", 70000, "00:00:00:00:00:01", 1)
    with pytest.raises(ValueError, match=r"ThcIngress.workers key hdr.udp.src_port = 70000 does not fit in 16 bits"):
        E.worker_entry(w, 1)
    with pytest.raises(ValueError, match="not a MAC address"):
        E.l2_entries({"00:01": 3})
    assert encode(0) == b"\x00" and encode(0x1234) == b"\x12\x34" and encode(256) == b"\x01\x00"


# ---------------------------------------------------------------- a fake P4Runtime server

@pytest.fixture
def fake(tmp_path):
    from google.protobuf import text_format
    info = schema_p4info(E.SCHEMA, E.COUNTERS)
    (tmp_path / "thc.p4info.txtpb").write_text(text_format.MessageToString(info))
    (tmp_path / "thc.json").write_text("{}")
    ids = {t.preamble.name: t.preamble.id for t in info.tables}
    capacity = {i: 128 for i in ids.values()}
    server = FakeServer(capacity)
    ctl = P4RuntimeControl("fake:0", tmp_path / "thc.p4info.txtpb", tmp_path / "thc.json", client=server)
    return ctl, server, ids, capacity


def nothing_of(server, ids, job_id):
    """No table row keyed by `job_id` (the first key field of every per-job table)."""
    return not [k for t, rows in server.tables.items() for k in rows
                if t != ids[E.L2] and t != ids[E.REPLICA] and k[0] == encode(job_id)]


def test_a_full_table_rejects_the_job_and_nothing_of_it_stays(fake):
    ctl, server, ids, capacity = fake
    switch = SwitchEngine(ctl, TOPOLOGY, PS_MAC)
    a = switch.start_job(switch_job(2, job_id=1), nonce=11, base=0)
    for rank in range(2):
        a.register(rank, f"10.0.0.{rank + 1}", 5000 + rank, token=7 + rank)
    capacity[ids[E.lut(7)]] = 16 + 5          # room for job 1's 16 entries and 5 more
    before = {t: set(rows) for t, rows in server.tables.items()}, dict(server.groups)
    with pytest.raises(SwitchRejected) as exc:
        switch.start_job(switch_job(2, job_id=2), nonce=22, base=100)
    msg = str(exc.value)
    assert "rejected 11 of" in msg and "table ThcIngress.lut7 entry (hdr.thc.job_id=2, hdr.idx.z7=5)" in msg
    assert "UNKNOWN: Error when adding match entry to target" in msg and "everything else of the batch was taken back" in msg
    assert ({t: set(rows) for t, rows in server.tables.items()}, dict(server.groups)) == before
    assert nothing_of(server, ids, 2) and list(switch.cells) == [a.cell]
    capacity[ids[E.lut(7)]] = 128
    b = switch.start_job(switch_job(2, job_id=2), nonce=22, base=100)     # the next start is whole
    assert b.cell == 2 and server.groups == {1: [(1, 32), (2, 33)], 2: []}
    assert sum(len(rows) for rows in server.tables.values()) == 2 * (1 + LANES * 16) + 2 * 2
    b.close()
    a.close()
    assert server.groups == {} and not any(server.tables.values())


def test_a_rejected_registration_keeps_the_group_as_it_was(fake):
    ctl, server, ids, capacity = fake
    switch = SwitchEngine(ctl, TOPOLOGY, PS_MAC)
    job = switch.start_job(switch_job(3, job_id=4), nonce=1, base=0)
    job.register(0, "10.0.0.1", 5000, token=1)
    capacity[ids[E.REPLICA]] = 1                     # rank 1's egress rewrite has no room
    with pytest.raises(SwitchRejected, match=r"table ThcEgress.replica_dest entry \(sm.egress_rid=33\)"):
        job.register(1, "10.0.0.2", 5001, token=2)
    assert server.groups == {1: [(1, 32)]} and len(server.tables[ids[E.WORKERS]]) == 1
    capacity[ids[E.REPLICA]] = 128
    job.register(1, "10.0.0.2", 5001, token=2)
    assert server.groups == {1: [(1, 32), (2, 33)]} and len(server.tables[ids[E.WORKERS]]) == 2


def test_a_p4info_that_is_not_the_switchs_names_what_differs(fake):
    """A control plane whose P4Info numbers a table differently from the program loaded is
    rejected (NOT_FOUND), and the job is taken back."""
    ctl, server, ids, capacity = fake
    switch = SwitchEngine(ctl, TOPOLOGY, PS_MAC)
    del capacity[ids[E.lut(3)]]                      # the switch's program has no table with that id
    with pytest.raises(SwitchRejected, match=r"rejected 16 of .*ThcIngress.lut3 .*NOT_FOUND"):
        switch.start_job(switch_job(2, job_id=3), nonce=5, base=0)
    assert not any(server.tables.values()) and server.groups == {} and not switch.cells


# ---------------------------------------------------------------- the Thrift backend, fake CLI

class FakeCLI:
    """simple_switch_CLI as a batch sees it: its prompt before each command's output, entry
    and node handles counted up, `Invalid table operation (TABLE_FULL)` for a table at its
    `capacity`; the packet replication engine's groups and nodes, with bmv2's `Invalid PRE
    operation (...)` for a group already made or missing, and `TABLE_FULL` for a group holding
    `members` nodes; `Invalid PRE operation (ERROR)` for a node of a rid in `refuse`."""

    thrift_port = 0

    def __init__(self, capacity: dict, members: int = 64):
        self.capacity, self.rows, self.next = capacity, {}, itertools.count()
        self.node_ids, self.runs, self.members = itertools.count(), [], members
        self.groups: dict = {}          # group -> set of node handles
        self.nodes: dict = {}           # node handle -> (rid, port)
        self.refuse: set = set()        # rids whose node the switch will not make

    def _pre(self, word: str, args: list) -> str:
        if word == "mc_mgrp_create":
            if int(args[0]) in self.groups:
                return "Invalid PRE operation (INVALID_MGID)\n"
            self.groups[int(args[0])] = set()
        elif word == "mc_mgrp_destroy":
            if self.groups.pop(int(args[0]), None) is None:
                return "Invalid PRE operation (INVALID_MGRP_HANDLE)\n"
        elif word == "mc_node_create":
            if int(args[0]) in self.refuse:
                return "Invalid PRE operation (ERROR)\n"
            node = next(self.node_ids)
            self.nodes[node] = (int(args[0]), int(args[1]))
            return f"node was created with handle {node}\n"
        elif word == "mc_node_destroy":
            if self.nodes.pop(int(args[0]), None) is None:
                return "Invalid PRE operation (INVALID_L1_HANDLE)\n"
        elif word in ("mc_node_associate", "mc_node_dissociate"):
            group, node = self.groups.get(int(args[0])), int(args[1])
            if group is None or node not in self.nodes:
                return "Invalid PRE operation (INVALID_MGRP_HANDLE)\n"
            if word == "mc_node_associate" and len(group) >= self.members:
                return "Invalid PRE operation (TABLE_FULL)\n"
            (group.add if word == "mc_node_associate" else group.discard)(node)
        return ""

    def run(self, commands, check=True):
        self.runs.append(list(commands))
        out = ["Obtaining JSON from switch...\nDone\n"]
        for c in commands:
            word, *args = c.split()
            text = ""
            if word == "table_add":
                rows = self.rows.setdefault(args[0], set())
                if len(rows) >= self.capacity.get(args[0], 128):
                    text = "Invalid table operation (TABLE_FULL)\n"
                else:
                    handle = next(self.next)
                    rows.add(handle)
                    text = f"Entry has been added with handle {handle}\n"
            elif word == "table_delete":
                self.rows[args[0]].discard(int(args[1]))
            elif word.startswith("mc_"):
                text = self._pre(word, args)
            out.append("RuntimeCmd: " + text)
        return "".join(out) + "RuntimeCmd: \n"

    def members_of(self, group: int) -> set:
        return {self.nodes[n] for n in self.groups[group]}


def test_thrift_batches_keep_handles_and_take_back_a_full_table():
    from thc_ps.p4.control import ThriftControl
    cli = FakeCLI({E.lut(5): 16 + 3})
    switch = SwitchEngine(ThriftControl(cli), TOPOLOGY, PS_MAC)
    a = switch.start_job(switch_job(2, job_id=1), nonce=1, base=0)
    a.register(0, "10.0.0.1", 5000, token=3)
    assert cli.runs[-1] == ["mc_node_associate 1 0"]           # the node bmv2 numbered, in the group
    assert cli.runs[-2][1:] == ["mc_node_create 32 1", "table_add ThcEgress.replica_dest ThcEgress.set_dest "
                                f"32 => 1 {E.ip_int('10.0.0.1')} 5000"]
    with pytest.raises(SwitchRejected, match=r"failed 13 of .*ThcIngress.lut5 .*TABLE_FULL"):
        switch.start_job(switch_job(2, job_id=2), nonce=2, base=100)
    assert {t: len(r) for t, r in cli.rows.items() if r} == \
        {t: len(r) for t, r in cli.rows.items() if r and t != E.lut(5)} | {E.lut(5): 16}
    assert sum(len(r) for r in cli.rows.values()) == 1 + LANES * 16 + 2     # job 1 and its rank 0 only
    taken_back = cli.runs[-1]
    assert taken_back[0] == "mc_mgrp_destroy 2"                 # newest first: the group, ..., the config
    assert taken_back[-1].startswith("table_delete ThcIngress.thc_config ") and len(taken_back) == 1 + 32 * 16 - 13 + 1
    a.close()
    assert not any(cli.rows.values()) and "mc_node_dissociate 1 0" in cli.runs[-1]


def test_a_thrift_group_write_that_fails_partway_leaves_the_group_as_it_was():
    """A registration whose multicast node cannot join the group (bmv2: the group is full) is
    rejected whole: its node is destroyed, the group keeps the members it had, and the
    rank's workers and replica_dest entries are taken back."""
    from thc_ps.p4.control import ThriftControl
    cli = FakeCLI({}, members=1)
    switch = SwitchEngine(ThriftControl(cli), TOPOLOGY, PS_MAC)
    job = switch.start_job(switch_job(2, job_id=1), nonce=1, base=0)
    job.register(0, "10.0.0.1", 5000, token=3)
    rows = {t: set(r) for t, r in cli.rows.items()}
    assert cli.members_of(1) == {(E.rid(1, 0), 1)}
    with pytest.raises(SwitchRejected, match=r"failed 1 of 3 writes; first: modify multicast group 1 .*TABLE_FULL"):
        job.register(1, "10.0.0.2", 5000, token=4)
    assert cli.members_of(1) == {(E.rid(1, 0), 1)}
    assert set(cli.nodes.values()) == {(E.rid(1, 0), 1)}            # the rejected rank's node is gone
    assert {t: r for t, r in cli.rows.items() if r} == {t: r for t, r in rows.items() if r}
    job.register(0, "10.0.0.1", 5000, token=5)                   # the job goes on with what it had
    job.close()
    assert not cli.groups and not cli.nodes and not any(cli.rows.values())


def test_a_thrift_group_restored_after_members_were_taken_out():
    """A write that takes a member out and adds one the switch refuses: the member taken out
    comes back (a new node), so the group and the backend's record of it are as before."""
    from thc_ps.p4.control import ThriftControl, ThriftError
    cli = FakeCLI({})
    control = ThriftControl(cli)
    a, b, c = (1, E.rid(1, 0)), (2, E.rid(1, 1)), (3, E.rid(1, 2))
    control.write([("insert", E.McGroup(1, (a, b)))])
    cli.refuse.add(c[1])
    with pytest.raises(ThriftError, match=r"modify multicast group 1 .*Invalid PRE operation \(ERROR\)"):
        control.write([("modify", E.McGroup(1, (a, c)))])          # b out, c in: c is refused
    assert cli.members_of(1) == {(a[1], a[0]), (b[1], b[0])}
    assert sorted(cli.nodes.values()) == sorted([(a[1], a[0]), (b[1], b[0])])    # no node left over
    assert {key: cli.nodes[n] for key, n in control.nodes[1].items()} == {a: (a[1], a[0]), b: (b[1], b[0])}
    control.write([("delete", E.McGroup(1))])
    assert not cli.groups and not cli.nodes
