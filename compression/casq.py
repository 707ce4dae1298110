"""CASQ: cluster-aware sketch quantization (Ge et al., Sci China Inf Sci 2023); readings in docs/codec-casq.md.

Per worker and tensor (paper §3.2–3.4, Alg. 1; docs/codec-casq.md note 3):
  * sign-aware 1-D K-means, K = 2^b: K/2 centers fitted on the non-positive and K/2 on the
    positive values of a 10% sample, quantile-initialised Lloyd (docs/codec-casq.md note 3.2); refit every
    τ steps and at the first step (docs/codec-casq.md A2), on the error-compensated vector (docs/codec-casq.md A1);
  * bucket allocation m_k = round(m·H_k·μ_k / Σ H_i·μ_i), m = ⌈ρN⌉, floored at m_min = 10 and
    capped at max(1, N̂_k) (§3.2, docs/codec-casq.md note 3.2.6), H_k the entropy of cluster k on a common 64-bin
    grid (docs/codec-casq.md A3), μ_k its share of the sample (docs/codec-casq.md A4, literal reading);
  * the message carries the cluster id of every coordinate (b bits) and, per cluster, the average
    of the values whose index hashes (murmur3 fmix32 of i ⊕ seed, mod m_k; docs/codec-casq.md note 3.4) into each
    bucket, as float32 (§3.2 step 3, docs/codec-casq.md note 3.5);
  * decode ĝ(i) = S_{C(i)}[h_{C(i)}(i)] (eq. 2, docs/codec-casq.md note 3.6): the orthogonal projection onto the
    vectors constant on every (cluster, bucket) cell — sum-preserving, ‖ĝ‖ ≤ ‖g‖, sign-safe;
  * optional error feedback e ← g̃ − ĝ (Alg. 1 line 9; on by default, docs/codec-casq.md A11).
The PS decodes every worker, averages, and re-encodes the mean with its own CASQ context and
its own error feedback (the decode–sum–re-encode baseline); `downlink="float32"` instead sends
the mean uncompressed, as the paper's server broadcasts full-precision parameters (docs/codec-casq.md note 3.7).

Message (docs/codec-casq.md note 5, little-endian): u8 magic 0x43 ('C'), u8 kind (1 = sketch, 2 = raw float32),
u8 b, u32 N, u32 hash seed, u32 × K bucket counts m_k, ids as one contiguous LSB-first b-bit
stream of ⌈N·b/8⌉ bytes, float32 bucket averages S_0 ‖ … ‖ S_{K−1}.  A raw message (tensors
with N < min_numel, or the float32 downlink) is the 11-byte header with b = 0 and seed = 0,
then N float32.  Bits per coordinate = b + 32·Σm_k/N + 8·(11 + 4K)/N, everything counted.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

from thc_ps.compression.codec import Codec, CodecError, Context, header_bytes

MAGIC, KIND_SKETCH, KIND_RAW = 0x43, 1, 2
HEAD = struct.Struct("<BBBII")          # magic, kind, b, N, seed: 11 bytes (docs/codec-casq.md note 5)
ALLOCS = ("paper", "even", "center_entropy", "variance")


# ----------------------------------------------------------------------------- hashing (§3.4)

def fmix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser, elementwise on uint32 (docs/codec-casq.md note 3.4)."""
    x = np.asarray(x, dtype=np.uint32).copy()
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x85EBCA6B)
    x ^= x >> np.uint32(13)
    x *= np.uint32(0xC2B2AE35)
    x ^= x >> np.uint32(16)
    return x


def index_hash(n: int, seed: int) -> np.ndarray:
    """h(i) = fmix32(i ⊕ seed) for i < n, as int64; bucket = h mod m_k (docs/codec-casq.md note 3.4, A6)."""
    return fmix32(np.arange(n, dtype=np.uint32) ^ np.uint32(seed & 0xFFFFFFFF)).astype(np.int64)


