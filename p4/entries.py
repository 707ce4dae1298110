"""What the switch holds for a job, in P4Info names: the one description both control planes
(Thrift CLI text, P4Runtime messages: p4/control.py, p4/p4runtime.py) turn into writes.

`SCHEMA` names every table the control plane writes (its key fields, in key order, and the
actions it uses with their parameters, in declaration order, each with its bit width) as the
P4Info of p4/thc.p4 names them; `COUNTERS` and `REGISTERS` the counter and register arrays it
reads or resets; p4/tna_entries.py says the same for the Tofino program.  A test
(tests/p4/test_p4info_names.py) checks all of it against the P4Info p4c writes.  Values are
integers (MAC and IPv4 addresses too: `mac_int`, `ip_int`); each is checked against its
field's width here, before any backend sees it.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from thc_ps.p4.spec import EVENT_CELLS, LANES, MAX_JOBS, MAX_RANKS, SLOTS
from thc_ps.proto.job import JobConfig

ING, EGR = "ThcIngress", "ThcEgress"
CONFIG, WORKERS, L2, REPLICA = f"{ING}.thc_config", f"{ING}.workers", f"{ING}.l2", f"{EGR}.replica_dest"
EVENTS_COUNTER = f"{ING}.events"


def lut(lane: int) -> str:
    return f"{ING}.lut{lane}"


#: table -> (key fields [(name, bits)], {action: [(param, bits)]})
SCHEMA: dict = {
    CONFIG: ((("hdr.thc.job_id", 16),),
             {f"{ING}.set_config": (("nonce", 32), ("n", 8), ("quorum", 8), ("base", 16), ("data_slots", 16),
                                    ("norm_slots", 16), ("group", 16), ("event_base", 32), ("ps_mac", 48),
                                    ("epoch", 32))}),
    WORKERS: ((("hdr.thc.job_id", 16), ("hdr.ipv4.src", 32), ("hdr.udp.src_port", 16), ("hdr.thc.token", 32)),
              {f"{ING}.set_worker": (("wid", 8),)}),
    L2: ((("hdr.eth.dst", 48),), {f"{ING}.forward": (("port", 9),)}),
    REPLICA: ((("sm.egress_rid", 16),), {f"{EGR}.set_dest": (("mac", 48), ("ip", 32), ("port", 16))}),
    **{lut(i): ((("hdr.thc.job_id", 16), (f"hdr.idx.z{i}", 4)), {f"{ING}.set_v{i}": (("v", 8),)})
       for i in range(LANES)},
}
#: The THC tables (all but l2): what a control plane clears when it takes the switch over.
THC_TABLES = [t for t in SCHEMA if t != L2]
#: counter array -> cells: block 0 is what no job owns, block k the job in job cell k
COUNTERS = {EVENTS_COUNTER: (MAX_JOBS + 1) * EVENT_CELLS}
#: The per-slot registers (index: base + slot) -> cells.  `owner_reg` holds the epoch of the
#: job that last used a slot: a job's epoch is new, so its region reads as unused without any
#: register write (bmv2's P4Runtime server implements no register writes).
SLOT_REGISTERS = ("owner_reg", "round_reg", "count_reg", "bitmap_reg", "offset_reg", "prev_valid_reg",
                  "prev_count_reg", "prev_bitmap_reg", "prev_offset_reg")
REGISTERS = {f"{ING}.{r}": SLOTS for r in SLOT_REGISTERS} | {f"{ING}.norm_acc": 2 * SLOTS} | \
    {f"{ING}.acc{i}": 2 * SLOTS for i in range(LANES)}

def mac_int(mac: str) -> int:
    parts = mac.split(":")
    if len(parts) != 6:
        raise ValueError(f"not a MAC address: {mac!r}")
    return int("".join(parts), 16)


def ip_int(ip: str) -> int:
    return int(ipaddress.IPv4Address(ip))


def _fit(what: str, value: int, bits: int) -> int:
    if not 0 <= int(value) < 1 << bits:
        raise ValueError(f"{what} = {value} does not fit in {bits} bits")
    return int(value)


@dataclass(frozen=True)
class TableEntry:
    """A table entry: match and params as ((name, value), ...) in P4Info order; a range key's
    value is (low, high), and a table with one needs a `priority` (P4Runtime: > 0)."""

    table: str
    match: tuple
    action: str
    params: tuple
    priority: int = 0

    @property
    def key(self) -> tuple:
        """What identifies the entry in its table (a delete needs only this)."""
        return self.table, tuple(v for _, v in self.match)


def entry(table: str, match: tuple, action: str, params: tuple, *, schema: dict | None = None,
          priority: int = 0) -> TableEntry:
    """A TableEntry of `schema`'s `table` (SCHEMA unless said) with positional values, each
    checked against its width.  A key field is (name, bits) or (name, bits, kind); a range
    key's value is (low, high), and a table with one needs a priority (P4Runtime: > 0)."""
    keys, actions = (SCHEMA if schema is None else schema)[table]
    if action not in actions or len(match) != len(keys) or len(params) != len(actions[action]):
        raise ValueError(f"{table} takes {len(keys)} key values and action {', '.join(actions)}")
    values, ranged = [], False
    for (name, bits, *kind), v in zip(keys, match):
        if kind == ["range"]:
            ranged = True
            lo, hi = (_fit(f"{table} key {name}", x, bits) for x in v)
            if lo > hi:
                raise ValueError(f"{table} key {name}: empty range {lo}..{hi}")
            values.append((name, (lo, hi)))
        else:
            values.append((name, _fit(f"{table} key {name}", v, bits)))
    if ranged != (priority > 0):
        raise ValueError(f"{table}: a priority is needed with range keys and only then")
    return TableEntry(table, tuple(values), action,
                      tuple((p, _fit(f"{action} {p}", v, b)) for (p, b), v in zip(actions[action], params)), priority)


