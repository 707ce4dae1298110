"""The job contract: everything workers and the PS agree on at registration.

It travels in the control plane's CONFIG reply (msgpack) and determines the
data plane: packet geometry, slot ranges, the element operation and the table.
Validation happens here, before any traffic (e.g. n·g overflowing the lane).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from proto import headers
from proto.packing import check_lane_capacity, packed_size
from proto.tables import parse_p, solve_table

#: Codecs the data plane aggregates itself (lookup-and-sum or float sum); every other
#: registered codec travels as BLOB fragments and the PS decodes, sums and re-encodes it.
DATA_PLANE_CODECS = ("thc", "none")


def _known_codecs() -> list:
    from compression import registry   # the names both ends can instantiate
    return registry.names()


@dataclass
class JobConfig:
    num_workers: int
    job_id: int = 1
    codec: str = "thc"
    bits: int = 4
    granularity: int = 30
    p: str = "1/32"
    lane_bits: int = 8
    seed: int = 0
    slots: int = 512
    norm_slots: int = 16
    mtu: int = headers.DEFAULT_MTU
    elems_per_packet: int = 0          # 0: derived from the MTU
    quorum: float = 1.0
    block_log2: int = 23
    table: tuple = field(default=())   # filled in from (bits, granularity, p)
    codec_params: dict = field(default_factory=dict)   # keyword parameters of a BLOB codec

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        n = self.num_workers
        if not 1 <= n <= headers.MAX_WORKERS:
            raise ValueError(f"num_workers must be in 1..{headers.MAX_WORKERS} (bitmap width), got {n}")
        if self.codec not in DATA_PLANE_CODECS and self.codec not in _known_codecs():
            raise ValueError(f"unknown codec {self.codec!r}; choose from {', '.join(_known_codecs())}")
        if not 0 < self.quorum <= 1:
            raise ValueError(f"quorum must lie in (0, 1], got {self.quorum}")
        if not 0 <= self.job_id <= 0xFFFF:
            raise ValueError(f"job_id must fit 16 bits, got {self.job_id}")
        if self.slots < 1 or self.norm_slots < 1 or self.slots + self.norm_slots > 0xFFFF:
            raise ValueError("slots and norm_slots must be positive and together fit 16 bits")
        self.p = str(parse_p(self.p))
        if self.codec == "thc":
            check_lane_capacity(n, self.granularity, self.lane_bits)
            self.table = tuple(solve_table(self.bits, self.granularity, self.p).values)
        budget = headers.payload_budget(self.mtu)
        limit = headers.max_elements(budget, self.up_bits, self.down_bits)
        if self.blob:
            from proto.blob import SUB_SIZE
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
            from proto.blob import SUB_SIZE
            return SUB_SIZE + count
        return packed_size(count, self.up_bits)

    def down_payload_len(self, count: int) -> int:
        return count * self.down_bits // 8

    def to_msg(self) -> dict:
        d = asdict(self)
        d["table"] = list(self.table)
        return d

    @classmethod
    def from_msg(cls, msg: dict) -> "JobConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(msg) - known
        if unknown:
            raise ValueError(f"unknown job fields: {sorted(unknown)}")
        cfg = cls(**{k: v for k, v in msg.items() if k != "table"})
        cfg.codec_params = dict(cfg.codec_params)
        if "table" in msg and tuple(msg["table"]) != cfg.table:
            raise ValueError("the job's table disagrees with the solver for its (b, g, p)")
        return cfg
