"""Variable-size codec payloads over the data plane: fragmentation and reassembly.

A payload of any codec that the PS must decode (TopK, 3LC, SKCompress, FastSGD, CASQ) is
cut into DATA packets with op = BLOB; each fragment's payload is an 8-byte sub-header
(u32 total length of the codec payload, u32 tensor dimension d) followed by the bytes
[offset, offset + count) of the codec payload (`offset`/`count` are the THC header's).
The PS answers with RESULT fragments in the same layout.  Every (round, worker) is
reassembled with duplicate suppression; a fragment that disagrees with what is already
known (total length, dimension, overlap) is rejected.

Resend rule: a retransmitted uplink fragment f of a worker whose payload has F fragments
is answered with the result fragments j ≡ f (mod F), so a worker that lost any result
fragment gets every one of them back by resending its own fragments.
"""
from __future__ import annotations

import struct

SUB = struct.Struct(">II")
SUB_SIZE = SUB.size
MAX_BLOB = 1 << 30


class BlobError(ValueError):
    pass


def fragments(payload: bytes, dim: int, max_bytes: int) -> list:
    """[(offset, fragment payload incl. sub-header)] for one codec payload."""
    per = max_bytes - SUB_SIZE
    if per <= 0:
        raise ValueError("packet budget too small for a blob fragment")
    head = SUB.pack(len(payload), dim)
    if not payload:
        return [(0, head)]
    return [(off, head + payload[off:off + per]) for off in range(0, len(payload), per)]


def fragment_count(total: int, max_bytes: int) -> int:
    per = max_bytes - SUB_SIZE
    return max(1, -(-total // per))


def parse_fragment(payload: bytes) -> tuple[int, int, bytes]:
    if len(payload) < SUB_SIZE:
        raise BlobError("blob fragment shorter than its sub-header")
    total, dim = SUB.unpack_from(payload)
    if total > MAX_BLOB:
        raise BlobError(f"blob of {total} bytes exceeds the {MAX_BLOB}-byte limit")
    return total, dim, bytes(payload[SUB_SIZE:])


class Reassembly:
    """One (round, sender) payload being put together from fragments."""

    def __init__(self, total: int, dim: int):
        self.total, self.dim = total, dim
        self.buf = bytearray(total)
        self.have: dict[int, int] = {}
        self.got = 0

    def add(self, offset: int, data: bytes, total: int, dim: int) -> bool:
        """Add a fragment; False for a duplicate; BlobError if inconsistent."""
        if total != self.total or dim != self.dim:
            raise BlobError("fragment disagrees with earlier fragments on length or dimension")
        if offset + len(data) > self.total or (not data and self.total):
            raise BlobError("fragment lies outside the payload")
        if offset in self.have:
            if self.have[offset] != len(data):
                raise BlobError("fragment overlaps an earlier one differently")
            return False
        self.have[offset] = len(data)
        self.buf[offset:offset + len(data)] = data
        self.got += len(data)
        return True

    @property
    def complete(self) -> bool:
        return self.got >= self.total

    def payload(self) -> bytes:
        return bytes(self.buf)
