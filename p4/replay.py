"""p4testgen's tests of the switch programs replayed against the software PS (the twin,
ps_server/reference.py).

Each generated test (p4/testgen.py) is mapped to the switch's job: its entries to a
JobConfig, the job's nonce, its registrations and its lookup values — or the test is set
aside, naming the entry no job writes (an epoch 0, a worker id ≥ n, two lanes disagreeing on
T, ...).  For the Tofino program its register initial values become the slot's state (round,
offset, contributors, kept results) — or the test is set aside, naming the state no packet
sequence reaches.  Its input packet is then fed to the twin in that state, and the twin's
answer, put in the switch's envelope (docs/p4.md, "Pipeline", step 6: addresses swapped, lengths and
the IPv4 checksum fixed, UDP checksum 0), is compared field by field with p4testgen's
expected output under its care mask.  Traffic that is not THC is checked against the L2 rule
(forwarded to the port the `l2` entry names, else dropped).

The Tofino program answers in two passes (p4/tofino/README.md).  A test entering on a
normal port is pass 1: its expected output is what pass 1 must tell pass 2 — the bridge
header in front of the frame, on the job's recirculation port — derived from the twin's
state before and after the packet (a new round, the current one with its contributors, the
previous one), or pass 1's own answer (a drop, a STRAGGLER).  A test entering on
thc_ps.p4.testgen.TESTGEN_RECIRC_PORT is pass 2: the bridge and the lane and shadow registers say
what pass 1 found, the twin is put in a state where pass 1 finds exactly that, and its
answer is compared.  Fields the twin does not determine (the arrival bit of a sender that
came late, the offset beside an empty shadow copy) are masked, never guessed.

Outcomes: `match`; `set aside` (with the reason); `unmodeled` — p4testgen expects a drop
where the twin completes the round and the program multicasts the result, which p4testgen
does not model (p4/testgen.py); `diverged`, with the fields that differ.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from thc_ps.p4.control import switch_job
from thc_ps.p4.spec import LANES, MAX_JOBS, SLOTS
from thc_ps.p4.testgen import TESTGEN_RECIRC_PORT, GenTest, target
from thc_ps.proto import headers as H
from thc_ps.proto.packing import unpack_indices
from thc_ps.ps_server.reference import DROP_REASONS, ReferencePS

M32 = 0xFFFFFFFF
ONE = 1 << 24                   # one contributor in the Tofino program's count << 24 | bitmap word
TNA_MAX_RANKS = 24              # that word's bitmap
MIN_G = 15                      # a 4-bit THC table's granularity is at least 2^b − 1
EVENT_CELLS = 16

MATCH, SET_ASIDE, UNMODELED, DIVERGED = "match", "set aside", "unmodeled", "diverged"

# ---------------------------------------------------------------------------- frames

ETH = (("eth.dst", 48), ("eth.src", 48), ("eth.type", 16))
IPV4 = (("ipv4.version", 4), ("ipv4.ihl", 4), ("ipv4.diffserv", 8), ("ipv4.total_len", 16),
        ("ipv4.identification", 16), ("ipv4.flags", 3), ("ipv4.frag_offset", 13), ("ipv4.ttl", 8),
        ("ipv4.protocol", 8), ("ipv4.checksum", 16), ("ipv4.src", 32), ("ipv4.dst", 32))
UDP = (("udp.src_port", 16), ("udp.dst_port", 16), ("udp.length", 16), ("udp.checksum", 16))
THC = tuple((f"thc.{name}", 8 * size) for name, size in H.FIELDS)
#: The Tofino program's bridge header (p4/templates/tna/metadata.p4), 24 bytes.
BRIDGE = (("bridge.pass2", 8), ("bridge.kind", 8), ("bridge.pad", 7), ("bridge.port", 9), ("bridge.me", 32),
          ("bridge.cb", 32), ("bridge.seen", 32), ("bridge.shadow_cb", 32), ("bridge.off_old", 32))
BRIDGE_BYTES = sum(w for _, w in BRIDGE) // 8
K_NONE, K_FIRST, K_SAME, K_PREV = 0, 1, 2, 3
ETH_IPV4, IP_UDP = 0x0800, 17
IP_AT, UDP_AT, THC_AT = 14, 34, 42
PAYLOAD_AT = THC_AT + H.HEADER_SIZE
IDX_BYTES, NORM_BYTES = LANES // 2, 4


def layout(frame: bytes, bridge: bool = False) -> list[tuple]:
    """(name, bit offset, width) of the frame's fields as the switch's parser sees them (a
    20-byte IPv4 header; THC when either UDP port is the PS's), then its other bytes."""
    fields, at = [], 0

    def add(group):
        nonlocal at
        for name, width in group:
            fields.append((name, at, width))
            at += width

    if bridge:
        add(BRIDGE)
    base = at // 8
    n = len(frame) - base
    if n >= 14:
        add(ETH)
        if int.from_bytes(frame[base + 12:base + 14], "big") == ETH_IPV4 and n >= UDP_AT:
            add(IPV4)
            if frame[base + 23] == IP_UDP and n >= THC_AT:
                add(UDP)
                ports = (int.from_bytes(frame[base + 34:base + 36], "big"),
                         int.from_bytes(frame[base + 36:base + 38], "big"))
                if H_PORT in ports and n >= PAYLOAD_AT:
                    add(THC)
    fields += [(f"byte[{i}]", 8 * i, 8) for i in range(at // 8, len(frame))]
    return fields


H_PORT = 9000


def _bits(frame: bytes, at: int, width: int) -> int:
    first, last = at // 8, (at + width + 7) // 8
    value = int.from_bytes(frame[first:last], "big")
    return (value >> (8 * (last - first) * 1 - (at - 8 * first) - width)) & ((1 << width) - 1)


def compare(switch: bytes, care: bytes | None, twin: bytes, bridge: bool = False) -> list[str]:
    """The fields where p4testgen's expected frame (`switch`, checked where `care` has 1
    bits) and the twin's frame differ: 'thc.round: switch 5, twin 6'."""
    care = care if care is not None else b"\xff" * len(switch)
    if len(switch) != len(twin):
        diffs = [f"length: switch {len(switch)} bytes, twin {len(twin)}"]
        n = min(len(switch), len(twin))
        switch, twin, care = switch[:n], twin[:n], care[:n]
    else:
        diffs = []
    for name, at, width in layout(twin, bridge):
        mask = _bits(care, at, width)
        a, b = _bits(switch, at, width) & mask, _bits(twin, at, width) & mask
        if a != b:
            diffs.append(f"{name}: switch {a:#x}, twin {b:#x}")
    return diffs


def ipv4_checksum(header: bytes) -> int:
    """The IPv4 header checksum over a 20-byte header whose checksum field is zero."""
    s = sum(int.from_bytes(header[i:i + 2], "big") for i in range(0, 20, 2))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def fix_checksum(frame: bytes) -> bytes:
    """The frame with the checksum the switch's deparser writes into a parsed IPv4 header."""
    if len(frame) < UDP_AT or int.from_bytes(frame[12:14], "big") != ETH_IPV4:
        return frame
    ip = bytearray(frame[IP_AT:UDP_AT])
    ip[10:12] = b"\0\0"
    ip[10:12] = ipv4_checksum(bytes(ip)).to_bytes(2, "big")
    return frame[:IP_AT] + bytes(ip) + frame[UDP_AT:]


def is_thc(frame: bytes) -> bool:
    """Whether the frame is the PS's traffic: UDP to its port (whatever the IPv4 destination:
    the switch claims the port).  A datagram too short for the THC header is the PS's too,
    which counts it malformed."""
    return (len(frame) >= THC_AT and int.from_bytes(frame[12:14], "big") == ETH_IPV4
            and frame[23] == IP_UDP and int.from_bytes(frame[36:38], "big") == H_PORT)


def datagram(frame: bytes) -> bytes:
    """The UDP payload as the switch parses the frame: udp.length − 8 bytes after a 20-byte
    IPv4 header (what the PS's socket would be handed)."""
    length = int.from_bytes(frame[38:40], "big")
    return bytes(frame[THC_AT:THC_AT + max(length - 8, 0)])


def parsed_payload(frame: bytes) -> int:
    """The bytes the switch's parser takes after the THC header: 16 indices or one norm."""
    kind = frame[THC_AT + 3]
    return IDX_BYTES if kind == H.DATA else NORM_BYTES if kind == H.NORM else 0


def bounce(frame: bytes, reply: bytes) -> bytes:
    """The switch's unicast reply to the sender: the datagram `reply` in the input frame's
    envelope with MAC, IPv4 and UDP source and destination swapped, the lengths moved by the
    datagram's change, the IPv4 checksum recomputed and the UDP checksum zero, followed by
    whatever the input carried after the part the parser took."""
    eth, ip, udp = frame[:IP_AT], bytearray(frame[IP_AT:UDP_AT]), frame[UDP_AT:THC_AT]
    taken = PAYLOAD_AT + parsed_payload(frame)
    grow = len(reply) - (taken - THC_AT)
    ip[2:4] = ((int.from_bytes(ip[2:4], "big") + grow) & 0xFFFF).to_bytes(2, "big")
    ip[12:16], ip[16:20] = frame[IP_AT + 16:IP_AT + 20], frame[IP_AT + 12:IP_AT + 16]
    ip[10:12] = b"\0\0"
    ip[10:12] = ipv4_checksum(bytes(ip)).to_bytes(2, "big")
    udp_len = (int.from_bytes(udp[4:6], "big") + grow) & 0xFFFF
    return (eth[6:12] + eth[0:6] + eth[12:14] + bytes(ip) + udp[2:4] + udp[0:2] + udp_len.to_bytes(2, "big")
            + b"\0\0" + reply + frame[taken:])


def fan_out(frame: bytes, reply: bytes, ps_mac: int, dest: tuple) -> bytes:
    """One multicast replica of the round's result as the switch sends it to a worker
    (`dest` = its MAC, IPv4 address and UDP port, the egress's replica_dest rewrite): the
    PS's MAC, address and port as the source, lengths and the IPv4 checksum as for a reply."""
    mac, ip, port = dest
    out = bytearray(bounce(frame, reply))
    out[0:6], out[6:12] = mac.to_bytes(6, "big"), ps_mac.to_bytes(6, "big")
    out[IP_AT + 12:IP_AT + 16] = frame[IP_AT + 16:IP_AT + 20]
    out[IP_AT + 16:IP_AT + 20] = bytes(int(x) for x in ip.split("."))
    out[UDP_AT:UDP_AT + 2], out[UDP_AT + 2:UDP_AT + 4] = frame[UDP_AT + 2:UDP_AT + 4], port.to_bytes(2, "big")
    return bytes(fix_checksum(bytes(out)))


def bridge_bytes(values: dict) -> bytes:
    """The bridge header with `values` ({field: int}, the others 0)."""
    word = 0
    for name, width in BRIDGE:
        word = (word << width) | (values.get(name.partition(".")[2], 0) & ((1 << width) - 1))
    return word.to_bytes(BRIDGE_BYTES, "big")


def bridge_fields(frame: bytes) -> dict:
    out, at = {}, 0
    for name, width in BRIDGE:
        out[name.partition(".")[2]] = _bits(frame, at, width)
        at += width
    return out


def bridge_care(masked: tuple) -> bytes:
    """A care mask over the bridge header with the named fields not checked."""
    word = 0
    for name, width in BRIDGE:
        word = (word << width) | (0 if name.partition(".")[2] in masked else (1 << width) - 1)
    return word.to_bytes(BRIDGE_BYTES, "big")


# ---------------------------------------------------------------------------- outcomes

@dataclass
class Outcome:
    """One test's replay: its verdict, what the twin did and why (set aside, unmodeled) or
    where it differs (diverged)."""

    test: str
    verdict: str
    what: str = ""
    reason: str = ""
    diffs: tuple = ()

    def line(self) -> str:
        tail = self.reason or "; ".join(self.diffs)
        return f"{self.test}: {self.verdict}" + (f" ({self.what})" if self.what else "") + (f": {tail}" if tail else "")


class SetAside(Exception):
    """A test whose entries no job writes or whose state no packet sequence reaches."""


@dataclass
class Job:
    """What the entries say of one job: enough to build the twin."""

    job_id: int
    nonce: int
    n: int
    quorum: int
    slots: int = 1
    norm_slots: int = 1
    ps_mac: int = 0
    recirc_port: int = 0
    table: dict = field(default_factory=dict)       # index -> value, from the lookup tables
    workers: dict = field(default_factory=dict)     # worker id -> (ip, port, token)


def _ip(value: int) -> str:
    return ".".join(str(value >> s & 0xFF) for s in (24, 16, 8, 0))


def lookup_table(test: GenTest, keyed_by_job: int | None) -> dict:
    """T from the lane lookup tables' entries {index: value}, or SetAside when two lanes
    disagree (a job writes one T into every lane) or an entry's action is not the lane's."""
    table: dict = {}
    for e in test.entries:
        name = e.table.rpartition(".")[2]
        if not name.startswith("lut"):
            continue
        lane = int(name[3:])
        z = e.key(f"idx.z{lane}")
        job = e.key("thc.job_id")
        if e.default or z is None or z.kind != "exact":
            raise SetAside(f"{e.table}: an entry no job writes ({'default action' if e.default else 'key'})")
        if keyed_by_job is not None and job is not None and job.value != keyed_by_job:
            continue
        if not e.action.endswith(f"set_v{lane}"):
            raise SetAside(f"{e.table}: action {e.action} (a job writes set_v{lane} for all 16 indices)")
        v = e.param("v")
        if table.setdefault(z.value, v) != v:
            raise SetAside(f"lookup tables disagree on index {z.value}: {table[z.value]} and {v} "
                           f"(a job writes one T into every lane)")
    return table


def check_misses(test: GenTest, frame: bytes, table: dict, lanes_of) -> dict:
    """T completed by the lanes that missed: a miss leaves the lane's value 0, which is T[z] = 0
    for the twin; SetAside when a hit elsewhere gave that index another value."""
    hit = {int(e.table.rpartition(".")[2][3:]) for e in test.entries if e.table.rpartition(".")[2].startswith("lut")}
    for lane, z in enumerate(lanes_of(frame)):
        if lane not in hit and table.setdefault(int(z), 0) != 0:
            raise SetAside(f"lane {lane}'s lookup missed index {z}, which another lane maps to {table[int(z)]}")
    return table


def indices(frame: bytes, at: int = PAYLOAD_AT) -> np.ndarray:
    return unpack_indices(bytes(frame[at:at + IDX_BYTES]), 4, LANES)


def make_twin(job: Job, twin=ReferencePS):
    """The twin of `job`: a ReferencePS with the job's shape, its lookup values and its
    registrations; SetAside when no JobConfig has that shape."""
    if not 1 <= job.n <= H.MAX_WORKERS:
        raise SetAside(f"n = {job.n}: a job has 1..{H.MAX_WORKERS} workers")
    if not 1 <= job.quorum <= job.n:
        raise SetAside(f"quorum = {job.quorum} for n = {job.n}: a job's quorum is ⌈q·n⌉ in 1..n")
    g = min(30, 255 // job.n)
    if g < MIN_G:
        raise SetAside(f"n = {job.n}: a 4-bit THC job with 8-bit lanes has n·g ≤ 255 and g ≥ {MIN_G}, "
                       f"so n ≤ {255 // MIN_G}")
    try:
        cfg = switch_job(job.n, granularity=g, quorum=job.quorum / job.n, slots=job.slots,
                         norm_slots=job.norm_slots, job_id=job.job_id)
    except ValueError as exc:
        raise SetAside(f"no job has this shape: {exc}") from None
    if cfg.quorum_count != job.quorum:
        raise SetAside(f"quorum {job.quorum} of {job.n} is not ⌈q·n⌉ for any q")
    ps = twin(cfg, job.nonce)
    ps.table = np.array([job.table.get(z, 0) for z in range(1 << cfg.bits)], dtype=np.int64)
    for wid, (ip, port, token) in job.workers.items():
        ps.register(wid, ip, port, token)
    return ps


def twin_step(ps, dgram: bytes, src: tuple) -> tuple[list, str | None]:
    """The twin's outputs for one datagram and the drop reason it counted (None: none)."""
    before = dict(ps.stats.drops)
    out = ps.process(dgram, src)
    reasons = [r for r in DROP_REASONS if ps.stats.drops[r] != before[r]]
    return out, reasons[0] if reasons else None


def _src(frame: bytes) -> tuple:
    return _ip(int.from_bytes(frame[26:30], "big")), int.from_bytes(frame[34:36], "big")


def multicasts(test: GenTest) -> bool:
    """Whether the path p4testgen took sets a multicast group (its trace records every
    assignment): the packet p4testgen then drops or sends by its unicast port only."""
    return any(line.startswith("[AssignmentStatement]") and "mcast_grp" in line for line in test.trace)


def _judge(test: GenTest, what: str, want: tuple | None, multicast: bool, bridge: bool = False) -> Outcome:
    """Compare p4testgen's expectation with the twin's (port, frame, care) or None;
    `multicast`: the twin sends the round's result to every worker.  That is `unmodeled` only
    when the trace shows the program setting the multicast group too."""
    got = (test.out_port, test.expected) if test.expected is not None else None
    if multicasts(test) != multicast:
        return Outcome(test.name, DIVERGED, what, diffs=(
            "switch multicasts, twin does not" if multicast is False else
            "twin sends the round's result to every worker, switch sets no multicast group",))
    if got is None and want is None and not multicast:
        return Outcome(test.name, MATCH, what)
    if got is None and multicast:
        return Outcome(test.name, UNMODELED, what, "the program multicasts the completed round's result; "
                       "p4testgen drops a multicast packet")
    if got is None:
        return Outcome(test.name, DIVERGED, what, diffs=(f"switch drops; twin sends to port {want[0]}",))
    if want is None:
        return Outcome(test.name, DIVERGED, what, diffs=(f"switch sends to port {got[0]}; twin drops",))
    diffs = [] if got[0] == want[0] else [f"port: switch {got[0]}, twin {want[0]}"]
    care = bytearray(test.care or b"\xff" * len(test.expected))
    for i, m in enumerate(want[2] or b""):
        if i < len(care):
            care[i] &= m
    diffs += compare(test.expected, bytes(care), want[1], bridge)
    return Outcome(test.name, DIVERGED if diffs else MATCH, what, diffs=tuple(diffs))


#: The egress port that drops a packet, in bmv2's v1model and in p4testgen's Tofino model.
DROP_PORT = 511


def _acting(test: GenTest, table: str, default: str) -> list:
    """The table's entries but those whose action is the table's default action: such an
    entry does what a miss does (no job writes one; p4testgen does)."""
    return [e for e in test.table(table) if e.default or not e.action.endswith(default)]


def _l2(test: GenTest, frame: bytes, table: str) -> tuple | None:
    """The L2 rule: forwarded unchanged (its IPv4 checksum as the deparser writes it) to the
    port the l2 entry names, dropped without one or when that port is DROP_PORT."""
    for e in test.table(table):
        k = e.key("eth.dst")
        if k is not None and k.matches(int.from_bytes(frame[:6], "big")) and e.action.endswith("forward"):
            port = e.param("port")
            return None if port == DROP_PORT else (port, fix_checksum(frame), None)
    return None


# ---------------------------------------------------------------------------- bmv2 (v1model)

def bmv2_jobs(test: GenTest) -> dict:
    """{job id: Job} from thc_config, workers and the lookup tables (SetAside: an entry no
    job writes)."""
    jobs, regions = {}, []
    for e in _acting(test, "thc_config", "NoAction"):
        if e.default or not e.action.endswith("set_config"):
            raise SetAside(f"thc_config: {'default action' if e.default else 'action'} {e.action} "
                           f"(a job's entry is set_config)")
        jid = e.key("thc.job_id").value
        p = dict(e.params)
        if p["epoch"] == 0:
            raise SetAside("thc_config: epoch 0 (SwitchEngine numbers epochs from 1: 0 is every unused slot's)")
        if not 1 <= p["group"] <= MAX_JOBS or p["event_base"] != p["group"] * EVENT_CELLS:
            raise SetAside(f"thc_config: group {p['group']}, event base {p['event_base']} (a job in cell c "
                           f"has group c in 1..{MAX_JOBS} and event base 16·c)")
        if p["data_slots"] < 1 or p["norm_slots"] < 1 or p["base"] + p["data_slots"] + p["norm_slots"] > SLOTS:
            raise SetAside(f"thc_config: region {p['base']} + {p['data_slots']} + {p['norm_slots']} "
                           f"(a job's slots lie in the program's {SLOTS})")
        region = (p["base"], p["base"] + p["data_slots"] + p["norm_slots"])
        if any(a < region[1] and region[0] < b for a, b in regions):
            raise SetAside("thc_config: two jobs' regions overlap")
        regions.append(region)
        jobs[jid] = Job(jid, p["nonce"], p["n"], p["quorum"], p["data_slots"], p["norm_slots"], p["ps_mac"])
    for e in test.table("workers"):
        jid = e.key("thc.job_id").value
        if e.default or not e.action.endswith("set_worker"):
            raise SetAside(f"workers: {'default action' if e.default else 'action'} {e.action} "
                           f"(a registration is set_worker)")
        job = jobs.get(jid)
        if job is None:
            raise SetAside(f"workers: a registration for job {jid}, which has no thc_config entry")
        wid = e.param("wid")
        if wid >= job.n:
            raise SetAside(f"workers: worker id {wid} ≥ n = {job.n} (a job registers ranks below n)")
        addr = (_ip(e.key("ipv4.src").value), e.key("udp.src_port").value, e.key("thc.token").value)
        if job.workers.setdefault(wid, addr) != addr:
            raise SetAside(f"workers: rank {wid} registered twice")
    for jid, job in jobs.items():
        job.table = lookup_table(test, jid)
    return jobs


def bmv2_round(test: GenTest, twin=ReferencePS) -> tuple | None:
    """For a test whose packet completes its job's round on the twin: (job cell, PS MAC,
    [(worker id, ip, port)] registered, {(ip, port): the twin's RESULT to it}); else None."""
    frame = test.packet
    try:
        jobs = bmv2_jobs(test)
        if not is_thc(frame) or len(frame) < PAYLOAD_AT + IDX_BYTES:
            return None
        job = jobs.get(int.from_bytes(frame[THC_AT + 8:THC_AT + 10], "big"))
        if job is None:
            return None
        job.table = check_misses(test, frame, job.table, indices)
        ps = make_twin(job, twin)
    except SetAside:
        return None
    out, _ = twin_step(ps, datagram(frame), _src(frame))
    if not out or H.parse(out[0][0])[0].flags & H.F_RESENT or H.parse(out[0][0])[0].type == H.STRAGGLER:
        return None
    config = next(e for e in _acting(test, "thc_config", "NoAction") if e.key("thc.job_id").value == job.job_id)
    workers = [(wid, ip, port) for wid, (ip, port, _) in sorted(job.workers.items())]
    return config.param("group"), job.ps_mac, workers, {addr: dg for dg, addr in out}


def replay_bmv2(test: GenTest, twin=ReferencePS) -> Outcome:
    frame = test.packet
    try:
        jobs = bmv2_jobs(test)
        if not is_thc(frame):
            return _judge(test, "not THC: L2", _l2(test, frame, "l2"), False)
        if len(frame) < PAYLOAD_AT:
            return _judge(test, "dropped: malformed (shorter than the THC header)", None, False)
        job = jobs.get(int.from_bytes(frame[THC_AT + 8:THC_AT + 10], "big"))
        if job is None:
            return _judge(test, "THC, no such job: dropped", None, False)
        if frame[THC_AT + 3] == H.DATA and len(frame) >= PAYLOAD_AT + IDX_BYTES:
            job.table = check_misses(test, frame, job.table, indices)
        ps = make_twin(job, twin)
    except SetAside as why:
        return Outcome(test.name, SET_ASIDE, reason=str(why))
    out, reason = twin_step(ps, datagram(frame), _src(frame))
    return _answer(test, frame, out, reason)


def _answer(test: GenTest, frame: bytes, out: list, reason: str | None, port: int | None = None) -> Outcome:
    """Judge the twin's final answer to a THC packet (`frame`: without a bridge header): a
    drop, the round's result to every worker (multicast), or a reply to the sender out of
    `port` (default: the port the test's packet came in on)."""
    if not out:
        return _judge(test, f"dropped: {reason}" if reason else "aggregated", None, False)
    reply = H.parse(out[0][0])[0]
    if reply.type in (H.RESULT, H.NORM_RESULT) and not reply.flags & H.F_RESENT:
        return _judge(test, "round completed: RESULT to every worker", None, True)
    what = ("STRAGGLER" if reply.type == H.STRAGGLER else "late: RESULT resent" if reason == "late"
            else "RESULT resent")
    return _judge(test, what, (test.in_port if port is None else port, bounce(frame, out[0][0]), None), False)


# ---------------------------------------------------------------------------- Tofino (TNA)

def tna_job(test: GenTest, frame: bytes, pass2: bool = False) -> Job | None:
    """The job from thc_job, job_size, worker_range, slot_range and workers — the entries the
    path hit; a table pass 1 applied and missed constrains the job to miss too.  None when
    thc_job has no entry for the packet's job id and nonce."""
    h = H.Header(**_thc_fields(frame)) if len(frame) >= PAYLOAD_AT else None
    jobs = [e for e in _acting(test, "thc_job", "no_job")
            if e.default or h is None or (e.key("thc.job_id").matches(h.job_id) and e.key("thc.nonce").matches(h.nonce))]
    if len(jobs) > 1:
        raise SetAside("thc_job: two entries (the program holds one job)")
    if not jobs:
        if not pass2 and any(h is None or e.key("thc.job_id").matches(h.job_id) for e in test.table("job_size")):
            raise SetAside("entries of a job without its thc_job entry")
        return None
    e = jobs[0]
    if e.default or not e.action.endswith("set_job"):
        raise SetAside(f"thc_job: {'default action' if e.default else 'action'} {e.action} (a job's entry is set_job)")
    p = dict(e.params)
    if p["quorum_cb"] != p["quorum"] << 24:
        raise SetAside(f"thc_job: quorum_cb {p['quorum_cb']:#x} ≠ quorum {p['quorum']} << 24")
    if p["n"] > TNA_MAX_RANKS:
        raise SetAside(f"thc_job: n = {p['n']} > {TNA_MAX_RANKS} (the program's contributor bitmap)")
    job = Job(e.key("thc.job_id").value, e.key("thc.nonce").value, p["n"], p["quorum"], ps_mac=p["ps_mac"],
              recirc_port=p["recirc_port"])
    job.table = lookup_table(test, None)
    if pass2:
        return job
    for s in test.table("job_size"):
        if s.default or not s.action.endswith("n_matches") or s.key("thc.num_workers").value != job.n \
                or s.key("thc.job_id").value != job.job_id or s.key("thc.nonce").value != job.nonce:
            raise SetAside("job_size: an entry other than (job id, nonce, n) → n_matches")
    if h is not None and not test.table("job_size") and h.num_workers == job.n:
        raise SetAside("job_size missed a packet stating the job's n (a job writes that entry)")
    for r in test.table("worker_range"):
        k = r.key("thc.worker_id")
        if r.default or not r.action.endswith("worker_in_range") or (k.value, k.high) != (0, job.n - 1):
            raise SetAside("worker_range: an entry other than [0, n − 1] → worker_in_range")
    if h is not None and not test.table("worker_range") and h.worker_id < job.n:
        raise SetAside("worker_range missed a worker id below n (a job writes [0, n − 1])")
    job.slots, job.norm_slots = _slot_ranges(test, h)
    for w in test.table("workers"):
        wid = w.key("thc.worker_id").value
        if w.default or not w.action.endswith("set_worker") or w.param("me") != 1 << wid or wid >= job.n:
            raise SetAside("workers: an entry other than (address, port, token, worker id < n) → set_worker(1 << id)")
        job.workers[wid] = (_ip(w.key("ipv4.src").value), w.key("udp.src_port").value, w.key("thc.token").value)
    return job


def _slot_ranges(test: GenTest, h) -> tuple[int, int]:
    """(slots, norm slots) of a job whose slot_range entries are those of the test: (DATA,
    [0, S − 1]) and (NORM, [S, S + N − 1]); a table the packet missed must miss for the job."""
    data = norm = None
    for e in test.table("slot_range"):
        t, k = e.key("thc.type"), e.key("thc.slot")
        if e.default or not e.action.endswith("slot_in_range") or t is None or k is None:
            raise SetAside("slot_range: an entry other than (type, range) → slot_in_range")
        if t.value == H.DATA and k.value == 0:
            data = k.high + 1
        elif t.value == H.NORM and k.value >= 1:
            norm = (k.value, k.high - k.value + 1)
        else:
            raise SetAside(f"slot_range: (type {t.value}, [{k.value}, {k.high}]) is no job's "
                           f"(DATA: [0, S − 1], NORM: [S, S + N − 1])")
    if data is not None and norm is not None and norm[0] != data:
        raise SetAside("slot_range: the norm slots do not follow the data slots")
    slots = data if data is not None else norm[0] if norm is not None else None
    norm_slots = norm[1] if norm is not None else 1
    if h is not None and (data is None and h.type == H.DATA or norm is None and h.type == H.NORM):
        # the packet's slot must miss: choose the other range around it
        if h.type == H.DATA:
            if h.slot == 0:
                raise SetAside("slot_range missed DATA slot 0 (every job has it)")
            slots = min(slots or h.slot, h.slot)
        elif slots is None:
            slots = h.slot + 1
        elif slots <= h.slot < slots + norm_slots:
            raise SetAside("slot_range missed a NORM slot in the job's norm range")
    if slots is None:
        slots = 1
    if slots + norm_slots > 0xFFFF:
        raise SetAside("slot ranges beyond the 16-bit slot field")
    return slots, norm_slots


def _thc_fields(frame: bytes, at: int = THC_AT) -> dict:
    vals = struct.unpack(H.HEADER_FMT, bytes(frame[at:at + H.HEADER_SIZE]))
    return {name: v for (name, _), v in zip(H.FIELDS, vals) if name != "reserved"}


def _popcount(x: int) -> int:
    return bin(x).count("1")


def _contributors(word: int, job: Job, what: str) -> tuple[int, int]:
    """(count, bitmap) of a count << 24 | bitmap word, or SetAside when no round has it."""
    count, bitmap = word >> 24, word & (ONE - 1)
    if count < 1 or count != _popcount(bitmap) or bitmap >> job.n or count > job.n:
        raise SetAside(f"{what} {word:#010x}: no round has {count} contributors with bitmap {bitmap:#x} "
                       f"(n = {job.n})")
    return count, bitmap


def _lanes(test: GenTest, bank: int, norm: bool) -> list:
    """The lane sums of a bank from the lane registers' initial values (Tofino: four 8-bit
    lanes per 32-bit word, big-endian; norm: one 32-bit value)."""
    if norm:
        return [test.register("norm_acc").get(bank, 0)]
    lanes = []
    for w in range(LANES // 4):
        word = test.register(f"acc{w}").get(bank, 0)
        lanes += [word >> s & 0xFF for s in (24, 16, 8, 0)]
    return lanes


def replay_tna(test: GenTest, twin=ReferencePS) -> Outcome:
    pass2 = test.in_port == TESTGEN_RECIRC_PORT
    frame = test.packet[BRIDGE_BYTES:] if pass2 else test.packet
    try:
        if pass2 and len(test.packet) < BRIDGE_BYTES:
            raise SetAside("a frame shorter than the bridge header on the recirculation port")
        if not is_thc(frame):
            if pass2:
                raise SetAside("pass 2 of a frame pass 1 never recirculates (not THC)")
            return _judge(test, "not THC: L2", _l2(test, frame, "l2"), False)
        if len(frame) < PAYLOAD_AT:
            if pass2:
                raise SetAside("pass 2 of a frame pass 1 never recirculates (no THC header)")
            return _judge(test, "dropped: malformed (shorter than the THC header)", None, False)
        job = tna_job(test, frame, pass2)
        if job is None:
            # pass 2 of a job removed since pass 1: dropped, as the PS drops an ended job's packet
            return _judge(test, "pass 2, no such job: dropped" if pass2 else "THC, no such job: dropped", None, False)
        if frame[THC_AT + 3] == H.DATA and len(frame) >= PAYLOAD_AT + IDX_BYTES:
            job.table = check_misses(test, frame, job.table, indices)
        if pass2:
            return _tna_pass2(test, frame, job, twin)
        return _tna_pass1(test, frame, job, twin)
    except SetAside as why:
        return Outcome(test.name, SET_ASIDE, reason=str(why))


def _state(test: GenTest, job: Job, h: H.Header):
    """The slot's state from pass 1's registers: None (unused) or (round, offset, count,
    bitmap, arrived); a register the path did not read is None."""
    s = h.slot
    last = test.register("round_reg").get(s)
    if last is None or last == 0:
        return None
    offset = test.register("offset_reg").get(s)
    arrived = test.register("arrived_reg").get(s)
    word = test.register("contrib_reg").get(s)
    count = bitmap = None
    if word is not None:
        count, bitmap = _contributors(word, job, "contrib_reg")
        if arrived is not None and (arrived & bitmap != bitmap or arrived >> job.n
                                    or (count < job.quorum and arrived != bitmap)):
            raise SetAside(f"arrived_reg {arrived:#x} with contributors {bitmap:#x}: every contributor has "
                           f"arrived, and before the quorum only contributors have")
    return last - 1, offset, count, bitmap, arrived


def _tna_pass1(test: GenTest, frame: bytes, job: Job, twin) -> Outcome:
    h = H.Header(**_thc_fields(frame))
    ps = make_twin(job, twin)
    state = None
    if h.slot < job.slots + job.norm_slots:
        state = _state(test, job, h)
    before = None
    if state is not None:
        rnd, offset, count, bitmap, _ = state
        if count is None:           # the path read no contributors: any complete round will do
            count, bitmap = job.n, (1 << job.n) - 1
        ps.restore_slot(h.slot, rnd, count, bitmap, offset if offset is not None else h.offset)
        before = (rnd, count, bitmap, offset)
    out, reason = twin_step(ps, datagram(frame), _src(frame))
    me = 1 << h.worker_id
    accepted = reason is None or reason in ("duplicate", "late", "stale")
    if not accepted:
        return _judge(test, f"dropped in pass 1: {reason}", None, False)
    st = ps.slots[h.slot]
    prev = before is not None and h.round + 1 == before[0]
    if reason == "stale" and not prev:
        return _answer(test, frame, out, reason)
    values = {"pass2": 1, "port": test.in_port, "me": me, "cb": ONE | me}
    masked: tuple = ()
    if prev:
        values.update(kind=K_PREV, off_old=h.offset)
        what = "pass 1: previous round, to pass 2"
    elif before is None or h.round != before[0]:
        values["kind"] = K_FIRST
        kept = st.previous
        if kept is not None:
            values.update(shadow_cb=kept.contributors << 24 | kept.bitmap, off_old=kept.offset)
        else:
            masked = ("off_old",)
        what = "pass 1: a new round, to pass 2"
    else:
        values.update(kind=K_SAME, cb=st.count << 24 | st.bitmap)
        if me & before[2]:
            values["seen"] = me
        elif before[1] >= job.quorum:
            masked = ("seen",)      # a late sender: whether it came before is the arrivals' business
        what = "pass 1: the current round, to pass 2"
    want = bridge_bytes(values) + fix_checksum(frame)
    care = bridge_care(masked)
    return _judge(test, what, (job.recirc_port, want, care), False, bridge=True)


def _tna_pass2(test: GenTest, frame: bytes, job: Job, twin) -> Outcome:
    b = bridge_fields(test.packet)
    h = H.Header(**_thc_fields(frame))
    me = 1 << h.worker_id
    if b["me"] != me:
        raise SetAside(f"bridge.me {b['me']:#x} for worker {h.worker_id} (pass 1 writes 1 << worker id)")
    norm = h.type == H.NORM
    if h.worker_id >= job.n:
        raise SetAside(f"pass 2 of worker {h.worker_id} ≥ n = {job.n} (pass 1's worker_range drops it)")
    # the job around the packet: pass 1 checked its registration and slot range
    job.workers[h.worker_id] = (*_src(frame), h.token)
    if norm and h.slot < 1:
        raise SetAside("a NORM packet for slot 0 (no job's norm slot)")
    job.slots, job.norm_slots = (h.slot, 1) if norm else (h.slot + 1, 1)
    ps = make_twin(job, twin)
    dg = datagram(frame)
    try:
        H.parse(dg)
    except H.PacketError as exc:
        raise SetAside(f"pass 2 of a packet pass 1 drops ({exc.reason})") from None
    bank = (h.slot << 1) | (h.round & 1)
    lanes = _lanes(test, bank, norm)
    kind = b["kind"]
    if kind == K_FIRST:
        if b["cb"] != ONE | me:
            raise SetAside(f"bridge.cb {b['cb']:#x} on a round's first packet (pass 1 writes 1 << 24 | me)")
        if b["shadow_cb"]:
            count, bitmap = _contributors(b["shadow_cb"], job, "bridge.shadow_cb")
            if count < job.quorum or h.round == 0:
                raise SetAside("bridge.shadow_cb of a round that did not complete")
            ps.restore_slot(h.slot, h.round - 1, count, bitmap, b["off_old"])
        what = "pass 2: a new round"
    elif kind == K_SAME:
        count, bitmap = _contributors(b["cb"], job, "bridge.cb")
        mine, seen = bitmap & me, b["seen"] & me
        if b["seen"] & ~me:
            raise SetAside(f"bridge.seen {b['seen']:#x} (pass 1 writes the sender's bit or 0)")
        if seen and not mine and count < job.quorum:
            raise SetAside("a sender that arrived without contributing while the round is open")
        if not seen and not mine and count < job.quorum:
            raise SetAside("a first arrival that did not contribute while the round is open")
        if not seen and mine:                    # pass 1 added it: the state before had it not
            if count - 1 >= job.quorum or count == 1:
                raise SetAside("a contribution pass 1 adds to a completed round (or to none)")
            count, bitmap = count - 1, bitmap & ~me
        ps.restore_slot(h.slot, h.round, count, bitmap, h.offset, lanes)
        what = "pass 2: the current round"
    elif kind == K_PREV:
        if b["cb"] != ONE | me:
            raise SetAside(f"bridge.cb {b['cb']:#x} for a previous round (pass 1 writes 1 << 24 | me)")
        if b["off_old"] != h.offset:
            raise SetAside("bridge.off_old ≠ the packet's offset (pass 1 copies it)")
        if h.round == M32:
            raise SetAside("a previous round 2^32 − 1 (no slot reaches round 2^32)")
        shadow = test.register("shadow_reg").get(h.slot, {})
        cb, off = shadow.get("cb", 0), shadow.get("offset", 0)
        previous = None
        if cb:
            count, bitmap = _contributors(cb, job, "shadow_reg.cb")
            if count < job.quorum:
                raise SetAside(f"shadow_reg.cb {cb:#x}: pass 2 keeps only completed rounds")
            previous = (count, bitmap, off, lanes)
        ps.restore_slot(h.slot, h.round + 1, job.n, (1 << job.n) - 1, h.offset, (), previous)
        what = "pass 2: the previous round"
    else:
        raise SetAside(f"bridge.kind {kind} (pass 1 sends kinds 1..3 to pass 2)")
    out, reason = twin_step(ps, dg, _src(frame))
    if reason is not None and reason not in ("duplicate", "late", "stale"):
        raise SetAside(f"the twin drops it ({reason}), so pass 1 would have")
    outcome = _answer(test, frame, out, reason, port=b["port"])
    outcome.what = f"{what}: {outcome.what}"
    return outcome


def replay(tests: list[GenTest], name: str, twin=ReferencePS) -> list[Outcome]:
    """Every test of target `name` replayed against `twin` (ReferencePS, or a variant)."""
    run = replay_bmv2 if target(name).arch == "v1model" else replay_tna
    return [run(t, twin) for t in tests]


def summary(outcomes: list[Outcome]) -> dict:
    counts: dict = {}
    for o in outcomes:
        counts[o.verdict] = counts.get(o.verdict, 0) + 1
    reasons: dict = {}
    for o in outcomes:
        if o.verdict in (SET_ASIDE, UNMODELED):
            reasons[o.reason] = reasons.get(o.reason, 0) + 1
    paths: dict = {}
    for o in outcomes:
        if o.verdict in (MATCH, DIVERGED):
            paths[o.what] = paths.get(o.what, 0) + 1
    return {"tests": len(outcomes), **{k: counts.get(k, 0) for k in (MATCH, SET_ASIDE, UNMODELED, DIVERGED)},
            "reasons": reasons, "paths": paths,
            "divergences": [o.line() for o in outcomes if o.verdict == DIVERGED]}


def summary_text(doc: dict) -> str:
    """The summary as lines: counts, then the reasons, the paths compared and every divergence."""
    lines = [f"replayed {doc['tests']} tests against the software PS: {doc[MATCH]} match, {doc[SET_ASIDE]} set "
             f"aside, {doc[UNMODELED]} unmodeled, {doc[DIVERGED]} diverged"]
    lines += [f"  compared: {n} × {what}" for what, n in sorted(doc["paths"].items(), key=lambda kv: -kv[1])]
    lines += [f"  not compared: {n} × {why}" for why, n in sorted(doc["reasons"].items(), key=lambda kv: -kv[1])]
    lines += [f"  DIVERGED {line}" for line in doc["divergences"]]
    return "\n".join(lines)
