"""What a job needs on the Tofino program (p4/tofino/thc_tna.p4), in the names of the P4Info
`p4c-barefoot --p4runtime-force-std-externs` writes for it: the P4Info a P4Runtime server on a
Tofino (Stratum) loads, whose counters, registers and value sets are P4Runtime's standard
entities (without the flag p4c-barefoot describes them as Tofino-specific externs and prefixes
every name with the Pipeline's, `pipe.`).  The items are p4/entries.py's (TableEntry,
McGroup, CounterCells, ValueSet, RegisterFill), so p4/p4runtime.py's P4RuntimeControl and
thc_ps.p4.control.apply drive it as they drive bmv2.

The program serves one job at a time (p4/tofino/README.md): the job is matched on (job id,
nonce) with no job id in the other keys, worker ids and slots are checked by range tables
(a Tofino gateway compares a field with a constant, not with another field), and a slot is
unused while its `round_reg` cell is 0, so a new job zeroes the slot registers instead of
taking a new epoch.  `TNA_SCHEMA` names every table the control plane writes; a test checks
it and a job's writes against the P4Info (tests/p4/test_p4info_names.py).
"""
from __future__ import annotations

from thc_ps.p4.entries import (EGR, ING, CounterCells, McGroup, RegisterFill, TableEntry, ValueSet, WorkerPort, _fit,
                        check_shape, entry, ip_int, mac_int)
from thc_ps.p4.spec import EVENT_CELLS, LANES
from thc_ps.proto.headers import DATA, NORM
from thc_ps.proto.job import JobConfig

#: With standard externs p4c-barefoot names a TNA object after its control, as p4c names bmv2's.
TING, TEGR = ING, EGR
JOB, JOB_SIZE, WORKER_RANGE, SLOT_RANGE = (f"{TING}.thc_job", f"{TING}.job_size", f"{TING}.worker_range",
                                           f"{TING}.slot_range")
WORKERS, L2, REPLICA = f"{TING}.workers", f"{TING}.l2", f"{TEGR}.replica_dest"
RECIRC_PORTS = "ThcIngressParser.recirc_ports"
EVENTS, EXTRA_EVENTS = f"{TING}.events", f"{TING}.extra_events"
#: The job's multicast group (the program sends every RESULT to group 1).
GROUP = 1
#: The 32-bit slot registers a new job zeroes: `round_reg` 0 is "slot unused", and the others
#: are zeroed too, so that nothing of the job before can be read.
SLOT_REGISTERS = tuple(f"{TING}.{r}" for r in ("round_reg", "offset_reg", "arrived_reg", "contrib_reg"))
PORT_BITS = 9           # PortId_t


def lut(lane: int) -> str:
    return f"{TING}.lut{lane}"


#: table -> (key fields [(name, bits, match kind)], {action: [(param, bits)]})
TNA_SCHEMA: dict = {
    JOB: ((("hdr.thc.job_id", 16, "exact"), ("hdr.thc.nonce", 32, "exact")),
          {f"{TING}.set_job": (("n", 8), ("quorum", 8), ("quorum_cb", 32), ("ps_mac", 48),
                               ("recirc_port", PORT_BITS))}),
    JOB_SIZE: ((("hdr.thc.job_id", 16, "exact"), ("hdr.thc.nonce", 32, "exact"),
                ("hdr.thc.num_workers", 8, "exact")), {f"{TING}.n_matches": ()}),
    WORKER_RANGE: ((("hdr.thc.worker_id", 8, "range"),), {f"{TING}.worker_in_range": ()}),
    SLOT_RANGE: ((("hdr.thc.type", 8, "exact"), ("hdr.thc.slot", 16, "range")), {f"{TING}.slot_in_range": ()}),
    WORKERS: ((("hdr.ipv4.src", 32, "exact"), ("hdr.udp.src_port", 16, "exact"), ("hdr.thc.token", 32, "exact"),
               ("hdr.thc.worker_id", 8, "exact")), {f"{TING}.set_worker": (("me", 32),)}),
    L2: ((("hdr.eth.dst", 48, "exact"),), {f"{TING}.forward": (("port", PORT_BITS),)}),
    REPLICA: ((("eg_intr_md.egress_rid", 16, "exact"),), {f"{TEGR}.set_dest": (("mac", 48), ("ip", 32),
                                                                                ("port", 16))}),
    **{lut(i): (((f"hdr.idx.z{i}", 4, "exact"),), {f"{TING}.set_v{i}": (("v", 8),)}) for i in range(LANES)},
}
#: What both programs have under the same name: the same actions with the same parameters,
#: and the same key fields but for the v1model program's job id (it holds 8 jobs) and the
#: egress rid's metadata name.  `workers` is not among them: its TNA action gives the worker's
#: bitmap bit, keyed by the worker id too, where bmv2's gives the worker id.
SHARED = (L2, REPLICA, *(lut(i) for i in range(LANES)), EVENTS)
#: counter array -> cells
TNA_COUNTERS = {EVENTS: EVENT_CELLS, EXTRA_EVENTS: EVENT_CELLS}
#: parser value set -> (member bits, size)
TNA_VALUE_SETS = {RECIRC_PORTS: (PORT_BITS, 4)}