def tensor_seed(key: str, seed: int = 0, round_no: int = 0, reseed: bool = False) -> int:
    """One 32-bit hash seed per tensor, from its name (docs/codec-casq.md note 3.4); optionally per round too."""
    s = (zlib.crc32(key.encode()) ^ seed) & 0xFFFFFFFF
    if reseed:
        s = int(fmix32(np.array([s ^ (round_no * 0x9E3779B9 & 0xFFFFFFFF)]))[0])
    return s


# ------------------------------------------------------------------------- clustering (§3.2–3.3)

def kmeans1d(values: np.ndarray, k: int, iters: int = 300) -> np.ndarray:
    """Lloyd's 1-D K-means with quantile initialisation (j+0.5)/k, sorted centers (docs/codec-casq.md note 3.2.4).

    On the sorted sample every cluster is a contiguous run, so one iteration is k binary
    searches plus prefix sums.  An empty input gives k dummy centers at 0 (docs/codec-casq.md note 3.2.3).
    """
    if values.size == 0:
        return np.zeros(k)
    v = np.sort(values.astype(np.float64))
    csum = np.concatenate([[0.0], np.cumsum(v)])
    c = np.quantile(v, (np.arange(k) + 0.5) / k)
    bounds = None
    for _ in range(iters):
        # assignment rule of `assign`: x goes to the number of midpoints strictly below it
        new_bounds = np.concatenate([[0], np.searchsorted(v, (c[1:] + c[:-1]) / 2, side="right"), [v.size]])
        if bounds is not None and np.array_equal(new_bounds, bounds):
            break
        bounds = new_bounds
        cnt = np.diff(bounds)
        sums = csum[bounds[1:]] - csum[bounds[:-1]]
        c = np.where(cnt > 0, sums / np.maximum(cnt, 1), c)
    return c


