"""CASQ: cluster-aware sketch quantization, per shared/specs/casq.md.

Per worker and tensor (paper §3.2–3.4, Alg. 1):
  * sign-aware 1-D K-means (K = 2^b): K/2 centers on the non-positive and K/2 on the positive
    sample values, quantile-initialised Lloyd (spec §3.2 [REC]); refit every τ steps on a
    10% sample (and at the first step, spec A2);
  * bucket allocation m_k = round(m·H_k·μ_k / Σ H_i·μ_i), m = ⌈ρN⌉, floored at 10 (§3.2),
    H_k the entropy of cluster k on a common 64-bin grid (spec A3), μ_k its share;
  * the cluster id of every coordinate (b bits) and, per cluster, the average of the values
    hashed (fmix32 of index ⊕ seed, mod m_k) into each bucket, as float32 (§3.5);
  * decode: ĝ(i) = S_{C(i)}[h_{C(i)}(i)] — the orthogonal projection onto the cell-constant
    vectors (sum-preserving, never longer than g);
  * optional error feedback e ← g̃ − ĝ (Alg. 1; on by default, as the analysis needs it).
The PS decodes every worker, averages, and re-encodes the mean with its own CASQ context
(the paper broadcasts float32 parameters instead; `downlink="float32"` does that).

Message (spec §5, little-endian): u8 magic 0x43, u8 version 1, u8 b, u32 N, u32 seed,
u32 × K bucket counts, ids as a contiguous LSB-first b-bit stream, float32 bucket averages.
Version 2 marks a raw float32 message (small tensors or the float32 downlink).
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

from compression.codec import Codec, CodecError, Context

MAGIC, V_SKETCH, V_RAW = 0x43, 1, 2
HEAD = struct.Struct("<BBBII")


def fmix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser (spec §3.4 [REC])."""
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x = (x * np.uint32(0x85EBCA6B)).astype(np.uint32)
    x ^= x >> np.uint32(13)
    x = (x * np.uint32(0xC2B2AE35)).astype(np.uint32)
    x ^= x >> np.uint32(16)
    return x


def kmeans1d(values: np.ndarray, k: int, iters: int = 300) -> np.ndarray:
    """Lloyd's algorithm in 1-D with quantile initialisation; sorted centers."""
    if values.size == 0:
        return np.zeros(1)
    v = np.sort(values.astype(np.float64))
    c = np.quantile(v, (np.arange(k) + 0.5) / k)
    for _ in range(iters):
        mids = (c[1:] + c[:-1]) / 2
        lab = np.searchsorted(mids, v)
        sums = np.bincount(lab, v, minlength=k)
        cnt = np.bincount(lab, minlength=k)
        new = np.where(cnt > 0, sums / np.maximum(cnt, 1), c)
        if np.allclose(new, c, rtol=0, atol=0):
            break
        c = new
    return np.sort(c)


def assign(x: np.ndarray, c_neg: np.ndarray, c_pos: np.ndarray) -> np.ndarray:
    """Nearest center of the same sign (spec §3.3); zeros go to the non-positive side."""
    half = c_neg.size
    neg = np.searchsorted((c_neg[1:] + c_neg[:-1]) / 2, x)
    pos = half + np.searchsorted((c_pos[1:] + c_pos[:-1]) / 2, x)
    return np.where(x > 0, pos, neg).astype(np.uint8)


def fit(x: np.ndarray, bits: int, rng: np.random.Generator, *, rho: float = 0.005, sample: float = 0.1,
        bins: int = 64, m_min: int = 10) -> dict:
    """init_casq (spec §3.9): centers per sign and bucket sizes from a sample of x."""
    n = x.size
    k = 1 << bits
    take = min(n, max(1000, round(sample * n)))
    s = x if take >= n else x[rng.choice(n, take, replace=False)]
    half = k // 2
    c_neg = kmeans1d(s[s <= 0], half) if bits > 1 else np.array([s[s <= 0].mean() if np.any(s <= 0) else 0.0])
    c_pos = kmeans1d(s[s > 0], half) if bits > 1 else np.array([s[s > 0].mean() if np.any(s > 0) else 0.0])
    lab = assign(s, c_neg, c_pos)
    mu = np.bincount(lab, minlength=k) / s.size
    lo, hi = float(s.min()), float(s.max())
    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
    ent = np.zeros(k)
    for j in range(k):
        vals = s[lab == j]
        if vals.size:
            f = np.histogram(vals, edges)[0] / vals.size
            f = f[f > 0]
            ent[j] = float(-(f * np.log2(f)).sum())
    w = ent * mu
    w = w / w.sum() if w.sum() > 0 else np.full(k, 1.0 / k)
    m = int(np.ceil(rho * n))
    est_size = np.maximum(1, np.round(mu * n)).astype(np.int64)
    sizes = np.minimum(np.maximum(np.round(m * w).astype(np.int64), m_min), np.maximum(est_size, 1))
    return {"c_neg": c_neg, "c_pos": c_pos, "sizes": sizes.astype(np.int64)}


def _keys(n: int, ids: np.ndarray, sizes: np.ndarray, seed: int) -> np.ndarray:
    off = np.concatenate([[0], np.cumsum(sizes)])
    h = fmix32(np.arange(n, dtype=np.uint32) ^ np.uint32(seed)).astype(np.int64)
    return off[ids] + h % sizes[ids]