def tna_entry(table: str, match: tuple, action: str, params: tuple, priority: int = 0) -> TableEntry:
    """A TableEntry of TNA_SCHEMA's `table` (entries.entry: exact values as ints, range values
    as (low, high), each checked against its width; range keys need a priority)."""
    return entry(table, match, action, params, schema=TNA_SCHEMA, priority=priority)


def pipe_writes(recirc_port: int, hosts: dict) -> list[tuple]:
    """What the pipe needs before any job: its recirculation port in the parser's value set
    (packets from it are in their second pass) and plain L2 forwarding ({mac: port})."""
    return ([("modify", ValueSet(RECIRC_PORTS, (_fit("recirculation port", recirc_port, PORT_BITS),)))]
            + [("insert", tna_entry(L2, (mac_int(mac),), f"{TING}.forward", (port,))) for mac, port in hosts.items()])


def tna_job_writes(job: JobConfig, ps_mac: str, nonce: int, recirc_port: int) -> list[tuple]:
    """Everything a job needs before its first registration (p4/tofino/README.md, "Control
    plane"): its `thc_job` and `job_size` entries, its worker id and slot ranges, T in every
    lane's lookup table, its multicast group (empty), the slot registers and the event
    counters zeroed."""
    check_shape(job)        # b = 4 and 8-bit lanes: n·g <= 255 keeps n below the program's 24 ranks
    n, q, s = job.num_workers, job.quorum_count, job.slots
    return ([("insert", tna_entry(JOB, (job.job_id, nonce), f"{TING}.set_job",
                                  (n, q, q << 24, mac_int(ps_mac), recirc_port))),
             ("insert", tna_entry(JOB_SIZE, (job.job_id, nonce, n), f"{TING}.n_matches", ())),
             ("insert", tna_entry(WORKER_RANGE, ((0, n - 1),), f"{TING}.worker_in_range", (), priority=1)),
             ("insert", tna_entry(SLOT_RANGE, (DATA, (0, s - 1)), f"{TING}.slot_in_range", (), priority=1)),
             ("insert", tna_entry(SLOT_RANGE, (NORM, (s, s + job.norm_slots - 1)), f"{TING}.slot_in_range", (),
                                  priority=1))]
            + [("insert", tna_entry(lut(lane), (z,), f"{TING}.set_v{lane}", (v,)))
               for lane in range(LANES) for z, v in enumerate(job.table)]
            + [("insert", McGroup(GROUP))]
            + [("modify", RegisterFill(r, 0)) for r in SLOT_REGISTERS]
            + [("modify", CounterCells(c, 0, cells)) for c, cells in TNA_COUNTERS.items()])


def replica_rid(rank: int) -> int:
    """The multicast replica id of a rank (rank + 1: the egress reads rid 0 as "not a replica")."""
    return rank + 1


def tna_worker_writes(w: WorkerPort, token: int, members: tuple) -> list[tuple]:
    """A registration: the `workers` entry (address, port, token, worker id → its bitmap bit),
    the group with the rank's replica added to `members` ((port, rid), ...) and its egress
    rewrite."""
    replica = (w.switch_port, replica_rid(w.worker_id))
    return [("insert", tna_entry(WORKERS, (ip_int(w.ip), w.udp_port, token, w.worker_id), f"{TING}.set_worker",
                                 (1 << w.worker_id,))),
            ("modify", McGroup(GROUP, tuple(sorted(set(members) | {replica})))),
            ("insert", tna_entry(REPLICA, (replica_rid(w.worker_id),), f"{TEGR}.set_dest",
                                 (mac_int(w.mac), ip_int(w.ip), w.udp_port)))]
