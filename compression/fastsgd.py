"""FastSGD (key–value gradient codec), per shared/specs/fastsgd.md.

Value encoder (paper §3.2, Alg. 1): S = Σ|v| over all nonzeros (float32 on the wire);
reciprocal mapping R = S/|v| (Eq. 2); logarithmic quantization L = ⌈log_b R⌉ (Eq. 3,
ceiling: decoded magnitudes S·b^−L never exceed |v|); threshold filter L ≤ τ, i.e.
|v| ≥ S/b^τ; one byte per kept value: sign bit and L − 1 (spec A1/A2: L clamped to ≥ 1).

Key encoder (paper §3.3, Alg. 2): delta keys (Δ₁ = k₁), M = bit width of max Δ (spec A4:
bit_length, at least 1), 2^l width classes w_i = ⌈i·M/2^l⌉ (spec A5); each key is an
l-bit class flag and Δ in w bits, MSB first, interleaved, zero-padded to a byte.

No error feedback (paper §1.7).  The PS decodes every worker, averages densely, and
re-encodes the mean's nonzeros with the same (b, τ, l) (spec §1.8).

Message (spec §2.1, little-endian): u8 tag 0x46, u8 l, u8 M, u8 τ−1, u32 d, f32 S,
f64 b, then d value bytes, then the key bitstream.
"""
from __future__ import annotations

import math
import struct

import numpy as np

from compression.codec import Codec, CodecError, Context

TAG = 0x46
HEAD = struct.Struct("<BBBBIfd")


def _check_params(b: float, tau: int, l: int) -> None:
    if not b > 1:
        raise ValueError(f"log base b must exceed 1, got {b}")
    if not 1 <= tau <= 128:
        raise ValueError(f"tau must be in 1..128 (one byte per value), got {tau}")
    if not 1 <= l <= 5:
        raise ValueError(f"flag width l must be in 1..5, got {l}")


