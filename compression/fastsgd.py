"""FastSGD key–value gradient codec (Yang, Chen, Zeng, Gao); readings in docs/codec-fastsgd.md.

Values (paper §3.2, Alg. 1).  S = Σ|v| over all D nonzeros, sent as float32 (docs/codec-fastsgd.md note 1.9).
The reciprocal mapping R = S/|v| (Eq. 2) and the log code L = ⌈log_b R⌉ (Eq. 3) follow. The
ceiling makes the decoded S·b^−L never exceed |v|. The threshold filter keeps L ≤ τ, i.e.
|v| ≥ S/b^τ, so d ≤ ⌊b^τ⌋. Each kept value costs one byte: sign bit plus L−1 (docs/codec-fastsgd.md A1/A2,
with L clamped to ≥ 1).

Keys (paper §3.3, Alg. 2).  Delta keys Δ₁ = k₁ − base and Δ_j = k_j − k_{j−1} (Eq. 4).
M = bit width of max Δ (docs/codec-fastsgd.md A4: bit_length, at least 1). There are 2^l width classes
w_i = ⌈i·M/2^l⌉ (docs/codec-fastsgd.md A5). Each key is coded as its l-bit class flag followed by Δ in w bits,
MSB first. The entries are interleaved in order, and the stream is zero-padded to a byte.

No error feedback in the paper (docs/codec-fastsgd.md note 1.7). `error_feedback=True` is a labelled extension.
The PS decodes every worker, averages in float64, and re-encodes the mean's nonzeros with
the same (b, τ, l) (docs/codec-fastsgd.md note 1.8).

Message (docs/codec-fastsgd.md note 2.1, little-endian): u8 tag, u8 l, u8 M, u8 τ−1, u32 d, f32 S, f64 b. A frame
(tag 'f', docs/codec-fastsgd.md note 1.8 item 5) then has a u32 base key. After that come d value bytes and the key
bitstream.
"""
from __future__ import annotations

import math
import struct

import numpy as np

from thc_ps.compression.codec import Codec, CodecError, Context

TAG_WHOLE = 0x46          # 'F': one message per gradient
TAG_FRAME = 0x66          # 'f': one frame of a framed gradient, with a base key (docs/codec-fastsgd.md note 1.8 item 5)
HEAD = struct.Struct("<BBBBIfd")        # 20 bytes
BASE = struct.Struct("<I")
KEY_LIMIT = 1 << 32                     # keys are uint32 (docs/codec-fastsgd.md note 1.1, A13)
MAX_TAU, MAX_L, MAX_M = 128, 5, 32


def check_params(b: float, tau: int, l: int) -> None:
    """Spec §1.5 'require': b > 1 finite, τ ∈ [1, 128] (one byte per value), l ∈ [1, 5]."""
    if not (isinstance(b, (int, float, np.floating, np.integer)) and math.isfinite(b) and b > 1):
        raise ValueError(f"FastSGD: log base b must be finite and > 1, got {b!r}")
    if int(tau) != tau or not 1 <= tau <= MAX_TAU:
        raise ValueError(f"FastSGD: tau must be an integer in 1..{MAX_TAU} (one byte per value), got {tau!r}")
    if int(l) != l or not 1 <= l <= MAX_L:
        raise ValueError(f"FastSGD: flag width l must be an integer in 1..{MAX_L}, got {l!r}")


def kept_cap(b: float, tau: int) -> int:
    """⌊b^τ⌋: kept magnitudes sum to at most S and each is ≥ S/b^τ (docs/codec-fastsgd.md note 1.2)."""
    return math.floor(b ** tau)


# ----------------------------------------------------------------------------- values (Alg. 1)

