"""Data-plane packet layout (UDP payload), version 2, network byte order.

One fixed 40-byte header, then the payload:

  off size field         meaning
    0   2  magic         0x5448 ("TH")
    2   1  version       2
    3   1  type          DATA, RESULT, STRAGGLER, NORM, NORM_RESULT, NOTICE
    4   1  flags         RETRANSMIT (worker resend), RESENT (PS unicast of a kept result)
    5   1  worker_id     sender (DATA/NORM) or addressee (unicast replies)
    6   1  num_workers   n, as the worker believes it (checked against the job)
    7   1  elem_bits     DATA: index bits b (or 32 for float32); RESULT: lane bits; NORM: 32
    8   2  job_id
   10   2  slot          aggregator index
   12   4  round         the slot's round number (incremented each time a worker reuses it)
   16   4  offset        coordinate offset of this packet's first element in the tensor
   20   2  count         number of elements in the payload
   22   2  payload_len   bytes after the header (must equal the datagram's remainder)
   24   4  bitmap        RESULT/NORM_RESULT: workers that contributed
   28   1  contributors  RESULT/NORM_RESULT: k, the number of contributors
   29   1  op            element operation (LOOKUP_SUM, FLOAT_SUM, MAX_U32)
   30   2  reserved      zero
   32   4  nonce         the job's random identity, drawn by the PS when the job starts
   36   4  token         DATA/NORM: the sender's registration token; replies: zero

DATA payloads are packed b-bit table indices (see packing.py for the bit
order) or big-endian float32 for the uncompressed baseline.  RESULT payloads
are big-endian lanes of elem_bits bits (or float32 sums).  NORM payloads are
order-preserving u32 codes of float32 statistics (see float_to_ordered), so
the PS (or a switch) takes the max as unsigned integers.  op = BLOB marks
fragments of variable-size codec payloads (proto/blob.py).
A STRAGGLER notification carries no payload; its `round` is the slot's current
round, so the late worker can resynchronize.  A NOTICE (software PS only) carries no
payload either: it tells a worker that the PS lacks its packet for `slot` at `round`
(its next packet arrived first), so the worker resends that one at once; `bitmap` and
`contributors` are the slot's so far (docs/protocol.md §3, "Loss notices").

Job identity and sender binding (version 2): the PS draws a random 32-bit `nonce`
for every job it starts and a random 32-bit `token` for every registration (both
are handed out over the authenticated control plane).  A DATA/NORM packet is
aggregated only if its nonce is the current job's and its (worker_id, source
address, token) is a live registration; every reply carries the nonce, which
workers check.  So a packet of a previous job, of another PS's job, or from an
off-path sender that cannot read the traffic is dropped (docs/design.md, "What
is protected").  Rounds are accepted at most ROUND_WINDOW ahead of a slot's
current round, so one forged or corrupt round number cannot wedge a slot.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

MAGIC = 0x5448
VERSION = 2
#: (name, bytes) in wire order: the single definition the struct format and the scapy layer derive from.
FIELDS = (("magic", 2), ("version", 1), ("type", 1), ("flags", 1), ("worker_id", 1),
          ("num_workers", 1), ("elem_bits", 1), ("job_id", 2), ("slot", 2), ("round", 4),
          ("offset", 4), ("count", 2), ("payload_len", 2), ("bitmap", 4), ("contributors", 1),
          ("op", 1), ("reserved", 2), ("nonce", 4), ("token", 4))
HEADER_FMT = "!" + "".join({1: "B", 2: "H", 4: "I"}[size] for _, size in FIELDS)
HEADER_SIZE = struct.calcsize(HEADER_FMT)
assert HEADER_SIZE == 40

#: The most coordinates one tensor (a round) may have: a packet's first coordinate is the
#: 32-bit `offset` field, and its last one must be addressable too.
MAX_COORDS = 1 << 32

# packet types
DATA, RESULT, STRAGGLER, NORM, NORM_RESULT, NOTICE = 1, 2, 3, 4, 5, 6
TYPE_NAMES = {DATA: "DATA", RESULT: "RESULT", STRAGGLER: "STRAGGLER", NORM: "NORM", NORM_RESULT: "NORM_RESULT",
              NOTICE: "NOTICE"}

# flags
F_RETRANSMIT = 0x01
F_RESENT = 0x02

# element operations
OP_LOOKUP_SUM, OP_FLOAT_SUM, OP_MAX_U32, OP_BLOB = 1, 2, 3, 4
OP_NAMES = {OP_LOOKUP_SUM: "lookup_sum", OP_FLOAT_SUM: "float_sum", OP_MAX_U32: "max_u32",
            OP_BLOB: "blob"}


def float_to_ordered(values) -> np.ndarray:
    """float32 → u32 whose unsigned order is the float order (negative numbers included).

    NORM payloads carry this encoding so the PS (or a switch) takes a float maximum with an
    unsigned integer max: set the sign bit of non-negative floats, invert negative ones.
    """
    import numpy as np
    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    return np.where(bits >> 31, ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)


def ordered_to_float(codes) -> np.ndarray:
    import numpy as np
    codes = np.asarray(codes, dtype=np.uint32)
    bits = np.where(codes >> 31, codes & np.uint32(0x7FFFFFFF), ~codes).astype(np.uint32)
    return bits.view(np.float32)

#: Default UDP payload budget: 1500-byte MTU − 20 (IPv4) − 8 (UDP).
DEFAULT_MTU = 1500
IP_UDP_OVERHEAD = 28
MAX_WORKERS = 32   # bitmap width
#: A DATA/NORM round more than this far ahead of its slot's current round (or of
#: zero, for a slot the job has not used yet) is dropped as `stale`.
ROUND_WINDOW = 1024


class PacketError(ValueError):
    """A datagram that is not a well-formed THC packet; `reason` names the drop counter."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class Header:
    type: int
    job_id: int = 0
    worker_id: int = 0
    num_workers: int = 0
    elem_bits: int = 0
    slot: int = 0
    round: int = 0
    offset: int = 0
    count: int = 0
    payload_len: int = 0
    bitmap: int = 0
    contributors: int = 0
    op: int = 0
    flags: int = 0
    nonce: int = 0
    token: int = 0
    version: int = VERSION
    magic: int = MAGIC

    def pack(self) -> bytes:
        return struct.pack(HEADER_FMT, *(0 if name == "reserved" else getattr(self, name)
                                         for name, _ in FIELDS))