def widths(m: int, l: int) -> np.ndarray:
    """w_i = ceil(i·M / 2^l) for i = 1..2^l."""
    k = 1 << l
    return np.array([-(-i * m // k) for i in range(1, k + 1)], dtype=np.int64)


def encode_values(keys: np.ndarray, vals: np.ndarray, b: float, tau: int):
    """(kept keys, value bytes, S as float32) — Alg. 1 with the spec's numerics (§1.9)."""
    vals = np.asarray(vals, dtype=np.float64)
    if not np.all(np.isfinite(vals)):
        raise ValueError("FastSGD: NaN or Inf in the gradient")
    s = np.float32(np.abs(vals).sum())
    if keys.size == 0 or s == 0:
        return keys[:0].astype(np.int64), np.zeros(0, np.uint8), np.float32(0.0)
    s64 = float(s)
    mag = np.abs(vals)
    cand = mag >= s64 / b ** tau * (1 - 1e-12)
    ratio = s64 / mag[cand]
    lcode = np.ceil(np.log(ratio) / math.log(b)).astype(np.int64)
    lcode += (b ** lcode.astype(np.float64) < ratio)          # keep b^L ≥ R despite fp error
    keep = lcode <= tau
    lcode = np.maximum(lcode[keep], 1)
    kept = keys[cand][keep].astype(np.int64)
    neg = (vals[cand][keep] < 0).astype(np.uint8)
    return kept, ((neg << 7) | (lcode - 1).astype(np.uint8)).astype(np.uint8), s


def encode_keys(keys: np.ndarray, l: int) -> tuple[int, bytes]:
    """(M, bitstream) of the delta keys with l-bit width-class flags (Alg. 2)."""
    if keys.size == 0:
        return 0, b""
    delta = np.diff(keys, prepend=0).astype(np.int64)
    m = max(1, int(delta.max()).bit_length())
    if m > 32:
        raise ValueError("FastSGD: key deltas wider than 32 bits")
    w = widths(m, l)
    cls = np.searchsorted((np.int64(1) << w), delta, side="right")   # smallest i: Δ < 2^w_i
    width = w[cls]
    code = (cls.astype(np.uint64) << width.astype(np.uint64)) | delta.astype(np.uint64)
    length = l + width
    total = int(length.sum())
    # bit matrix: for each entry, its `length` bits MSB first, right-aligned in 37 columns
    span = l + m
    shifts = np.arange(span - 1, -1, -1, dtype=np.uint64)
    bits = ((code[:, None] >> shifts[None, :]) & np.uint64(1)).astype(np.uint8)
    valid = np.arange(span)[None, :] >= (span - length)[:, None]
    stream = bits[valid]
    assert stream.size == total
    return m, np.packbits(stream).tobytes()


def decode_keys(stream: bytes, d: int, m: int, l: int) -> np.ndarray:
    """Sequential decode of d interleaved (flag, Δ) entries; validates padding and deltas."""
    if d == 0:
        if stream:
            raise CodecError("FastSGD: key bytes without keys")
        return np.zeros(0, np.int64)
    if not 1 <= m <= 32:
        raise CodecError(f"FastSGD: key width M={m} outside 1..32")
    w = widths(m, l).tolist()
    bits = np.unpackbits(np.frombuffer(stream, dtype=np.uint8))
    nbits = bits.size
    # integer view of the bitstream for fast windowed reads
    as_int = int.from_bytes(stream, "big")
    pos, prev = 0, 0
    keys = np.empty(d, np.int64)
    for j in range(d):
        if pos + l > nbits:
            raise CodecError("FastSGD: key stream truncated")
        flag = (as_int >> (nbits - pos - l)) & ((1 << l) - 1)
        pos += l
        width = w[flag]
        if pos + width > nbits:
            raise CodecError("FastSGD: key stream truncated")
        delta = (as_int >> (nbits - pos - width)) & ((1 << width) - 1)
        pos += width
        if j > 0 and delta == 0:
            raise CodecError("FastSGD: zero key delta")
        prev += delta
        keys[j] = prev
    if nbits - pos >= 8 or (nbits - pos and bits[pos:].any()):
        raise CodecError("FastSGD: trailing bytes or nonzero padding in the key stream")
    if prev >= 1 << 32:
        raise CodecError("FastSGD: key beyond 2^32")
    return keys


def encode(keys, vals, b: float = 1.1, tau: int = 128, l: int = 2) -> bytes:
    """One FastSGD message of a sparse gradient (strictly increasing uint32 keys)."""
    _check_params(b, tau, l)
    keys = np.asarray(keys, dtype=np.int64)
    if keys.size and (keys.min() < 0 or keys.max() >= 1 << 32 or np.any(np.diff(keys) <= 0)):
        raise ValueError("FastSGD: keys must be strictly increasing uint32")
    kept, vbytes, s = encode_values(keys, vals, b, tau)
    m, kbytes = encode_keys(kept, l)
    return HEAD.pack(TAG, l, m, tau - 1, kept.size, float(s), b) + vbytes.tobytes() + kbytes


def decode(msg: bytes):
    """(keys int64, values float32, header dict) of one message; CodecError if malformed."""
    if len(msg) < HEAD.size:
        raise CodecError("FastSGD message shorter than its header")
    tag, l, m, tau1, d, s, b = HEAD.unpack_from(msg)
    if tag != TAG or not 1 <= l <= 5 or m > 32 or not b > 1 or not math.isfinite(s) or s < 0:
        raise CodecError("FastSGD: bad header")
    if (d == 0) != (m == 0) or len(msg) < HEAD.size + d:
        raise CodecError("FastSGD: header disagrees with the message length")
    vb = np.frombuffer(msg, dtype=np.uint8, count=d, offset=HEAD.size)
    lcode = (vb & 0x7F).astype(np.int64) + 1
    if lcode.size and lcode.max() > tau1 + 1:
        raise CodecError("FastSGD: value code above tau")
    keys = decode_keys(msg[HEAD.size + d:], d, m, l)
    mag = float(s) * np.power(b, -lcode.astype(np.float64))
    vals = np.where(vb >> 7, -mag, mag).astype(np.float32)
    return keys, vals, {"l": l, "M": m, "tau": tau1 + 1, "d": d, "S": s, "b": b}


class FastSGDCodec(Codec):
    """FastSGD through THC-PS: dense float32 in, the nonzeros are the keys."""

    name = "fastsgd"
    homomorphic = False

    def __init__(self, b: float = 1.1, tau: int = 128, l: int = 2):
        _check_params(b, tau, l)
        self.b, self.tau, self.l = b, tau, l

    def encode(self, x, state, rng, ctx: Context) -> bytes:
        keys = np.flatnonzero(x)
        return encode(keys, np.asarray(x)[keys], self.b, self.tau, self.l)

    def _dense(self, payload: bytes, dim: int) -> np.ndarray:
        keys, vals, _ = decode(payload)
        if keys.size and keys[-1] >= dim:
            raise CodecError(f"FastSGD: key {int(keys[-1])} beyond the dimension {dim}")
        out = np.zeros(dim, dtype=np.float64)
        out[keys] = vals
        return out

    def aggregate(self, payloads, ps_state, ctx: Context) -> bytes:
        acc = np.zeros(ctx.dim, dtype=np.float64)
        for p in payloads:
            acc += self._dense(p, ctx.dim)
        mean = acc / len(payloads)
        keys = np.flatnonzero(mean)
        return encode(keys, mean[keys], self.b, self.tau, self.l)

    def decode(self, payload, ctx: Context) -> np.ndarray:
        return self._dense(payload, ctx.dim).astype(np.float32)
