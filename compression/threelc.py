"""3LC (Lim, Andersen, Kaminsky, MLSys 2019), per shared/specs/3lc.md.

Three stages (paper §3):
  1. 3-value quantization with sparsity multiplication and error accumulation (§3.1):
     A = E + x, M = max|A|, m = s·M, q = round(A/m) ∈ {−1, 0, 1}, E ← A − m·q.
  2. Base-3^5 encoding (§3.2): 5 trits per byte, planar layout (byte j holds elements
     j, j+L, …, j+4L), pad digit 0 after the +1 shift (spec §6 A4/A5).
  3. Zero-run encoding (§3.3): k ≥ 2 consecutive 121 bytes (all-zero quintuples) become
     243 + k − 2, greedy 14-chunks for longer runs (spec A6).

In THC-PS the PS keeps no model, so the pull direction compresses the averaged gradient
with one shared pull context per tensor (spec §2.8: under SGD that is the model delta up
to the learning-rate factor, and error feedback makes it W − W̃); every worker gets the
same bytes.

Wire framing (spec §3.1, little-endian): u8 codec id (3), u8 flags (bit0 ZRE, bit1 raw
float32 fallback), u32 n, f32 m, u32 payload length, payload.
"""
from __future__ import annotations

import struct

import numpy as np

from compression.codec import Codec, CodecError, Context

CODEC_ID = 3
F_ZRE, F_RAW = 0x01, 0x02
HEAD = struct.Struct("<BBIfI")
ZERO_BYTE = 121
_POW = np.array([81, 27, 9, 3, 1], dtype=np.uint16)


# ----------------------------------------------------------------------------- stage 1

def quantize(x: np.ndarray, error: np.ndarray | None, s: float):
    """(q int8, m float32, new error) for input x with error buffer `error` (§3.1, spec §2.2)."""
    if not 1.0 <= s < 2.0:
        raise ValueError(f"sparsity multiplier s must satisfy 1 <= s < 2, got {s}")
    a = x.astype(np.float32) + (error if error is not None else 0.0)
    a = a.astype(np.float32)
    big_m = float(np.abs(a).max()) if a.size else 0.0
    m = np.float32(big_m * s)
    if m == 0 or not np.isfinite(m):
        if not np.isfinite(m):
            raise ValueError("3LC input holds NaN or Inf")
        return np.zeros(a.shape, np.int8), np.float32(0.0), a
    q = np.rint(a / m).astype(np.int8)
    return q, m, (a - m * q.astype(np.float32)).astype(np.float32)


# ----------------------------------------------------------------------------- stage 2

def base35_encode(q: np.ndarray) -> np.ndarray:
    """Planar base-3^5 bytes of trits q (spec §2.5): ceil(n/5) bytes, each 0..242."""
    d = (np.asarray(q, dtype=np.int8).ravel() + 1).astype(np.uint8)
    d = np.concatenate([d, np.zeros((-d.size) % 5, np.uint8)])
    planes = d.reshape(5, -1).astype(np.uint16)
    return (planes * _POW[:, None]).sum(axis=0).astype(np.uint8)