FIELD_ORDER = tuple(name for name, _ in FIELDS if name != "reserved")


def build(header: Header, payload: bytes = b"") -> bytes:
    """Header + payload, with payload_len filled in."""
    header.payload_len = len(payload)
    return header.pack() + payload


_HEADER = struct.Struct(HEADER_FMT)


def build_fast(type: int, job_id: int, worker_id: int, num_workers: int, elem_bits: int, slot: int,
               round: int, offset: int, count: int, op: int, payload: bytes, flags: int = 0,
               nonce: int = 0, token: int = 0) -> bytes:
    """build() for a sender's per-packet loop (no Header object): a DATA/NORM packet with
    bitmap and contributors zero.  Equal to build(Header(...), payload) (tested)."""
    return _HEADER.pack(MAGIC, VERSION, type, flags, worker_id, num_workers, elem_bits, job_id, slot,
                        round, offset, count, len(payload), 0, 0, op, 0, nonce, token) + payload


def as_retransmission(datagram: bytes) -> bytes:
    """The same packet with the RETRANSMIT flag set (byte 4, `flags`)."""
    b = bytearray(datagram)
    b[4] |= F_RETRANSMIT
    return bytes(b)


def parse(datagram: bytes) -> tuple[Header, memoryview]:
    """Validate and split a datagram; raises PacketError with the drop reason."""
    if len(datagram) < HEADER_SIZE:
        raise PacketError("malformed", f"datagram of {len(datagram)} bytes is shorter than the header")
    vals = struct.unpack_from(HEADER_FMT, datagram)
    if vals[0] != MAGIC:
        raise PacketError("malformed", f"bad magic 0x{vals[0]:04x}")
    if vals[1] != VERSION:
        raise PacketError("wrong_version", f"version {vals[1]} (expected {VERSION})")
    h = Header(**{name: v for (name, _), v in zip(FIELDS, vals) if name != "reserved"})
    if h.type not in TYPE_NAMES:
        raise PacketError("malformed", f"unknown packet type {h.type}")
    if h.payload_len != len(datagram) - HEADER_SIZE:
        raise PacketError("malformed", f"payload_len {h.payload_len} but {len(datagram) - HEADER_SIZE} bytes follow")
    return h, memoryview(datagram)[HEADER_SIZE:]


def split_segments(buffer, seg_size: int) -> list:
    """The datagrams of one received UDP GRO batch: every `seg_size` bytes is one datagram, the
    last one may be shorter; seg_size 0 (no GRO) or >= len(buffer) is the buffer itself.  The
    PS engines and the worker handle each segment exactly as a lone datagram."""
    view = memoryview(buffer)
    if seg_size <= 0 or seg_size >= len(view):
        return [view]
    return [view[i:i + seg_size] for i in range(0, len(view), seg_size)]


def header_dict(h: Header) -> dict:
    return {f.name: getattr(h, f.name) for f in fields(h)}


def max_elements(payload_budget: int, elem_bits: int, result_bits: int) -> int:
    """Elements per packet so that both the DATA and the RESULT payloads fit the budget."""
    bits = max(elem_bits, result_bits)
    n = (payload_budget * 8) // bits
    return n - n % 8 if n >= 8 else n


def payload_budget(mtu: int = DEFAULT_MTU) -> int:
    """UDP payload bytes left for THC data after IP, UDP and THC headers."""
    budget = mtu - IP_UDP_OVERHEAD - HEADER_SIZE
    if budget < 16:
        raise ValueError(f"MTU {mtu} leaves no room for a THC payload")
    return budget