def fit_centers(sample: np.ndarray, bits: int, sign_split: bool = True) -> np.ndarray:
    """K = 2^b sorted centers; with sign_split the first K/2 fit the values ≤ 0, the rest > 0."""
    k = 1 << bits
    if not sign_split:
        return kmeans1d(sample, k)
    return np.concatenate([kmeans1d(sample[sample <= 0], k // 2), kmeans1d(sample[sample > 0], k // 2)])


def assign(x: np.ndarray, centers: np.ndarray, sign_split: bool = True) -> np.ndarray:
    """Cluster id: nearest center, of the same sign with sign_split (paper §3.2 step 1, docs/codec-casq.md note 3.3).

    Zeros go to the non-positive side; ids are ordered negative side then positive side.
    """
    if not sign_split:
        return np.searchsorted((centers[1:] + centers[:-1]) / 2, x).astype(np.uint8)
    half = centers.size // 2
    cn, cp = centers[:half], centers[half:]
    neg = np.searchsorted((cn[1:] + cn[:-1]) / 2, x)
    pos = half + np.searchsorted((cp[1:] + cp[:-1]) / 2, x)
    return np.where(x > 0, pos, neg).astype(np.uint8)


def cluster_entropies(sample: np.ndarray, lab: np.ndarray, k: int, bins: int = 64) -> np.ndarray:
    """H_k = −Σ_j f_j log2 f_j over a common equal-width grid on [min, max] (paper §3.2, docs/codec-casq.md A3)."""
    lo, hi = float(sample.min()), float(sample.max())
    width = (hi - lo) / bins if hi > lo else 1.0
    b = np.minimum(((sample - lo) / width).astype(np.int64), bins - 1)
    hist = np.bincount(lab.astype(np.int64) * bins + b, minlength=k * bins).reshape(k, bins).astype(np.float64)
    tot = hist.sum(axis=1, keepdims=True)
    f = hist / np.maximum(tot, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.sum(np.where(f > 0, f * np.log2(np.where(f > 0, f, 1)), 0.0), axis=1)


def allocate(n: int, rho: float, mu: np.ndarray, ent: np.ndarray, centers: np.ndarray, ss: np.ndarray,
             alloc: str = "paper", m_min: int = 10) -> np.ndarray:
    """Bucket counts m_k (paper §3.2; docs/codec-casq.md note 3.2.6 and A4).

    m = ⌈ρN⌉ split by weight w_k, rounded, floored at m_min, capped at max(1, N̂_k = μ_k·N):
      paper: H_k·μ_k (μ_k = the cluster's share, literal reading); even: 1 per non-empty cluster;
      center_entropy: H_k·|c_k|/max|c| ([REF]); variance: within-cluster sum of squares (not paper).
    A zero total weight falls back to even allocation over the non-empty clusters.
    """
    k = mu.size
    occupied = mu > 0
    if alloc == "paper":
        w = ent * mu
    elif alloc == "even":
        w = occupied.astype(np.float64)
    elif alloc == "center_entropy":
        top = np.abs(centers).max()
        w = ent * np.abs(centers) / top if top > 0 else np.zeros(k)
    elif alloc == "variance":
        w = ss.astype(np.float64)
    else:
        raise ValueError(f"alloc must be one of {ALLOCS}, got {alloc!r}")
    w = np.where(occupied, w, 0.0)
    if w.sum() <= 0:
        w = occupied.astype(np.float64) if occupied.any() else np.ones(k)
    m = int(np.ceil(rho * n))
    sizes = np.maximum(np.round(m * w / w.sum()).astype(np.int64), m_min)
    cap = np.maximum(1, np.round(mu * n).astype(np.int64))
    return np.minimum(sizes, cap)


def fit(x: np.ndarray, bits: int, rng: np.random.Generator, *, rho: float = 0.005, sample_ratio: float = 0.1,
        bins: int = 64, m_min: int = 10, alloc: str = "paper", sign_split: bool = True) -> dict:
    """init_casq (docs/codec-casq.md note 3.2, note 3.9): centers and bucket counts from a uniform sample of x.

    Sample size max(1000, round(ratio·N)) without replacement (all of x if that is N or more).
    """
    n = x.size
    k = 1 << bits
    take = max(1000, round(sample_ratio * n))
    s = x.astype(np.float64) if take >= n else x[rng.choice(n, take, replace=False)].astype(np.float64)
    centers = fit_centers(s, bits, sign_split)
    lab = assign(s, centers, sign_split)
    cnt = np.bincount(lab, minlength=k)
    mu = cnt / s.size
    ent = cluster_entropies(s, lab, k, bins)
    means = np.bincount(lab, s, minlength=k) / np.maximum(cnt, 1)
    ss = np.bincount(lab, (s - means[lab]) ** 2, minlength=k)
    sizes = allocate(n, rho, mu, ent, centers, ss, alloc, m_min)
    return {"centers": centers, "sizes": sizes}


# --------------------------------------------------------------------------- sketch (§3.5–3.6)

def cell_keys(ids: np.ndarray, sizes: np.ndarray, seed: int) -> np.ndarray:
    """Flat cell index offset[C(i)] + h(i) mod m_{C(i)} (docs/codec-casq.md note 3.5)."""
    off = np.concatenate([[0], np.cumsum(sizes)])
    ids = ids.astype(np.int64)
    return off[ids] + index_hash(ids.size, seed) % sizes[ids]


def sketch(x: np.ndarray, ids: np.ndarray, sizes: np.ndarray, seed: int) -> np.ndarray:
    """Bucket averages S = Σ g / count per cell, 0 for an empty cell, float32 (paper Alg. 1 l. 20–28)."""
    key = cell_keys(ids, sizes, seed)
    total = int(sizes.sum())
    sums = np.bincount(key, x.astype(np.float64), minlength=total)
    cnt = np.bincount(key, minlength=total)
    return (sums / np.maximum(cnt, 1)).astype(np.float32)


def unsketch(ids: np.ndarray, avg: np.ndarray, sizes: np.ndarray, seed: int) -> np.ndarray:
    """ĝ(i) = S_{C(i)}[h_{C(i)}(i)]: one gather (paper eq. 2, Alg. 1 l. 29–35)."""
    return avg[cell_keys(ids, sizes, seed)]


# ------------------------------------------------------------------------------ wire (§5)

def pack_ids(ids: np.ndarray, bits: int) -> bytes:
    """Contiguous LSB-first stream of b-bit ids, ⌈N·b/8⌉ bytes, zero padding (docs/codec-casq.md note 5)."""
    planes = (ids.astype(np.uint8)[:, None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(planes.ravel(), bitorder="little").tobytes()


def unpack_ids(buf: bytes, n: int, bits: int) -> np.ndarray:
    """Inverse of pack_ids; nonzero padding bits mean corruption."""
    flat = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little")
    if flat[n * bits:].any():
        raise CodecError("CASQ: nonzero padding bits after the cluster ids")
    planes = flat[:n * bits].reshape(n, bits)
    return (planes << np.arange(bits, dtype=np.uint8)).sum(axis=1, dtype=np.int64)


def pack(bits: int, seed: int, ids: np.ndarray, sizes: np.ndarray, avg: np.ndarray) -> bytes:
    """One sketch message (docs/codec-casq.md note 5 layout)."""
    return (HEAD.pack(MAGIC, KIND_SKETCH, bits, ids.size, seed) + np.asarray(sizes, dtype="<u4").tobytes()
            + pack_ids(ids, bits) + np.asarray(avg, dtype="<f4").tobytes())


def pack_raw(x: np.ndarray) -> bytes:
    """Raw float32 message: small tensors (docs/codec-casq.md note 5, A8) and the float32 downlink."""
    return HEAD.pack(MAGIC, KIND_RAW, 0, x.size, 0) + np.asarray(x, dtype="<f4").tobytes()


def message_size(n: int, bits: int, sizes) -> int:
    """Bytes of a sketch message: 11 + 4K + ⌈N·b/8⌉ + 4·Σm_k (docs/codec-casq.md note 5)."""
    return HEAD.size + 4 * (1 << bits) + -(-n * bits // 8) + 4 * int(np.sum(sizes))


def parse(payload: bytes, n_expected: int):
    """Validate a message; returns ("raw", values) or ("sketch", (bits, seed, ids, sizes, avg))."""
    payload = header_bytes(payload, HEAD, "CASQ")
    magic, kind, bits, n, seed = HEAD.unpack_from(payload)
    if magic != MAGIC:
        raise CodecError(f"CASQ: bad magic byte 0x{magic:02x}")
    if n != n_expected:
        raise CodecError(f"CASQ: message is for {n} coordinates, expected {n_expected}")
    if kind == KIND_RAW:
        if bits != 0 or seed != 0 or len(payload) != HEAD.size + 4 * n:
            raise CodecError("CASQ: raw message has a bad header or length")
        vals = np.frombuffer(payload, dtype="<f4", offset=HEAD.size).astype(np.float32)
        if not np.isfinite(vals).all():
            raise CodecError("CASQ: raw message holds non-finite values")
        return "raw", vals
    if kind != KIND_SKETCH:
        raise CodecError(f"CASQ: unknown message kind {kind}")
    if not 1 <= bits <= 8:
        raise CodecError(f"CASQ: bits per cluster id must be 1..8, got {bits}")
    k = 1 << bits
    off = HEAD.size
    if len(payload) < off + 4 * k:
        raise CodecError("CASQ: message truncated inside the bucket counts")
    sizes = np.frombuffer(payload, dtype="<u4", count=k, offset=off).astype(np.int64)
    if (sizes == 0).any():
        raise CodecError("CASQ: a cluster has zero buckets")
    if len(payload) != message_size(n, bits, sizes):
        raise CodecError(f"CASQ: message is {len(payload)} bytes, its header implies {message_size(n, bits, sizes)}")
    off += 4 * k
    id_bytes = -(-n * bits // 8)
    ids = unpack_ids(payload[off:off + id_bytes], n, bits)
    avg = np.frombuffer(payload, dtype="<f4", offset=off + id_bytes)
    if not np.isfinite(avg).all():
        raise CodecError("CASQ: non-finite bucket average")
    return "sketch", (bits, seed, ids, sizes, avg)


def decode_message(payload: bytes, n_expected: int) -> np.ndarray:
    """Dense float32 ĝ from a validated message (stateless; docs/codec-casq.md note 9)."""
    kind, body = parse(payload, n_expected)
    if kind == "raw":
        return body
    bits, seed, ids, sizes, avg = body
    return unsketch(ids, avg, sizes, seed).astype(np.float32)


def bits_per_coordinate(payload: bytes) -> float:
    """Everything on the wire (ids, bucket floats, header) per coordinate (docs/codec-casq.md note 5)."""
    n = HEAD.unpack_from(payload)[3]
    return 8.0 * len(payload) / n if n else 0.0


# -------------------------------------------------------------------------------- codec

class CASQCodec(Codec):
    """CASQ with per-(worker, tensor) centers, bucket counts, step counter and EF residual in the state.

    Parameters (docs/codec-casq.md note 2, note 9): bits b per cluster id; sketch_ratio ρ (m = ⌈ρN⌉); refit_every τ;
    sample_ratio for the K-means sample; m_min; entropy_bins; alloc (see `allocate`);
    sign_split; min_numel (smaller tensors go raw, docs/codec-casq.md A8); error_feedback; seed (xored into
    the per-tensor hash seed); reseed (new hash every round, off: not in the paper);
    fit_on "compensated" (g + e, docs/codec-casq.md A1) or "raw" (g); downlink "casq" or "float32".
    """

    name = "casq"
    label = "CASQ"
    homomorphic = False

    def __init__(self, bits: int = 2, sketch_ratio: float = 0.005, refit_every: int = 100,
                 sample_ratio: float = 0.1, m_min: int = 10, entropy_bins: int = 64, alloc: str = "paper",
                 sign_split: bool = True, min_numel: int = 1001, error_feedback: bool = True, seed: int = 0,
                 reseed: bool = False, fit_on: str = "compensated", downlink: str = "casq"):
        if not 1 <= bits <= 8:
            raise ValueError(f"CASQ bits per cluster id must be in 1..8, got {bits}")
        if not sketch_ratio > 0 or not 0 < sample_ratio <= 1:
            raise ValueError("sketch_ratio must be > 0 and sample_ratio in (0, 1]")
        if refit_every < 1 or m_min < 1 or entropy_bins < 1:
            raise ValueError("refit_every, m_min and entropy_bins must be positive")
        if alloc not in ALLOCS:
            raise ValueError(f"alloc must be one of {ALLOCS}, got {alloc!r}")
        if fit_on not in ("compensated", "raw"):
            raise ValueError("fit_on must be 'compensated' or 'raw'")
        if downlink not in ("casq", "float32"):
            raise ValueError("downlink must be 'casq' or 'float32'")
        self.bits, self.sketch_ratio, self.refit_every = bits, sketch_ratio, refit_every
        self.sample_ratio, self.m_min, self.entropy_bins, self.alloc = sample_ratio, m_min, entropy_bins, alloc
        self.sign_split, self.min_numel, self.error_feedback = sign_split, min_numel, error_feedback
        self.seed, self.reseed, self.fit_on, self.downlink = seed, reseed, fit_on, downlink

    def new_state(self) -> dict:
        """Worker state per tensor: 'fit' (centers, sizes), 't' (steps coded), 'e' (EF residual)."""
        return {}

    def new_ps_state(self) -> dict:
        """PS state per tensor: the downlink's own CASQ context (same keys) and its sampling RNG."""
        return {}

    def _encode(self, x: np.ndarray, state: dict, rng, ctx: Context) -> bytes:
        if not np.isfinite(x).all():
            raise CodecError("CASQ: cannot encode non-finite values")
        memory = self.memory(state) if self.error_feedback else None
        xe = memory.compensate("e", x).astype(np.float32, copy=False) if memory else x
        if x.size < self.min_numel:
            if memory:
                memory.update("e", np.zeros_like(x))
            return pack_raw(xe)
        step = state.get("t", 0)
        if "fit" not in state or step % self.refit_every == 0:
            if rng is None:
                rng = np.random.default_rng([self.seed, step])
            state["fit"] = fit(xe if self.fit_on == "compensated" else x, self.bits, rng,
                               rho=self.sketch_ratio, sample_ratio=self.sample_ratio, bins=self.entropy_bins,
                               m_min=self.m_min, alloc=self.alloc, sign_split=self.sign_split)
        state["t"] = step + 1
        seed = tensor_seed(ctx.key, self.seed, ctx.round_no, self.reseed)
        sizes = state["fit"]["sizes"]
        ids = assign(xe, state["fit"]["centers"], self.sign_split)
        avg = sketch(xe, ids, sizes, seed)
        if memory:
            memory.update("e", (xe - unsketch(ids, avg, sizes, seed)).astype(np.float32))
        return pack(self.bits, seed, ids, sizes, avg)

    def encode(self, x, state, rng, ctx: Context) -> bytes:
        x = np.asarray(x, dtype=np.float32).ravel()
        if x.size != ctx.dim:
            raise ValueError(f"CASQ: input has {x.size} coordinates, context says {ctx.dim}")
        return self._encode(x, state, rng, ctx)

    def aggregate(self, payloads, ps_state, ctx: Context) -> bytes:
        """Decode every payload, average over len(payloads), re-encode the mean (docs/codec-casq.md note 3.7)."""
        mean = self.decoded_mean(payloads, ctx).astype(np.float32)
        if self.downlink == "float32":
            return pack_raw(mean)
        rng = ps_state.setdefault("rng", np.random.default_rng([self.seed, 0x5053]))
        return self._encode(mean, ps_state, rng, ctx)

    def decode(self, payload, ctx: Context) -> np.ndarray:
        return decode_message(payload, ctx.dim)


# ------------------------------------------------- comparison quantizers (paper §2.2, docs/codec-casq.md note 8.11)

def uniform_sq(x: np.ndarray, bits: int, rng: np.random.Generator, *, scheme: str = "symmetric",
               bucket: int | None = 512) -> np.ndarray:
    """Unbiased stochastic quantization to uniform levels, the paper's 3-bit comparison class.

    scheme "symmetric": 2^b levels evenly on [−M, M], M = max|x| of the bucket;
    "qinf": sign + (b−1)-bit magnitude, 2^(b−1) levels evenly on [0, M] (Qinf, paper §5.1);
    "minmax": 2^b levels evenly on [min, max] of the bucket (paper §2.2's description).
    bucket=None scales by the whole tensor.  Returns the dequantized float64 vector.
    """
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    step = n if bucket is None else bucket
    pad = -n % step
    v = np.concatenate([x, np.zeros(pad)]).reshape(-1, step)
    if scheme == "qinf":
        hi = np.abs(v).max(axis=1, keepdims=True)
        lo, levels, y = np.zeros_like(hi), (1 << (bits - 1)) - 1, np.abs(v)
    elif scheme == "symmetric":
        hi = np.abs(v).max(axis=1, keepdims=True)
        lo, levels, y = -hi, (1 << bits) - 1, v
    elif scheme == "minmax":
        lo, hi = v.min(axis=1, keepdims=True), v.max(axis=1, keepdims=True)
        levels, y = (1 << bits) - 1, v
    else:
        raise ValueError(f"unknown scheme {scheme!r}")
    if levels < 1:
        raise ValueError("qinf needs bits >= 2")
    width = np.where(hi > lo, (hi - lo) / levels, 1.0)
    t = (y - lo) / width
    q = np.floor(t)
    q += rng.random(t.shape) < (t - q)
    out = lo + q * width
    if scheme == "qinf":
        out *= np.sign(v)
    return out.ravel()[:n]
