"""The job contract: everything workers and the PS agree on at registration.

It travels in the control plane's CONFIG reply (msgpack) and determines the
data plane: packet geometry, slot ranges, the element operation and the table.
Validation happens here, before any traffic (e.g. n·g overflowing the lane).
"""
from __future__ import annotations

import ipaddress
import math
from dataclasses import asdict, dataclass, field

from thc_ps.proto import headers
from thc_ps.proto.packing import LANE_WIDTHS, check_lane_capacity, packed_size, result_lane_bits
from thc_ps.proto.tables import parse_p, solve_table

#: Fields the PS assigns when it admits a job (its id among the running jobs, the data slots
#: of its region): a worker's expectation of them is no conflict, it takes the PS's values.
ADMISSION_FIELDS = ("job_id", "slots")

#: Every codec a job may name: the names both ends instantiate (compression/registry.py
#: maps each to its implementation, the same names in the same order).
CODECS = ("thc", "uhc", "topk", "terngrad", "none", "3lc", "skcompress", "fastsgd", "casq")
#: Codecs the data plane aggregates itself (lookup-and-sum or float sum); every other
#: codec travels as BLOB fragments and the PS decodes, sums and re-encodes it.
DATA_PLANE_CODECS = ("thc", "none")

#: log2 of the RHT block: tensors are cut into blocks of 2^20 coordinates, each transformed
#: and scaled on its own (a tensor's rest in smaller ones: DEFAULT_TAIL_LOG2).  The authors cap a block at
#: 2^23 (docs/prior-art.md §1.2); on CPU workers a 4 MiB block stays in the last-level cache
#: and the three transforms of a round cost 15–20% less, with the same NMSE at the same
#: bytes and less padding (docs/bench.md, "RHT block size").
DEFAULT_BLOCK_LOG2 = 20
#: log2 of the finest block a tensor's tail is cut into: what is left after the whole blocks
#: is rounded up to a multiple of 2^12 coordinates and cut into power-of-two blocks (its binary
#: digits), so the padding stays under 2^12 coordinates a tensor, where one block of the next
#: power of two padded a DDP bucket of 570,112 floats to 2^20 (docs/protocol.md §4 step 1;
#: docs/bench.md, "A tensor's rest in power-of-two blocks").  A value ≥ block_log2 keeps one tail block.
DEFAULT_TAIL_LOG2 = 12
#: How the RHT's sign diagonal D changes (docs/protocol.md §4 step 3).  "round": a fresh D^r
#: every round, as THC's Alg. 3 line 9 draws it.  "job": one D for the whole job, so that
#: R(∇ + e) = R∇ + Re and the error feedback can stay in the rotated domain: a worker's step
#: then runs two transforms instead of three (docs/design.md, "One rotation per job").
ROTATIONS = ("round", "job")
#: JobConfig.lane_bits asking for the narrowest lane (1..8, 16 or 32 bits) that holds the job's
#: largest sum n·g: what a job gets unless it names a width (a torchrun job's size is whatever
#: torchrun says, so the lane follows it).  Resolved when the job is built: the wire, the
#: PS and every worker only ever see the width itself.
LANE_AUTO = 0
#: A job's rotation unless told (JobConfig, ThcConfig, the `thc` commands and the library take
#: it from here): one per job, which took less codec CPU a step and reached the same accuracy
#: with error feedback in the measured runs (docs/bench.md, "Defaults that win"); a worker
#: without error feedback keeps the clamping error a fixed D puts in one direction, so such a
#: job should ask for "round".
DEFAULT_ROTATION = "job"
#: The largest block a job may ask for (2^26 float32 = 256 MiB of one transform's workspace).
MAX_BLOCK_LOG2 = 26

#: The --result-group value that asks a run starting its own PS on this host to pick a group
#: (thc_ps.deploy.launch.one_host_group).  Never a job's result_group: parse_group refuses it.
AUTO_GROUP = "auto"


