"""3LC (Lim, Andersen, Kaminsky, MLSys 2019); readings in docs/codec-3lc.md.

Three stages (paper §3, docs/codec-3lc.md note 2.2):
  1. 3-value quantization with sparsity multiplication and error accumulation (§3.1):
     A = E + x, M = max|A|, m = s·M, q = round(A/m) ∈ {−1, 0, 1}, E ← A − m·q.
  2. Base-3^5 encoding (§3.2): 5 trits per byte, values 0..242. Default layout is planar
     (byte j holds elements j, j+L, …, j+4L), and the pad digit is 0, applied after the +1
     shift (docs/codec-3lc.md A4/A5). A flag bit selects the alternative consecutive layout.
  3. Zero-run encoding (§3.3): k ≥ 2 consecutive 121 bytes (all-zero quintuples) become
     243 + k − 2. Runs longer than 14 are split greedily into 14-chunks (docs/codec-3lc.md A6). The decoder
     accepts any valid split.

Directions (docs/codec-3lc.md note 2.8): every worker has a push context per tensor (the error buffer in the
worker `state`). The PS keeps ONE pull context per tensor (`ps_state`), shared by all workers.
`aggregate` decodes the pushes, averages them, compresses the mean once with that context,
and every worker gets the same bytes. THC-PS keeps no model on the PS, so the averaged
gradient takes the place of the paper's model delta. Under plain SGD the two differ only by
the learning-rate factor, and error feedback makes the stream equal to W − W̃ (docs/codec-3lc.md A11).

Wire framing (docs/codec-3lc.md note 3.1, little-endian, 14-byte header):
  u8 codec id (3) | u8 flags | u32 n | f32 m | u32 payload length | payload
  flags: bit0 ZRE applied, bit1 raw float32 fallback (excluded tensor, docs/codec-3lc.md A12),
         bit2 consecutive base-3^5 layout (clear = planar, docs/codec-3lc.md A4). Other bits must be 0.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from thc_ps.compression.codec import Codec, CodecError, Context, header_bytes

CODEC_ID = 3
F_ZRE, F_RAW, F_CONSECUTIVE = 0x01, 0x02, 0x04
HEAD = struct.Struct("<BBIfI")
ZERO_BYTE = 121                    # base-3^5 byte of five zero trits (d = 1,1,1,1,1)
RUN_MIN, RUN_MAX = 243, 255        # ZRE run bytes: 243 + k − 2 stands for k = 2..14 zero bytes
MAX_RUN = RUN_MAX - RUN_MIN + 2    # 14
LAYOUTS = ("planar", "consecutive")
_F32_MAX = np.float32(np.finfo(np.float32).max)

# _DIGITS[b] = the five base-3 digits of byte b, most significant (P0) first (docs/codec-3lc.md note 2.5 decode).
_DIGITS = np.stack([(np.arange(243) // p) % 3 for p in (81, 27, 9, 3, 1)], axis=1).astype(np.uint8)


def check_s(s: float) -> float:
    """The sparsity multiplier must satisfy 1 ≤ s < 2 (§3.1, docs/codec-3lc.md note 2.3)."""
    if not (isinstance(s, (int, float, np.floating, np.integer)) and 1.0 <= s < 2.0):
        raise ValueError(f"3LC: sparsity multiplier s must satisfy 1 <= s < 2, got {s!r}")
    return float(s)


# ----------------------------------------------------------------------------- stage 1

def accumulate(x: np.ndarray, error: np.ndarray | None) -> np.ndarray:
    """Step [1] of Fig. 2: A = E + x in float32, flattened row-major (docs/codec-3lc.md note 2.2, A7)."""
    a = np.asarray(x, dtype=np.float32).ravel()
    if error is None:
        return a.copy()
    if error.shape != a.shape:
        raise ValueError(f"3LC: error buffer has shape {error.shape}, input has {a.shape}")
    return a + error


def scale(a: np.ndarray, s: float) -> np.float32:
    """m = s · max|A| as float32 (§3.1, docs/codec-3lc.md A3/A7); 0 for an all-zero or empty A (docs/codec-3lc.md A2).

    Non-finite A is refused (docs/codec-3lc.md A2). If s·M overflows float32 (our choice, not in the paper),
    m is clamped to the largest float32: then M ≤ m < s·M, so M/m > 1/s > 1/2, q stays
    ternary, the largest element is still sent and |A − m·q| ≤ m/2 < M still holds.
    """
    if a.size == 0:
        return np.float32(0.0)
    big_m = max(float(a.max()), -float(a.min()))
    if not np.isfinite(big_m):
        raise ValueError("3LC: input (plus error buffer) holds NaN or Inf")
    with np.errstate(over="ignore"):
        m = np.float32(big_m * s)
    return min(m, _F32_MAX)


def quantize(x: np.ndarray, error: np.ndarray | None, s: float):
    """One compression step on the sender: returns (q int8, m float32, new error buffer).

    q = rint(A/m) (half to even, docs/codec-3lc.md A1) with A = E + x and m = scale(A, s); the new buffer
    is the exact float32 residual A − m·q, added back at coefficient 1 next step (§3.1,
    docs/codec-3lc.md note 2.4). For m = 0, q = 0 and E = A = 0 (docs/codec-3lc.md A2).
    """
    s = check_s(s)
    a = accumulate(x, error)
    m = scale(a, s)
    if m == 0:
        return np.zeros(a.size, np.int8), np.float32(0.0), a
    q = np.rint(a / m).astype(np.int8)
    a -= m * q.astype(np.float32)                 # in place: A becomes the residual A − m·q
    return q, m, a


def dequantize(q: np.ndarray, m: np.float32) -> np.ndarray:
    """x̂ = m · q in float32 (§3.1): exactly {−m, 0, +m}."""
    return (np.float32(m) * np.asarray(q, dtype=np.float32)).astype(np.float32)


# ----------------------------------------------------------------------------- stage 2

def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"3LC: layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def base35_encode(q: np.ndarray, layout: str = "planar") -> np.ndarray:
    """Base-3^5 bytes of trits q (§3.2, docs/codec-3lc.md note 2.5): ceil(n/5) bytes, each 0..242.

    d = q + 1, zero-padded to 5L. Planar: byte j = Σ_k 3^(4−k)·d[kL + j], so P0 = d[0:L] is the
    most significant digit. Consecutive (docs/codec-3lc.md A4 alternative): byte j = digits d[5j..5j+4].
    uint8 arithmetic cannot overflow: the running sum never exceeds 242.
    """
    _check_layout(layout)
    q = np.asarray(q).ravel()
    if q.size and (int(q.min()) < -1 or int(q.max()) > 1):
        raise ValueError("3LC: base-3^5 input must be trits in {-1, 0, 1}")
    d = np.zeros(-(-q.size // 5) * 5, np.uint8)
    d[:q.size] = q + 1
    p = d.reshape(5, -1) if layout == "planar" else d.reshape(-1, 5).T
    b = p[0] * np.uint8(81)
    for k, w in ((1, 27), (2, 9), (3, 3)):
        b += p[k] * np.uint8(w)
    b += p[4]
    return b


def _checked_base35(b, n: int, layout: str) -> np.ndarray:
    """b as flat uint8 after checking that it holds exactly ⌈n/5⌉ valid base-3^5 bytes."""
    _check_layout(layout)
    b = np.asarray(b, dtype=np.uint8).ravel()
    if n < 0 or b.size != -(-n // 5):
        raise CodecError(f"3LC: {b.size} base-3^5 bytes cannot hold {n} values")
    if b.size and int(b.max()) > 242:
        raise CodecError("3LC: base-3^5 byte above 242")
    return b


def base35_digits(b: np.ndarray, n: int, layout: str = "planar") -> np.ndarray:
    """The first n digits d ∈ {0,1,2} (= q + 1) held by base-3^5 bytes b, in element order."""
    b = _checked_base35(b, n, layout)
    dig = _DIGITS[b]                                    # (L, 5): row j = digits of byte j
    flat = dig.T.ravel() if layout == "planar" else dig.ravel()
    return flat[:n]


def base35_decode(b: np.ndarray, n: int, layout: str = "planar") -> np.ndarray:
    """Inverse of base35_encode: n trits as int8 (pad digits dropped, docs/codec-3lc.md A5)."""
    return base35_digits(b, n, layout).astype(np.int8) - np.int8(1)


def base35_dequantize(b: np.ndarray, n: int, m: np.float32, layout: str = "planar") -> np.ndarray:
    """m·q straight from base-3^5 bytes (docs/codec-3lc.md note 2.7 steps 3–4 fused): a 243×5 float32 table of
    {−m, 0, m} per digit position, gathered once per plane, so no digit array is built."""
    b = _checked_base35(b, n, layout)
    table = np.array([-m, 0.0, m], dtype=np.float32)[_DIGITS]          # (243, 5)
    if layout == "consecutive":
        return table[b].ravel()[:n]
    out = np.empty((5, b.size), np.float32)
    for k in range(5):                                                  # plane k = P_k
        np.take(np.ascontiguousarray(table[:, k]), b, out=out[k])
    return out.ravel()[:n]


# ----------------------------------------------------------------------------- stage 3

def zre_encode(b: np.ndarray) -> np.ndarray:
    """Zero-run encoding (§3.3, docs/codec-3lc.md note 2.6), vectorised over runs; same bytes as the serial
    greedy encoder: a run of k bytes 121 becomes ⌊k/14⌋ × 255, then 121 if k mod 14 = 1 or
    243 + (k mod 14) − 2 if k mod 14 ≥ 2. That is ceil(k/14) bytes, the minimum (docs/codec-3lc.md A6)."""
    b = np.asarray(b, dtype=np.uint8).ravel()
    z = b == ZERO_BYTE
    if not z.any():
        return b.copy()
    zp = np.zeros(b.size + 2, bool)
    zp[1:-1] = z
    edge = np.flatnonzero(zp[1:] != zp[:-1])               # run boundaries alternate start/end
    starts, ends = edge[0::2], edge[1::2]
    k = ends - starts
    chunks = -(-k // MAX_RUN)
    if chunks.max() == 1:
        pos, rest = starts, k
    else:                                                   # runs longer than 14
        run = np.repeat(np.arange(k.size), chunks)
        j = np.arange(run.size) - np.repeat(np.cumsum(chunks) - chunks, chunks)
        pos, rest = starts[run] + MAX_RUN * j, np.minimum(MAX_RUN, k[run] - MAX_RUN * j)
    keep = ~z
    keep[pos] = True
    out = b.copy()
    out[pos] = np.where(rest == 1, ZERO_BYTE, RUN_MIN - 2 + rest)
    return out.take(np.flatnonzero(keep))                  # faster than boolean indexing


def zre_counts(c: np.ndarray) -> np.ndarray:
    """How many base-3^5 bytes each ZRE byte stands for: c − 241 for c ≥ 243, else 1."""
    c = np.asarray(c, dtype=np.uint8).ravel()
    return np.where(c >= RUN_MIN, c.astype(np.int64) - (RUN_MIN - 2), 1)


def zre_decode(c: np.ndarray, expected: int | None = None) -> np.ndarray:
    """Expand run bytes 243..255 into c − 241 copies of 121 (§3.3). Any valid split of a run
    is accepted (docs/codec-3lc.md note 2.6: [243,243], [121,121], [250,255] …). With `expected`, a stream
    that would expand to a different length is refused before anything is allocated."""
    c = np.asarray(c, dtype=np.uint8).ravel()
    counts = zre_counts(c)
    if expected is not None and int(counts.sum()) != expected:
        raise CodecError(f"3LC: zero-run stream expands to {int(counts.sum())} bytes, expected {expected}")
    run = c >= RUN_MIN
    if not run.any():
        return c.copy()
    return np.repeat(np.where(run, np.uint8(ZERO_BYTE), c), counts)


def _zero_len(byte: int) -> int:
    """Zero bytes a single ZRE byte stands for (0 if it is a literal non-zero byte)."""
    return 1 if byte == ZERO_BYTE else (byte - (RUN_MIN - 2) if byte >= RUN_MIN else 0)


def zre_encode_parallel(b: np.ndarray, parts: int) -> np.ndarray:
    """Parallel ZRE as sketched in §3.3 (docs/codec-3lc.md note 2.6): encode `parts` contiguous chunks
    independently, then coalesce each boundary: if the last byte of one chunk and the first
    byte of the next both stand for zeros and their run lengths add up to 2..14, they become
    one byte. Output decodes to b and is at most parts − 1 bytes longer than zre_encode(b)."""
    if parts < 1:
        raise ValueError("3LC: parts must be >= 1")
    b = np.asarray(b, dtype=np.uint8).ravel()
    pieces = [zre_encode(p) for p in np.array_split(b, parts)]
    out: list[np.ndarray] = []
    for piece in pieces:
        if out and piece.size:
            left, right = _zero_len(int(out[-1][-1])), _zero_len(int(piece[0]))
            if left and right and left + right <= MAX_RUN:
                out[-1] = out[-1].copy()
                out[-1][-1] = RUN_MIN - 2 + left + right
                piece = piece[1:]
        if piece.size:
            out.append(piece)
    return np.concatenate(out) if out else np.zeros(0, np.uint8)


def zre_decode_parallel(c: np.ndarray, parts: int) -> np.ndarray:
    """Parallel ZRE decode (docs/codec-3lc.md note 2.6, A9): split the stream, place each piece at the prefix
    sum of the pieces' expanded lengths, decode the pieces independently."""
    if parts < 1:
        raise ValueError("3LC: parts must be >= 1")
    pieces = np.array_split(np.asarray(c, dtype=np.uint8).ravel(), parts)
    offsets = np.cumsum([0] + [int(zre_counts(p).sum()) for p in pieces])
    out = np.empty(int(offsets[-1]), np.uint8)
    for p, lo, hi in zip(pieces, offsets[:-1], offsets[1:]):
        out[lo:hi] = zre_decode(p)
    return out


