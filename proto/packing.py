"""Payload packings of the wire contract.

Index packing (worker → PS): b-bit table indices are packed densely, MSB first.
Coordinate 0 occupies the most significant bits of byte 0; for b = 4 that is
the *high nibble* (byte = z[2i]·16 + z[2i+1]), the order of the authors'
artifact (docs/prior-art.md §1.3).  A trailing partial byte is padded with zero bits.

Lane packing (PS → worker): the sums Y = Σ T[Z] travel as unsigned big-endian
integers of 8, 16 or 32 bits per coordinate.  A configuration whose worst-case
sum n·g does not fit the lane is refused before any traffic (paper §6.2,
docs/prior-art.md §4.7).
"""
from __future__ import annotations

import numpy as np

LANE_DTYPES = {8: np.dtype(">u1"), 16: np.dtype(">u2"), 32: np.dtype(">u4")}


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
    """Smallest standard lane (8/16/32 bits) that holds n·g."""
    for bits in (8, 16, 32):
        if workers * granularity <= (1 << bits) - 1:
            return bits
    raise LaneOverflowError(f"n·g = {workers}·{granularity} exceeds even a 32-bit lane")


def check_lane_capacity(workers: int, granularity: int, lane_bits: int) -> None:
    """Refuse a configuration whose sums can overflow the lane (n·g > 2^lane − 1)."""
    if lane_bits not in LANE_DTYPES:
        raise ValueError(f"lane width must be one of {sorted(LANE_DTYPES)} bits, got {lane_bits}")
    limit = (1 << lane_bits) - 1
    if workers * granularity > limit:
        raise LaneOverflowError(
            f"n·g = {workers}·{granularity} = {workers * granularity} exceeds the {lane_bits}-bit "
            f"lane maximum {limit}; lower the granularity to at most {limit // workers} "
            f"(--granularity, granularity=) or widen the lane to {lane_bits_for(workers, granularity)} "
            f"bits (--lane-bits {lane_bits_for(workers, granularity)}, lane_bits=; left unset, the lane "
            f"is the narrowest that fits)")


def pack_lanes(y: np.ndarray, lane_bits: int) -> bytes:
    """Sums as big-endian unsigned lanes."""
    dtype = LANE_DTYPES[lane_bits]
    y = np.asarray(y)
    if y.size and (int(y.min()) < 0 or int(y.max()) > (1 << lane_bits) - 1):
        raise LaneOverflowError(f"sum {int(y.max())} does not fit a {lane_bits}-bit lane")
    return y.astype(dtype).tobytes()


def unpack_lanes(buf, lane_bits: int, count: int | None = None) -> np.ndarray:
    """Inverse of :func:`pack_lanes` into native int64."""
    dtype = LANE_DTYPES[lane_bits]
    arr = np.frombuffer(buf, dtype=dtype)
    if count is not None:
        if arr.size < count:
            raise ValueError(f"lane buffer holds {arr.size} values, expected {count}")
        arr = arr[:count]
    return arr.astype(np.int64)