def compress(x: np.ndarray, st: dict, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, bucket averages float32) — one bincount over (cluster, bucket) keys (§3.5)."""
    ids = assign(x, st["c_neg"], st["c_pos"])
    key = _keys(x.size, ids, st["sizes"], seed)
    total = int(st["sizes"].sum())
    sums = np.bincount(key, x.astype(np.float64), total)
    cnt = np.bincount(key, minlength=total)
    return ids, (sums / np.maximum(cnt, 1)).astype(np.float32)


def decompress(ids: np.ndarray, avg: np.ndarray, sizes: np.ndarray, seed: int) -> np.ndarray:
    return avg[_keys(ids.size, ids, sizes, seed)]


def pack(bits: int, seed: int, ids: np.ndarray, sizes: np.ndarray, avg: np.ndarray) -> bytes:
    shifts = np.arange(bits, dtype=np.uint8)
    stream = np.packbits(((ids[:, None] >> shifts) & 1).astype(np.uint8).ravel(), bitorder="little")
    return (HEAD.pack(MAGIC, V_SKETCH, bits, ids.size, seed) + sizes.astype("<u4").tobytes()
            + stream.tobytes() + avg.astype("<f4").tobytes())


def pack_raw(x: np.ndarray) -> bytes:
    return HEAD.pack(MAGIC, V_RAW, 0, x.size, 0) + np.asarray(x, dtype="<f4").tobytes()


def unpack(payload: bytes, n_expected: int) -> np.ndarray:
    if len(payload) < HEAD.size:
        raise CodecError("CASQ message shorter than its header")
    magic, version, bits, n, seed = HEAD.unpack_from(payload)
    if magic != MAGIC or n != n_expected:
        raise CodecError(f"CASQ: bad magic or dimension ({n} != {n_expected})")
    if version == V_RAW:
        if len(payload) != HEAD.size + 4 * n:
            raise CodecError("CASQ raw message has the wrong length")
        return np.frombuffer(payload, dtype="<f4", offset=HEAD.size).astype(np.float32)
    if version != V_SKETCH or not 1 <= bits <= 8:
        raise CodecError(f"CASQ: unknown version {version} or bits {bits}")
    k = 1 << bits
    off = HEAD.size
    if len(payload) < off + 4 * k:
        raise CodecError("CASQ: truncated bucket counts")
    sizes = np.frombuffer(payload, dtype="<u4", count=k, offset=off).astype(np.int64)
    off += 4 * k
    id_bytes = -(-n * bits // 8)
    total = int(sizes.sum())
    if np.any(sizes == 0) or len(payload) != off + id_bytes + 4 * total:
        raise CodecError("CASQ: message length disagrees with its header")
    stream = np.unpackbits(np.frombuffer(payload, dtype=np.uint8, count=id_bytes, offset=off),
                           bitorder="little")[:n * bits].reshape(n, bits)
    ids = (stream.astype(np.uint16) << np.arange(bits, dtype=np.uint16)).sum(axis=1).astype(np.int64)
    if ids.size and ids.max() >= k:
        raise CodecError("CASQ: cluster id out of range")
    avg = np.frombuffer(payload, dtype="<f4", count=total, offset=off + id_bytes)
    return decompress(ids, avg, sizes, seed).astype(np.float32)


def bits_per_coordinate(payload: bytes) -> float:
    """Everything on the wire: ids, bucket floats and header, per coordinate (spec §5)."""
    n = HEAD.unpack_from(payload)[3]
    return 8.0 * len(payload) / n if n else 0.0


class CASQCodec(Codec):
    """CASQ with per-(worker, tensor) centers, sizes and error feedback in the codec state."""

    name = "casq"
    homomorphic = False

    def __init__(self, bits: int = 2, rho: float = 0.005, refit_every: int = 100, sample: float = 0.1,
                 error_feedback: bool = True, min_elements: int = 1001, downlink: str = "casq"):
        if not 1 <= bits <= 8:
            raise ValueError(f"CASQ bits per cluster id must be in 1..8, got {bits}")
        if downlink not in ("casq", "float32"):
            raise ValueError("downlink must be 'casq' or 'float32'")
        self.bits, self.rho, self.refit_every, self.sample = bits, rho, refit_every, sample
        self.error_feedback, self.min_elements, self.downlink = error_feedback, min_elements, downlink

    def _encode(self, x: np.ndarray, state: dict, rng, key: str) -> bytes:
        if x.size < self.min_elements:
            return pack_raw(x)
        err = state.get("e") if self.error_feedback else None
        xe = (x + err) if err is not None and err.shape == x.shape else x
        step = state.get("t", 0)
        if "fit" not in state or step % self.refit_every == 0:
            state["fit"] = fit(xe, self.bits, rng if rng is not None else np.random.default_rng(step),
                               rho=self.rho, sample=self.sample)
        state["t"] = step + 1
        seed = zlib.crc32(key.encode()) & 0xFFFFFFFF
        ids, avg = compress(xe, state["fit"], seed)
        if self.error_feedback:
            state["e"] = (xe - decompress(ids.astype(np.int64), avg, state["fit"]["sizes"], seed)).astype(np.float32)
        return pack(self.bits, seed, ids, state["fit"]["sizes"], avg)

    def encode(self, x, state, rng, ctx: Context) -> bytes:
        return self._encode(np.asarray(x, dtype=np.float32), state, rng, ctx.key)

    def aggregate(self, payloads, ps_state, ctx: Context) -> bytes:
        total = np.zeros(ctx.dim, dtype=np.float64)
        for p in payloads:
            total += unpack(p, ctx.dim)
        mean = (total / len(payloads)).astype(np.float32)
        if self.downlink == "float32":
            return pack_raw(mean)
        rng = ps_state.setdefault("rng", np.random.default_rng(0))
        return self._encode(mean, ps_state, rng, ctx.key)

    def decode(self, payload, ctx: Context) -> np.ndarray:
        return unpack(payload, ctx.dim)