# ----------------------------------------------------------------------------- framing

class Header(NamedTuple):
    flags: int
    n: int
    m: float
    length: int


def pack(q: np.ndarray, m: np.float32, use_zre: bool = True, layout: str = "planar") -> bytes:
    """One 3LC message for trits q with scale m (docs/codec-3lc.md note 3.1 framing)."""
    b = base35_encode(q, layout)
    body = zre_encode(b) if use_zre else b
    flags = (F_ZRE if use_zre else 0) | (F_CONSECUTIVE if layout == "consecutive" else 0)
    return HEAD.pack(CODEC_ID, flags, q.size, float(m), body.size) + body.tobytes()


def pack_raw(x: np.ndarray) -> bytes:
    """Uncompressed float32 message for an excluded tensor (docs/codec-3lc.md note 2.8, A12)."""
    body = np.asarray(x, dtype="<f4").ravel().tobytes()
    return HEAD.pack(CODEC_ID, F_RAW, len(body) // 4, 0.0, len(body)) + body


def parse(payload: bytes, n_expected: int | None = None) -> tuple[Header, np.ndarray]:
    """Validate the framing; returns (header, body bytes). Raises CodecError on any mismatch."""
    payload = header_bytes(payload, HEAD, "3LC")
    cid, flags, n, m, length = HEAD.unpack_from(payload)
    if cid != CODEC_ID:
        raise CodecError(f"3LC: bad codec id {cid} (expected {CODEC_ID})")
    if flags & ~(F_ZRE | F_RAW | F_CONSECUTIVE) or (flags & F_RAW and flags != F_RAW):
        raise CodecError(f"3LC: invalid flags {flags:#04x}")
    if n_expected is not None and n != n_expected:
        raise CodecError(f"3LC: message holds {n} values, expected {n_expected}")
    if len(payload) != HEAD.size + length:
        raise CodecError(f"3LC: payload length field {length} disagrees with the "
                         f"{len(payload) - HEAD.size} bytes after the header")
    body = np.frombuffer(payload, dtype=np.uint8, offset=HEAD.size)
    if flags & F_RAW:
        if length != 4 * n or m != 0.0:
            raise CodecError("3LC: raw float32 message with wrong length or nonzero scale")
    else:
        if not (np.isfinite(m) and m >= 0.0):
            raise CodecError(f"3LC: scale m = {m} is not a finite non-negative float32")
        if not flags & F_ZRE and length != -(-n // 5):
            raise CodecError(f"3LC: {length} base-3^5 bytes cannot hold {n} values")
    return Header(flags, n, m, length), body


def _layout(flags: int) -> str:
    return "consecutive" if flags & F_CONSECUTIVE else "planar"


def unpack_trits(payload: bytes, n_expected: int | None = None) -> tuple[np.ndarray, np.float32]:
    """(q int8, m) of a quantized (non-raw) message, fully validated (docs/codec-3lc.md note 2.7)."""
    head, body = parse(payload, n_expected)
    if head.flags & F_RAW:
        raise CodecError("3LC: raw float32 message has no trits")
    b = zre_decode(body, -(-head.n // 5)) if head.flags & F_ZRE else body
    q = base35_decode(b, head.n, _layout(head.flags))
    if head.m == 0.0 and q.any():
        raise CodecError("3LC: nonzero trits with scale m = 0")
    return q, np.float32(head.m)


def unpack(payload: bytes, n_expected: int) -> np.ndarray:
    """Decode one 3LC message to float32 values: m·q, or the raw fallback (docs/codec-3lc.md note 2.7)."""
    head, body = parse(payload, n_expected)
    if head.flags & F_RAW:
        out = body.view("<f4").astype(np.float32)
        if not np.isfinite(out).all():
            raise CodecError("3LC: raw float32 message holds NaN or Inf")
        return out
    b = zre_decode(body, -(-head.n // 5)) if head.flags & F_ZRE else body
    if head.m == 0.0 and (base35_digits(b, head.n, _layout(head.flags)) != 1).any():
        raise CodecError("3LC: nonzero trits with scale m = 0")
    return base35_dequantize(b, head.n, np.float32(head.m), _layout(head.flags))


def message_stats(payload: bytes) -> dict:
    """Per-message stats (docs/codec-3lc.md note 8): values, scale, nonzero fraction, payload-only bits per
    value (the paper's Table 2 accounting, docs/codec-3lc.md A8) and wire bits per value (header included)."""
    head, _ = parse(payload)
    raw = bool(head.flags & F_RAW)
    nz = 1.0 if raw else (float(np.count_nonzero(unpack_trits(payload)[0])) / head.n if head.n else 0.0)
    per = 8.0 / head.n if head.n else 0.0
    return {"n": head.n, "m": head.m, "raw": raw, "zre": bool(head.flags & F_ZRE),
            "layout": None if raw else _layout(head.flags), "nonzero_fraction": nz,
            "payload_bits": head.length * per, "wire_bits": len(payload) * per}


def payload_bits_per_value(payload: bytes) -> float:
    """Payload-only bits per value (Table 2 accounting: no m, header or raw tensors; docs/codec-3lc.md A8)."""
    head, _ = parse(payload)
    return 8.0 * head.length / head.n if head.n else 0.0


# ----------------------------------------------------------------------------- codec

class ThreeLCCodec(Codec):
    """3LC: push contexts in the worker state, one shared pull context in the PS state.

    s: sparsity multiplier, 1 ≤ s < 2 (default 1.0, §3.1). use_zre: zero-run encoding on
    (off gives the fixed 1.6-bit "No ZRE" variant of Table 2). min_elements: tensors with
    fewer values travel as raw float32, as the paper does for batch-norm layers (docs/codec-3lc.md A12;
    default 0 compresses everything). layout: base-3^5 grouping, planar as in §3.2.
    """

    name = "3lc"
    label = "3LC"
    homomorphic = False

    def __init__(self, s: float = 1.0, use_zre: bool = True, min_elements: int = 0,
                 layout: str = "planar"):
        self.s = check_s(s)
        self.use_zre = bool(use_zre)
        if int(min_elements) != min_elements or min_elements < 0:
            raise ValueError(f"3LC: min_elements must be a non-negative integer, got {min_elements!r}")
        self.min_elements = int(min_elements)
        self.layout = _check_layout(layout)

    def new_state(self) -> dict:
        """Push context: the worker's error buffer E for one tensor (starts at 0, docs/codec-3lc.md note 2.1)."""
        return {"e": None}

    def new_ps_state(self) -> dict:
        """Pull context: the PS's one error buffer per tensor, shared by all workers (§3)."""
        return {"e": None, "encodes": 0}

    def compress(self, x: np.ndarray, ctx_state: dict) -> bytes:
        """Compress x with one compression context (docs/codec-3lc.md note 2.2); updates ctx_state['e']."""
        x = np.asarray(x, dtype=np.float32).ravel()
        if x.size < self.min_elements:
            if not np.isfinite(x).all():
                raise ValueError("3LC: input holds NaN or Inf")
            return pack_raw(x)
        memory = self.memory(ctx_state)
        q, m, e = quantize(x, memory.get("e"), self.s)
        memory.update("e", e)
        return pack(q, m, self.use_zre, self.layout)

    def encode(self, x, state, rng, ctx: Context) -> bytes:
        x = np.asarray(x, dtype=np.float32).ravel()
        if x.size != ctx.dim:
            raise ValueError(f"3LC: input has {x.size} values, context says {ctx.dim}")
        return self.compress(x, state)

    def aggregate(self, payloads, ps_state, ctx: Context) -> bytes:
        """Decode every push, average over len(payloads) (docs/codec-3lc.md A14), compress the mean ONCE with
        the shared pull context; every worker pulls these same bytes (§3, docs/codec-3lc.md note 2.8)."""
        mean = self.decoded_mean(payloads, ctx).astype(np.float32)
        out = self.compress(mean, ps_state)
        ps_state["encodes"] = ps_state.get("encodes", 0) + 1
        return out

    def decode(self, payload, ctx: Context) -> np.ndarray:
        return unpack(payload, ctx.dim)

    def bits_per_coordinate(self, payload: bytes, dim: int) -> float:
        return 8.0 * len(payload) / dim