def parse_group(value: str) -> tuple | None:
    """The job's result group "A.B.C.D:PORT" as (address, port), None for "" (no group).

    With a group, the software PS sends each result once, to that IPv4 multicast group,
    instead of once per worker (THC §6, Pseudocode 1 line 15: the sum goes back by
    multicast, as the switch's replication engine does); a result a worker missed still
    comes back to it alone when it retransmits (docs/design.md, "Result fan-out")."""
    if value == "":
        return None
    if not isinstance(value, str) or value.count(":") != 1:
        raise ValueError(f"result_group must be ADDRESS:PORT (an IPv4 multicast group), got {value!r}")
    host, port = value.split(":")
    try:
        addr = ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"result_group {value!r}: {host!r} is not an IPv4 address") from None
    if not addr.is_multicast:
        raise ValueError(f"result_group {value!r}: {host} is not a multicast address (224.0.0.0/4; "
                         f"239.0.0.0/8 is for private use)")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"result_group {value!r}: the port must be in 1..65535")
    return str(addr), int(port)


def _is_p(value) -> bool:
    try:
        parse_p(str(value))
        return True
    except (ValueError, ZeroDivisionError):
        return False


@dataclass
class JobConfig:
    num_workers: int
    job_id: int = 1
    codec: str = "thc"
    bits: int = 4
    granularity: int = 30
    p: str = "1/32"
    lane_bits: int = 0                 # 0: the narrowest lane that holds n·g (LANE_AUTO)
    seed: int = 0
    slots: int = 512
    norm_slots: int = 16
    mtu: int = headers.DEFAULT_MTU
    elems_per_packet: int = 0          # 0: derived from the MTU
    quorum: float = 1.0
    block_log2: int = DEFAULT_BLOCK_LOG2
    table: tuple = field(default=())   # filled in from (bits, granularity, p)
    codec_params: dict = field(default_factory=dict)   # keyword parameters of a BLOB codec
    result_group: str = ""             # "A.B.C.D:PORT": results multicast there (parse_group)
    rotation: str = DEFAULT_ROTATION   # ROTATIONS: a sign diagonal per round, or one per job
    tail_log2: int = DEFAULT_TAIL_LOG2  # the finest block of a tensor's tail (2^tail_log2 coordinates)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        n = self.num_workers
        if not 1 <= n <= headers.MAX_WORKERS:
            raise ValueError(f"num_workers must be in 1..{headers.MAX_WORKERS} (bitmap width), got {n}")
        if self.codec not in CODECS:
            raise ValueError(f"unknown codec {self.codec!r}; choose from {', '.join(CODECS)}")
        for name, lo, hi in (("bits", 1, 8), ("granularity", 1, 1 << 16), ("block_log2", 0, MAX_BLOCK_LOG2),
                             ("tail_log2", 0, MAX_BLOCK_LOG2),
                             ("mtu", 128, 65535), ("seed", 0, (1 << 63) - 1),
                             ("elems_per_packet", 0, 65535)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer in {lo}..{hi}, got {v!r}")
        if isinstance(self.lane_bits, bool) or self.lane_bits not in (LANE_AUTO, *LANE_WIDTHS):
            raise ValueError(f"lane_bits must be 1..8, 16 or 32 (or {LANE_AUTO}: the narrowest that holds "
                             f"n·g), got {self.lane_bits!r}")
        if self.lane_bits == LANE_AUTO:
            self.lane_bits = result_lane_bits(n, self.granularity) if self.codec == "thc" else 8
        if not 0 < self.quorum <= 1:
            raise ValueError(f"quorum must lie in (0, 1], got {self.quorum}")
        if not 0 <= self.job_id <= 0xFFFF:
            raise ValueError(f"job_id must fit 16 bits, got {self.job_id}")
        if self.slots < 1 or self.norm_slots < 1 or self.slots + self.norm_slots > 0xFFFF:
            raise ValueError("slots and norm_slots must be positive and together fit 16 bits")
        self.p = str(parse_p(self.p))
        parse_group(self.result_group)
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {', '.join(ROTATIONS)}, got {self.rotation!r}")
        if self.codec == "thc":
            check_lane_capacity(n, self.granularity, self.lane_bits)
            self.table = tuple(solve_table(self.bits, self.granularity, self.p).values)
        budget = headers.payload_budget(self.mtu)
        limit = headers.max_elements(budget, self.up_bits, self.down_bits)
        if self.blob:
            from thc_ps.proto.blob import SUB_SIZE
            limit = budget - SUB_SIZE
        if self.elems_per_packet == 0:
            self.elems_per_packet = limit
        if not 1 <= self.elems_per_packet <= limit:
            raise ValueError(f"elems_per_packet must be in 1..{limit} for MTU {self.mtu}, "
                             f"got {self.elems_per_packet}")

    @property
    def blob(self) -> bool:
        return self.codec not in DATA_PLANE_CODECS

    @property
    def op(self) -> int:
        if self.blob:
            return headers.OP_BLOB
        return headers.OP_LOOKUP_SUM if self.codec == "thc" else headers.OP_FLOAT_SUM

    @property
    def up_bits(self) -> int:
        return 8 if self.blob else (self.bits if self.codec == "thc" else 32)

    @property
    def down_bits(self) -> int:
        return 8 if self.blob else (self.lane_bits if self.codec == "thc" else 32)

    @property
    def quorum_count(self) -> int:
        return max(1, math.ceil(self.quorum * self.num_workers - 1e-9))

    def up_payload_len(self, count: int) -> int:
        if self.blob:
            from thc_ps.proto.blob import SUB_SIZE
            return SUB_SIZE + count
        return packed_size(count, self.up_bits)

    def down_payload_len(self, count: int) -> int:
        return packed_size(count, self.down_bits)

    def to_msg(self) -> dict:
        d = asdict(self)
        d["table"] = list(self.table)
        return d

    def differences(self, expect: dict) -> list[str]:
        """The fields where `expect` (a worker's stated job, possibly partial) disagrees with
        this job, as 'field: PS has X, worker expects Y' — the reason a registration is refused.
        ADMISSION_FIELDS are the PS's to set and never differ."""
        out = []
        mine = self.to_msg()
        for name, want in expect.items():
            if name in ADMISSION_FIELDS or (name == "lane_bits" and want == LANE_AUTO):
                continue
            if name not in mine:
                out.append(f"{name}: not a job field")
                continue
            have = mine[name]
            if name == "p":
                same = parse_p(str(want)) == parse_p(str(have)) if _is_p(want) else False
            elif name == "table":
                same = list(want) == list(have) if isinstance(want, (list, tuple)) else False
            elif isinstance(have, float) or isinstance(want, float):
                same = isinstance(want, (int, float)) and not isinstance(want, bool) \
                    and abs(float(want) - float(have)) < 1e-12
            else:
                same = want == have
            if not same:
                out.append(f"{name}: PS has {have!r}, worker expects {want!r}")
        return out

    @classmethod
    def from_msg(cls, msg: dict) -> JobConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(msg) - known
        if unknown:
            raise ValueError(f"unknown job fields: {sorted(unknown)}")
        for name, f in cls.__dataclass_fields__.items():
            if name in msg and name not in ("table", "codec_params", "p", "quorum"):
                if not isinstance(msg[name], f.type if isinstance(f.type, type) else
                                  {"int": int, "str": str}.get(str(f.type), object)) \
                        or isinstance(msg[name], bool):
                    raise ValueError(f"job field {name} has the wrong type ({type(msg[name]).__name__})")
        if "codec_params" in msg and not isinstance(msg["codec_params"], dict):
            raise ValueError("job field codec_params must be a map")
        if "quorum" in msg and (isinstance(msg["quorum"], bool)
                                or not isinstance(msg["quorum"], (int, float))):
            raise ValueError("job field quorum must be a number")
        cfg = cls(**{k: v for k, v in msg.items() if k != "table"})
        cfg.codec_params = dict(cfg.codec_params)
        if "table" in msg and tuple(msg["table"]) != cfg.table:
            raise ValueError("the job's table disagrees with the solver for its (b, g, p)")
        return cfg