@dataclass(frozen=True)
class McGroup:
    """A multicast group of the packet replication engine: replicas ((egress port, rid), ...);
    the egress reads a replica's rid (P4Runtime's replica `instance`) as `egress_rid`."""

    group: int
    replicas: tuple = ()


@dataclass(frozen=True)
class CounterCells:
    """Cells first .. first + count - 1 of a counter array (zeroed when written)."""

    counter: str
    first: int
    count: int


@dataclass(frozen=True)
class ValueSet:
    """A parser value set's members, written whole (P4Runtime writes a value set by MODIFY)."""

    name: str
    members: tuple = ()


@dataclass(frozen=True)
class RegisterFill:
    """Every cell of a register array set to `value` (one wildcard P4Runtime write)."""

    register: str
    value: int = 0


@dataclass(frozen=True)
class WorkerPort:
    """Where a worker sits: its data address and the switch port/MAC that reach it."""

    worker_id: int
    ip: str
    udp_port: int
    mac: str
    switch_port: int


def rid(cell: int, rank: int) -> int:
    """The multicast replica id of `rank` of the job in job cell `cell` (cells start at 1, so
    no replica has rid 0, which the egress reads as "not a replica")."""
    return cell * MAX_RANKS + rank


def config_entry(job: JobConfig, ps_mac: str, nonce: int, base: int, cell: int, epoch: int) -> TableEntry:
    """The job's thc_config entry: job id → nonce, shape, region [base, base + slots +
    norm_slots) of the slot registers, multicast group and event counter block (both its job
    cell), and its epoch."""
    return entry(CONFIG, (job.job_id,), f"{ING}.set_config",
                 (nonce, job.num_workers, job.quorum_count, base, job.slots, job.norm_slots, cell,
                  cell * EVENT_CELLS, mac_int(ps_mac), epoch))


def lut_entries(job: JobConfig) -> list[TableEntry]:
    """The job's table T in every lane's lookup table, keyed by (job id, index)."""
    return [entry(lut(lane), (job.job_id, z), f"{ING}.set_v{lane}", (v,))
            for lane in range(LANES) for z, v in enumerate(job.table)]


def check_shape(job: JobConfig) -> None:
    """Refuse a job the switch program cannot aggregate, naming what differs."""
    if job.elems_per_packet != LANES or job.lane_bits != 8 or job.bits != 4 or job.codec != "thc":
        raise ValueError(f"the switch aggregates codec thc with b=4, 8-bit lanes and {LANES} elements per "
                         f"packet; this job has codec {job.codec}, b={job.bits}, {job.lane_bits}-bit lanes, "
                         f"{job.elems_per_packet} elements per packet")
    if job.num_workers > MAX_RANKS:
        raise ValueError(f"the switch serves at most {MAX_RANKS} ranks per job (its contributor bitmap)")


def job_writes(job: JobConfig, ps_mac: str, nonce: int = 0, base: int = 0, cell: int = 1,
               epoch: int = 1) -> list[tuple]:
    """Everything a job needs before its first registration, as (op, item): its thc_config
    entry, its lookup table in every lane, its (empty) multicast group and its counter block
    zeroed.  Its region needs no write: the epoch makes it unused to the job."""
    check_shape(job)
    return ([("insert", config_entry(job, ps_mac, nonce, base, cell, epoch))]
            + [("insert", e) for e in lut_entries(job)]
            + [("insert", McGroup(cell)), ("modify", counter_block(cell))])


def counter_block(cell: int) -> CounterCells:
    """A job cell's event counters (cell 0: what no job owns)."""
    return CounterCells(EVENTS_COUNTER, cell * EVENT_CELLS, EVENT_CELLS)


def worker_entry(w: WorkerPort, token: int, job_id: int = 1) -> TableEntry:
    """The data-plane half of a registration: (job, source address, port, token) → rank."""
    return entry(WORKERS, (job_id, ip_int(w.ip), w.udp_port, token), f"{ING}.set_worker", (w.worker_id,))


def replica_entry(w: WorkerPort, cell: int = 1) -> TableEntry:
    """The egress rewrite of the rank's multicast replica: its MAC, address and port."""
    return entry(REPLICA, (rid(cell, w.worker_id),), f"{EGR}.set_dest", (mac_int(w.mac), ip_int(w.ip), w.udp_port))


def l2_entries(hosts: dict) -> list[TableEntry]:
    """Plain forwarding of non-THC traffic: {mac: switch port}."""
    return [entry(L2, (mac_int(mac),), f"{ING}.forward", (port,)) for mac, port in hosts.items()]


def undo(op: str, item, before=None) -> tuple | None:
    """The write that takes back (op, item): an insert's delete, a group's previous members
    (`before`, or its delete when it had none before); None when nothing is to undo."""
    if op == "insert":
        return "delete", item
    if op == "modify" and isinstance(item, McGroup):
        return ("modify", before) if before is not None else ("delete", McGroup(item.group))
    return None


def describe(item) -> str:
    """One line naming a write's target, for errors."""
    if isinstance(item, TableEntry):
        match = ", ".join(f"{k}={v}" for k, v in item.match)
        return f"table {item.table} entry ({match})" + (f" -> {item.action}" if item.action else "")
    if isinstance(item, McGroup):
        return f"multicast group {item.group} ({len(item.replicas)} replicas)"
    if isinstance(item, ValueSet):
        return f"value set {item.name} {list(item.members)}"
    if isinstance(item, RegisterFill):
        return f"register {item.register} (every cell = {item.value})"
    return f"counter {item.counter} cells {item.first}..{item.first + item.count - 1}"