def log_codes(mag: np.ndarray, s: float, b: float, tau: int) -> tuple[np.ndarray, np.ndarray]:
    """Phases 1–3 (Eq. 2, Eq. 3, threshold filter). Returns the indices into `mag` of the kept
    entries (in input order) and their codes L ∈ [1, τ].

    The prefilter |v| ≥ S/b^τ is Alg. 1's early stop, made slightly conservative, and it is done
    in the input's precision (float32 stays float32), so the full-length passes stay cheap. The log is then
    computed only for the candidates. L is corrected in both directions to the smallest integer
    with b^L ≥ R in float64, so the ceiling survives fp error in log(). The test L ≤ τ is the
    authoritative filter (docs/codec-fastsgd.md A12). L = 0 only when the message has a single nonzero, and it is
    clamped to 1 (docs/codec-fastsgd.md A2).
    """
    mag = np.asarray(mag)
    if mag.dtype not in (np.float32, np.float64):
        mag = mag.astype(np.float64)
    s = float(s)
    if mag.size == 0 or s == 0.0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # compare in the input's precision against a slightly lowered threshold: a superset, never a miss
    cand = np.flatnonzero(mag >= mag.dtype.type(s / float(b) ** tau * (1 - 1e-6)))
    r = s / mag[cand].astype(np.float64)
    code = np.ceil(np.log(r) / math.log(b))
    code += np.power(b, code) < r
    code -= np.power(b, code - 1) >= r
    keep = code <= tau
    return cand[keep], np.maximum(code[keep], 1).astype(np.int64)