def base35_decode(b: np.ndarray, n: int) -> np.ndarray:
    """Inverse of base35_encode: n trits as int8."""
    b = np.asarray(b, dtype=np.uint8)
    if b.size != -(-n // 5):
        raise CodecError(f"3LC: {b.size} base-3^5 bytes cannot hold {n} values")
    if b.size and int(b.max()) > 242:
        raise CodecError("3LC: base-3^5 byte above 242")
    digits = (b[None, :].astype(np.uint16) // _POW[:, None]) % 3
    return (digits.ravel()[:n].astype(np.int8) - 1)


# ----------------------------------------------------------------------------- stage 3

def zre_encode(b: np.ndarray) -> np.ndarray:
    """Zero-run encoding, vectorized; identical to the greedy serial encoder (spec §2.6)."""
    b = np.asarray(b, dtype=np.uint8)
    n = b.size
    if n == 0:
        return b.copy()
    pos = np.arange(n)
    z = b == ZERO_BYTE
    start = z & np.r_[True, ~z[:-1]]
    end = z & np.r_[~z[1:], True]
    run_start = np.maximum.accumulate(np.where(start, pos, 0))
    run_end = np.minimum.accumulate(np.where(end, pos + 1, n + 1)[::-1])[::-1]
    keep = ~z | ((pos - run_start) % 14 == 0)
    length = np.minimum(14, run_end - pos)
    return np.where(z, np.where(length == 1, ZERO_BYTE, 241 + length), b).astype(np.uint8)[keep]


def zre_decode(c: np.ndarray) -> np.ndarray:
    """Expand run bytes 243..255 into c − 241 copies of 121; accepts any valid split."""
    c = np.asarray(c, dtype=np.uint8)
    run = c >= 243
    return np.repeat(np.where(run, ZERO_BYTE, c).astype(np.uint8),
                     np.where(run, c.astype(np.int64) - 241, 1))


# ----------------------------------------------------------------------------- framing

def pack(q: np.ndarray, m: np.float32, use_zre: bool = True) -> bytes:
    b = base35_encode(q)
    body = zre_encode(b) if use_zre else b
    return HEAD.pack(CODEC_ID, F_ZRE if use_zre else 0, q.size, float(m), body.size) + body.tobytes()


def pack_raw(x: np.ndarray) -> bytes:
    body = np.asarray(x, dtype="<f4").tobytes()
    return HEAD.pack(CODEC_ID, F_RAW, x.size, 0.0, len(body)) + body


def unpack(payload: bytes, n_expected: int) -> np.ndarray:
    """Decode one 3LC message to float32 values (m·q, or the raw fallback)."""
    if len(payload) < HEAD.size:
        raise CodecError("3LC message shorter than its header")
    cid, flags, n, m, plen = HEAD.unpack_from(payload)
    if cid != CODEC_ID or flags & ~(F_ZRE | F_RAW):
        raise CodecError(f"3LC: bad codec id {cid} or flags {flags:#x}")
    if n != n_expected:
        raise CodecError(f"3LC message holds {n} values, expected {n_expected}")
    if len(payload) != HEAD.size + plen:
        raise CodecError(f"3LC payload length {plen} disagrees with the message size")
    body = np.frombuffer(payload, dtype=np.uint8, offset=HEAD.size)
    if flags & F_RAW:
        if plen != 4 * n:
            raise CodecError("3LC raw fallback has the wrong length")
        return np.frombuffer(payload, dtype="<f4", offset=HEAD.size).astype(np.float32)
    if not np.isfinite(m):
        raise CodecError("3LC scale is not finite")
    b = zre_decode(body) if flags & F_ZRE else body
    q = base35_decode(b, n)
    return (np.float32(m) * q.astype(np.float32)).astype(np.float32)


def payload_bits_per_value(payload: bytes) -> float:
    """Payload-only bits per value (the paper's Table 2 accounting, spec §6 A8)."""
    _, _, n, _, plen = HEAD.unpack_from(payload)
    return 8.0 * plen / n if n else 0.0


class ThreeLCCodec(Codec):
    """3LC push (per-worker context) and pull (one shared PS context per tensor)."""

    name = "3lc"
    homomorphic = False

    def __init__(self, s: float = 1.0, use_zre: bool = True, min_elements: int = 0):
        if not 1.0 <= s < 2.0:
            raise ValueError(f"sparsity multiplier s must satisfy 1 <= s < 2, got {s}")
        self.s, self.use_zre, self.min_elements = float(s), use_zre, int(min_elements)

    def _compress(self, x: np.ndarray, state: dict) -> bytes:
        if x.size < self.min_elements:
            return pack_raw(x)
        err = state.get("e")
        q, m, state["e"] = quantize(x, err if err is not None and err.shape == x.shape else None, self.s)
        return pack(q, m, self.use_zre)

    def encode(self, x, state, rng, ctx: Context) -> bytes:
        return self._compress(np.asarray(x, dtype=np.float32), state)

    def aggregate(self, payloads, ps_state, ctx: Context) -> bytes:
        total = np.zeros(ctx.dim, dtype=np.float32)
        for p in payloads:
            total += unpack(p, ctx.dim)
        ps_state["encodes"] = ps_state.get("encodes", 0) + 1
        return self._compress(total / np.float32(len(payloads)), ps_state)

    def decode(self, payload, ctx: Context) -> np.ndarray:
        return unpack(payload, ctx.dim)
