"""Payload packings of the wire contract.

Index packing (worker → PS): b-bit table indices are packed densely, MSB first.
Coordinate 0 occupies the most significant bits of byte 0; for b = 4 that is
the *high nibble* (byte = z[2i]·16 + z[2i+1]), the order of the authors'
artifact (docs/prior-art.md §1.3).  A trailing partial byte is padded with zero bits.

Lane packing (PS → worker): the sums Y = Σ T[Z] travel as unsigned integers of L bits
per coordinate: L of 1..8 packed densely MSB first exactly as indices are (so 8-bit lanes
are one byte each), L of 16 or 32 big-endian.  A job's lane is the narrowest that holds
its worst-case sum n·g (4 workers at g = 30: 7 bits, an eighth off every RESULT); a
configuration whose n·g does not fit its lane is refused before any traffic (paper §6.2,
docs/prior-art.md §4.7).
"""
from __future__ import annotations

import numpy as np

#: Byte-wide lanes' types (BLOB codecs' lanes too); lanes of 1..7 bits are packed like indices.
LANE_DTYPES = {8: np.dtype(">u1"), 16: np.dtype(">u2"), 32: np.dtype(">u4")}
#: Every lane width a RESULT may carry.
LANE_WIDTHS = (*range(1, 9), 16, 32)


class LaneOverflowError(ValueError):
    """n·g (the largest possible sum) does not fit the aggregation lane."""


def packed_size(count: int, bits: int) -> int:
    """Bytes that `count` b-bit indices occupy."""
    return (count * bits + 7) // 8


def pack_indices(z: np.ndarray, bits: int) -> np.ndarray:
    """Pack integer indices in [0, 2^bits) into a uint8 array, MSB first."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    z = np.ascontiguousarray(z, dtype=np.uint8).ravel()
    if z.size and int(z.max()) >> bits:
        raise ValueError(f"index {int(z.max())} does not fit in {bits} bits")
    if bits == 8:
        return z.copy()
    if bits == 4:
        if z.size % 2:
            z = np.append(z, np.uint8(0))
        return ((z[0::2] << 4) | z[1::2]).astype(np.uint8)
    shifts = np.arange(bits - 1, -1, -1, dtype=np.uint8)
    bitstream = ((z[:, None] >> shifts) & 1).astype(np.uint8).ravel()
    return np.packbits(bitstream)


def unpack_indices(buf, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_indices`: the first `count` indices of a packed buffer."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    data = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.view(np.uint8)
    need = packed_size(count, bits)
    if data.size < need:
        raise ValueError(f"packed buffer has {data.size} bytes, {count} indices of {bits} bits need {need}")
    data = data[:need]
    if bits == 8:
        return data.copy()
    if bits == 4:
        out = np.empty(data.size * 2, dtype=np.uint8)
        out[0::2] = data >> 4
        out[1::2] = data & 0x0F
        return out[:count]
    bitstream = np.unpackbits(data)[: count * bits].reshape(count, bits)
    weights = (1 << np.arange(bits - 1, -1, -1)).astype(np.uint8)
    return (bitstream * weights).sum(axis=1, dtype=np.uint16).astype(np.uint8)


def lane_bits_for(workers: int, granularity: int) -> int:
    """Smallest byte-wide lane (8/16/32 bits) that holds n·g: the BLOB codecs' sum lanes."""
    for bits in (8, 16, 32):
        if workers * granularity <= (1 << bits) - 1:
            return bits
    raise LaneOverflowError(f"n·g = {workers}·{granularity} exceeds even a 32-bit lane")


def result_lane_bits(workers: int, granularity: int) -> int:
    """Narrowest RESULT lane that holds n·g: its bit length up to 8 bits, else 16 or 32."""
    top = workers * granularity
    return max(1, top.bit_length()) if top <= 0xFF else lane_bits_for(workers, granularity)


def check_lane_capacity(workers: int, granularity: int, lane_bits: int) -> None:
    """Refuse a configuration whose sums can overflow the lane (n·g > 2^lane − 1)."""
    if lane_bits not in LANE_WIDTHS:
        raise ValueError(f"lane width must be 1..8, 16 or 32 bits, got {lane_bits}")
    limit = (1 << lane_bits) - 1
    if workers * granularity > limit:
        raise LaneOverflowError(
            f"n·g = {workers}·{granularity} = {workers * granularity} exceeds the {lane_bits}-bit "
            f"lane maximum {limit}; lower the granularity to at most {limit // workers} "
            f"(--granularity, granularity=) or widen the lane to {result_lane_bits(workers, granularity)} "
            f"bits (--lane-bits {result_lane_bits(workers, granularity)}, lane_bits=; left unset, the lane "
            f"is the narrowest that fits)")


def pack_lanes(y: np.ndarray, lane_bits: int) -> bytes:
    """Sums as L-bit lanes: 1..8 bits packed MSB first like indices, 16/32 big-endian."""
    y = np.asarray(y)
    if lane_bits not in LANE_WIDTHS:
        raise ValueError(f"lane width must be 1..8, 16 or 32 bits, got {lane_bits}")
    if y.size and (int(y.min()) < 0 or int(y.max()) > (1 << lane_bits) - 1):
        raise LaneOverflowError(f"sum {int(y.max())} does not fit a {lane_bits}-bit lane")
    if lane_bits <= 8:
        return pack_indices(y, lane_bits).tobytes()
    return y.astype(LANE_DTYPES[lane_bits]).tobytes()


def unpack_lanes(buf, lane_bits: int, count: int | None = None) -> np.ndarray:
    """Inverse of :func:`pack_lanes` into native int64 (`count`: the first so many lanes;
    None: every whole lane the buffer holds)."""
    if lane_bits not in LANE_WIDTHS:
        raise ValueError(f"lane width must be 1..8, 16 or 32 bits, got {lane_bits}")
    if lane_bits < 8:
        size = len(buf) if not isinstance(buf, np.ndarray) else buf.nbytes
        whole = size * 8 // lane_bits
        if count is not None and count > whole:
            raise ValueError(f"lane buffer holds {whole} values, expected {count}")
        return unpack_indices(buf, lane_bits, whole if count is None else count).astype(np.int64)
    arr = np.frombuffer(buf, dtype=LANE_DTYPES[lane_bits])
    if count is not None:
        if arr.size < count:
            raise ValueError(f"lane buffer holds {arr.size} values, expected {count}")
        arr = arr[:count]
    return arr.astype(np.int64)