def value_bytes(code: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """One byte per kept value: bit 7 = sign (1 = negative), bits 0–6 = L − 1 (docs/codec-fastsgd.md note 1.3, A1)."""
    return ((np.asarray(negative, np.uint8) << 7) | (np.asarray(code) - 1).astype(np.uint8)).astype(np.uint8)


def value_decode(vbytes: np.ndarray, s: float, b: float) -> np.ndarray:
    """Inverse of Eqs. 2–3: ±S·b^−L from a 128-entry float64 table (docs/codec-fastsgd.md note 1.6).

    The float32 cast rounds toward zero. For float32 inputs the decoded magnitude therefore never
    exceeds |v|, which is the underestimate property of §3.2, now after the cast as well.
    """
    table = float(s) * np.power(float(b), -np.arange(1, MAX_TAU + 1, dtype=np.float64))
    mag64 = table[vbytes & 0x7F]
    mag32 = mag64.astype(np.float32)
    over = mag32.astype(np.float64) > mag64
    mag32[over] = np.nextafter(mag32[over], np.float32(0))
    return np.where(vbytes >> 7, -mag32, mag32)


# ----------------------------------------------------------------------------- keys (Alg. 2)

def width_classes(m: int, l: int) -> np.ndarray:
    """w_i = ⌈i·M/2^l⌉ for i = 1..2^l (docs/codec-fastsgd.md A5; M/4, M/2, 3M/4, M for l = 2 and 4 | M)."""
    k = 1 << l
    return np.array([-(-i * m // k) for i in range(1, k + 1)], dtype=np.int64)


def key_fields(delta: np.ndarray, l: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Phase 5: (M, codes, lengths). Each code is flag(i−1) ‖ Δ in w_i bits, where i is the
    smallest class with Δ < 2^{w_i} (Alg. 2 getLengthFlag, docs/codec-fastsgd.md note 1.4)."""
    delta = np.asarray(delta, dtype=np.int64)
    if delta.size == 0:
        return 0, np.zeros(0, np.uint64), np.zeros(0, np.int64)
    m = max(1, int(delta.max()).bit_length())
    if m > MAX_M:
        raise ValueError(f"FastSGD: key delta {int(delta.max())} wider than {MAX_M} bits")
    w = width_classes(m, l)
    cls = np.searchsorted(np.left_shift(np.int64(1), w), delta, side="right")
    width = w[cls]
    codes = (cls.astype(np.uint64) << width.astype(np.uint64)) | delta.astype(np.uint64)
    return m, codes, l + width


def pack_bits(codes: np.ndarray, lengths: np.ndarray) -> bytes:
    """Concatenate codes[j] in lengths[j] ≤ 64 bits, MSB first, zero-padded to a byte.

    Word-level and O(d): field j starts at bit offset o_j in big-endian 64-bit word o_j >> 6 and
    spills into the next word when it crosses the boundary. Fields are disjoint, so OR-reducing
    the pieces word by word is exact.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return b""
    codes = np.asarray(codes, dtype=np.uint64)
    ends = np.cumsum(lengths)
    offs = ends - lengths
    total = int(ends[-1])
    word = offs >> 6
    r = offs & 63
    over = r + lengths - 64                                   # > 0: bits spilling into word + 1
    first = np.where(over > 0, codes >> np.maximum(over, 0).astype(np.uint64),
                     codes << np.maximum(-over, 0).astype(np.uint64))
    words = np.zeros((total + 63) // 64 + 1, dtype=np.uint64)
    starts = np.flatnonzero(np.concatenate([[True], word[1:] != word[:-1]]))
    words[word[starts]] = np.bitwise_or.reduceat(first, starts)
    sp = np.flatnonzero(over > 0)                             # at most one spill per word
    words[word[sp] + 1] |= codes[sp] << (64 - over[sp]).astype(np.uint64)
    return words.astype(">u8").tobytes()[: (total + 7) // 8]


def encode_keys(keys: np.ndarray, l: int, base: int = 0) -> tuple[int, bytes, int]:
    """Phases 4–5 (Eq. 4 + adaptive binary encoding): (M, stream, key bits before padding).

    Δ₁ = k₁ − base (base = 0 for a whole message; Alg. 2 starts with preKey = 0)."""
    keys = np.asarray(keys, dtype=np.int64)
    delta = np.diff(keys, prepend=np.int64(base))
    if delta.size and (delta[0] < 0 or np.any(delta[1:] <= 0)):
        raise ValueError("FastSGD: keys must be strictly increasing and not below the base key")
    m, codes, lengths = key_fields(delta, l)
    return m, pack_bits(codes, lengths), int(lengths.sum())


def decode_keys(stream: bytes, d: int, m: int, l: int, base: int = 0) -> tuple[np.ndarray, int]:
    """Inverse of encode_keys: (keys int64, key bits). Raises CodecError if the stream is malformed.

    The flags tell where each next entry starts, so the walk is sequential (docs/codec-fastsgd.md note 1.6). The flag and
    the step l + w(flag) are computed with numpy at every bit position. Python then walks the d
    steps, and numpy reads all payloads at once through 64-bit windows. That is O(bits + d).
    """
    nbytes = len(stream)
    if d == 0:
        if nbytes:
            raise CodecError("FastSGD: key bytes present but d = 0")
        return np.zeros(0, np.int64), 0
    if not 1 <= m <= MAX_M:
        raise CodecError(f"FastSGD: key width M = {m} outside 1..{MAX_M}")
    w = width_classes(m, l)
    nbits = 8 * nbytes
    if d * (l + int(w[0])) > nbits:
        raise CodecError(f"FastSGD: key stream of {nbytes} bytes too short for {d} keys")
    buf = np.frombuffer(stream, dtype=np.uint8)
    bits = np.concatenate([np.unpackbits(buf), np.zeros(l, np.uint8)])
    flag = np.zeros(nbits, dtype=np.int16)
    for i in range(l):
        flag = (flag << 1) | bits[i:i + nbits]
    steps = (l + w.astype(np.int16)[flag]).tolist()
    starts = [0] * d
    pos = 0
    for j in range(d):
        if pos >= nbits:
            raise CodecError(f"FastSGD: key stream truncated after {j} of {d} keys")
        starts[j] = pos
        pos += steps[pos]
    if pos > nbits:
        raise CodecError("FastSGD: key stream truncated inside the last key")
    if nbits - pos >= 8:
        raise CodecError(f"FastSGD: {(nbits - pos) // 8} trailing bytes after the key stream")
    if bits[pos:nbits].any():
        raise CodecError("FastSGD: nonzero padding bits after the key stream")
    at = np.asarray(starts, dtype=np.int64) + l
    width = w[flag[at - l]]
    padded = np.concatenate([buf, np.zeros(8, np.uint8)])
    window = padded[(at >> 3)[:, None] + np.arange(8)].view(">u8").ravel().astype(np.uint64)
    delta = ((window << (at & 7).astype(np.uint64)) >> (64 - width).astype(np.uint64)).astype(np.int64)
    if np.any(delta[1:] == 0):
        raise CodecError("FastSGD: zero key delta after the first key (keys must be strictly increasing)")
    keys = base + np.cumsum(delta)
    if keys[-1] >= KEY_LIMIT:
        raise CodecError("FastSGD: key beyond 2^32 - 1")
    return keys, pos


# ----------------------------------------------------------------------------- messages

def _sum_abs(mag: np.ndarray) -> np.float32:
    """S = Σ|v| in float64, rounded to the float32 that goes on the wire (docs/codec-fastsgd.md note 1.9).

    S is finite exactly when every value is finite, so this also rejects NaN/Inf (docs/codec-fastsgd.md note 1.9)."""
    s = float(mag.sum(dtype=np.float64))
    if not math.isfinite(s):
        raise ValueError("FastSGD: NaN or Inf in the gradient values")
    if s > float(np.finfo(np.float32).max):
        raise ValueError(f"FastSGD: L1 norm {s:.3g} does not fit a float32")
    return np.float32(s)


def _validate_keys(keys: np.ndarray, vals: np.ndarray) -> None:
    if keys.ndim != 1 or keys.shape != vals.shape:
        raise ValueError("FastSGD: keys and values must be 1-D arrays of equal length")
    if keys.size and (keys[0] < 0 or keys[-1] >= KEY_LIMIT or np.any(np.diff(keys) <= 0)):
        raise ValueError("FastSGD: keys must be strictly increasing uint32 values")


def _float_values(vals) -> np.ndarray:
    vals = np.asarray(vals)
    return vals if vals.dtype in (np.float32, np.float64) else vals.astype(np.float64)


def _filter(keys, vals, b, tau):
    """Phases 1–3 over a key-value gradient: (kept keys, value bytes, S)."""
    keys, vals = np.asarray(keys), np.asarray(vals)
    if keys.size and not np.issubdtype(keys.dtype, np.integer):
        raise ValueError(f"FastSGD: keys must be integers, got dtype {keys.dtype}")
    if keys.size and keys.dtype == np.uint64 and int(keys.max()) >= KEY_LIMIT:
        raise ValueError("FastSGD: keys must be strictly increasing uint32 values")
    keys, vals = keys.astype(np.int64), _float_values(vals)
    _validate_keys(keys, vals)
    mag = np.abs(vals)
    s = _sum_abs(mag)
    idx, code = log_codes(mag, float(s), b, tau)
    return keys[idx], value_bytes(code, vals[idx] < 0), s


def _filter_dense(x, b, tau):
    """Phases 1–3 over a dense vector: the keys are flatnonzero(x), but zeros can never pass the
    filter (docs/codec-fastsgd.md note 1.1), so the kept keys come straight from the prefilter without listing them."""
    x = _float_values(x).ravel()
    mag = np.abs(x)
    s = _sum_abs(mag)
    idx, code = log_codes(mag, float(s), b, tau)
    return idx.astype(np.int64), value_bytes(code, x[idx] < 0), s


def _message(kept, vb, s, b, tau, l) -> bytes:
    m, stream, _ = encode_keys(kept, l)
    return HEAD.pack(TAG_WHOLE, l, m, tau - 1, kept.size, float(s), float(b)) + vb.tobytes() + stream


def encode(keys, vals, b: float = 1.1, tau: int = 128, l: int = 2) -> bytes:
    """One FastSGD message of a sparse gradient with strictly increasing uint32 keys (docs/codec-fastsgd.md note 1.5).

    Deterministic: there is no randomness anywhere (docs/codec-fastsgd.md note 3 property 11)."""
    check_params(b, tau, l)
    return _message(*_filter(keys, vals, b, tau), b, tau, l)


def encode_dense(x, b: float = 1.1, tau: int = 128, l: int = 2) -> bytes:
    """encode(flatnonzero(x), x[flatnonzero(x)]) in three passes over x (docs/codec-fastsgd.md note 1.1, dense input)."""
    check_params(b, tau, l)
    x = np.asarray(x)
    if x.size > KEY_LIMIT:
        raise ValueError("FastSGD: more than 2^32 coordinates")
    return _message(*_filter_dense(x, b, tau), b, tau, l)


def encode_frames(keys, vals, b: float = 1.1, tau: int = 128, l: int = 2, max_bytes: int = 1400) -> list[bytes]:
    """Framed mode (docs/codec-fastsgd.md note 1.8 item 5): S and the filter use the whole gradient, and the kept entries are
    split into self-contained frames of at most `max_bytes` each. A lost frame loses only its own entries.

    Each frame carries the global S, its own d and M, and base key = its first key (so Δ₁ = 0).
    Entries per frame = ⌊8·(max_bytes − 24) / (8 + l + M_all)⌋, where M_all is the width of the
    largest gap between kept keys. That bounds every frame's payload."""
    check_params(b, tau, l)
    kept, vb, s = _filter(keys, vals, b, tau)
    if kept.size == 0:
        return [HEAD.pack(TAG_FRAME, l, 0, tau - 1, 0, float(s), float(b)) + BASE.pack(0)]
    gaps = np.diff(kept)
    m_all = max(1, int(gaps.max()).bit_length()) if gaps.size else 1
    per = 8 * (max_bytes - HEAD.size - BASE.size) // (8 + l + m_all)
    if per < 1:
        raise ValueError(f"FastSGD: max_bytes = {max_bytes} cannot hold one entry")
    frames = []
    for lo in range(0, kept.size, per):
        k, v = kept[lo:lo + per], vb[lo:lo + per]
        base = int(k[0])
        m, stream, _ = encode_keys(k, l, base)
        frames.append(HEAD.pack(TAG_FRAME, l, m, tau - 1, k.size, float(s), float(b)) + BASE.pack(base)
                      + v.tobytes() + stream)
    return frames


def decode(msg: bytes):
    """(keys int64 ascending, values float32, header dict) of one message or frame.

    Every inconsistency raises CodecError (docs/codec-fastsgd.md note 6 item 6): bad tag, l, τ, M, b or S, a d that
    disagrees with the length, codes above τ, a truncated stream, trailing bytes, nonzero padding,
    zero deltas, or keys ≥ 2^32."""
    msg = bytes(msg)
    if len(msg) < HEAD.size:
        raise CodecError(f"FastSGD message of {len(msg)} bytes is shorter than its {HEAD.size}-byte header")
    tag, l, m, tau1, d, s, b = HEAD.unpack_from(msg)
    if tag not in (TAG_WHOLE, TAG_FRAME):
        raise CodecError(f"FastSGD: unknown tag 0x{tag:02x}")
    if not 1 <= l <= MAX_L:
        raise CodecError(f"FastSGD: flag width l = {l} outside 1..{MAX_L}")
    if tau1 >= MAX_TAU:
        raise CodecError(f"FastSGD: tau = {tau1 + 1} above {MAX_TAU}")
    if m > MAX_M or (m == 0) != (d == 0):
        raise CodecError(f"FastSGD: key width M = {m} inconsistent with d = {d}")
    if not (math.isfinite(b) and b > 1):
        raise CodecError(f"FastSGD: bad log base b = {b!r}")
    if not (math.isfinite(s) and s >= 0) or (d and s == 0):
        raise CodecError(f"FastSGD: bad L1 norm S = {s!r} for d = {d}")
    pos, base = HEAD.size, 0
    if tag == TAG_FRAME:
        if len(msg) < pos + BASE.size:
            raise CodecError("FastSGD frame shorter than its header")
        (base,) = BASE.unpack_from(msg, pos)
        pos += BASE.size
    if len(msg) < pos + d:
        raise CodecError(f"FastSGD: d = {d} values do not fit the {len(msg)}-byte message")
    vb = np.frombuffer(msg, dtype=np.uint8, count=d, offset=pos)
    if d and int((vb & 0x7F).max()) > tau1:
        raise CodecError(f"FastSGD: value code above tau = {tau1 + 1}")
    keys, key_bits = decode_keys(msg[pos + d:], d, m, l, base)
    vals = value_decode(vb, s, b)
    header = {"tag": chr(tag), "l": l, "M": m, "tau": tau1 + 1, "d": d, "S": s, "b": b, "base": base,
              "key_bits": key_bits, "header_bytes": pos}
    return keys, vals, header


def message_stats(msg: bytes, nonzeros: int, dim: int) -> dict:
    """The docs/codec-fastsgd.md note 2.2 numbers for one message: d/D, bits/key, CR_kv, CR_payload and CR_dense."""
    _, _, h = decode(msg)
    d, size = h["d"], len(msg)
    payload_bits = 8 * d + h["key_bits"]
    return {"d": d, "kept_fraction": d / nonzeros if nonzeros else 0.0, "bytes": size,
            "bits_per_key": h["key_bits"] / d if d else 0.0,
            "cr_kv": 8 * nonzeros / size, "cr_payload": 64 * nonzeros / payload_bits if d else math.inf,
            "cr_dense": 4 * dim / size}


# ----------------------------------------------------------------------------- codec

class FastSGDCodec(Codec):
    """FastSGD in THC-PS: a dense float32 tensor comes in, and its nonzeros are the keys (docs/codec-fastsgd.md note 1.1).

    error_feedback: off by default, because the paper keeps no residual (docs/codec-fastsgd.md note 1.7). When it is on
        (a labelled extension), the worker encodes g + e and keeps e ← (g + e) − ĝ, where ĝ is
        exactly what the PS decodes.
    reduce: "mean" (default; the Codec contract) or "sum". This is what the PS re-encodes
        (docs/codec-fastsgd.md note 1.8 item 2).
    """

    name = "fastsgd"
    label = "FastSGD"
    homomorphic = False

    def __init__(self, b: float = 1.1, tau: int = 128, l: int = 2, error_feedback: bool = False,
                 reduce: str = "mean"):
        check_params(b, tau, l)
        if reduce not in ("mean", "sum"):
            raise ValueError(f"FastSGD: reduce must be 'mean' or 'sum', got {reduce!r}")
        self.b, self.tau, self.l = float(b), int(tau), int(l)
        self.error_feedback, self.reduce = bool(error_feedback), reduce

    def new_state(self) -> dict:
        return {"e": None} if self.error_feedback else {}

    def _encode_dense(self, x: np.ndarray) -> bytes:
        return encode_dense(x, self.b, self.tau, self.l)

    def _sparse(self, payload: bytes, dim: int) -> tuple[np.ndarray, np.ndarray]:
        keys, vals, h = decode(payload)
        if (h["b"], h["tau"], h["l"]) != (self.b, self.tau, self.l):
            raise CodecError(f"FastSGD payload has (b, tau, l) = ({h['b']}, {h['tau']}, {h['l']}), "
                             f"this codec uses ({self.b}, {self.tau}, {self.l})")
        if h["tag"] != chr(TAG_WHOLE):
            raise CodecError("FastSGD: a frame where a whole message was expected")
        if keys.size and keys[-1] >= dim:
            raise CodecError(f"FastSGD: key {int(keys[-1])} beyond the tensor dimension {dim}")
        return keys, vals

    def encode(self, x, state, rng, ctx: Context) -> bytes:
        x = np.asarray(x).ravel()
        if x.size != ctx.dim:
            raise ValueError(f"FastSGD: tensor has {x.size} coordinates, context says {ctx.dim}")
        if not self.error_feedback:
            return self._encode_dense(x)
        memory = self.memory(state)
        comp = memory.compensate("e", x, dtype=np.float64)
        payload = self._encode_dense(comp)
        keys, vals = self._sparse(payload, x.size)
        comp[keys] -= vals
        memory.update("e", comp)
        return payload

    def aggregate(self, payloads, ps_state, ctx: Context) -> bytes:
        """Decode every payload, sum exactly in float64, take the mean (or sum), and re-encode
        (docs/codec-fastsgd.md note 1.8)."""
        return self._encode_dense(self.decoded_mean(payloads, ctx, mean=self.reduce == "mean"))

    def decode(self, payload, ctx: Context) -> np.ndarray:
        keys, vals = self._sparse(payload, ctx.dim)
        out = np.zeros(ctx.dim, dtype=np.float32)
        out[keys] = vals
        return out
