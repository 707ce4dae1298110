"""Tensor Homomorphic Compression: the math of one round, as pure functions.

Worker side (paper Alg. 3, §5.1–5.4):
  1. x = ∇ + e                       error feedback
  2. ℓ_j = max over workers of ‖x_j‖  per RHT block j (preliminary stage, §5.2(1))
  3. R_j = H·D_j·x_j                  randomized Hadamard transform (§5.1)
  4. M_j = t_p·ℓ_j/√d_j, m_j = −M_j   clamp R_j to [m_j, M_j]
  5. y = (x' − m)·g/(M − m) ∈ [0, g]  grid coordinates (Alg. 2 line 9)
  6. Z = T⁻¹ by unbiased stochastic rounding of y to its two neighbouring table
     values (App. B: optimal for a fixed table); b-bit indices go on the wire.
  7. e ← x − RHT⁻¹(X)                 carries rounding *and* clamping error
With one sign diagonal for the whole job (rotation "job", not Alg. 3's D^r per round) the
round runs in the rotated domain instead: R = H·D·∇ + e_R (the transform is linear), ℓ_j =
‖R_j‖ (it is orthogonal), Z from R, and e_R ← R − X needs no inverse transform: two FWHTs a
step instead of three (`rotate`, `quantize_rotated`).
PS side (Alg. 2 line 13): Y = Σ_i T[Z_i] in integers.
Worker decode (Alg. 3 lines 19–21): x̂ = RHT⁻¹(m + (Y/k)·(M − m)/g) with k the
number of contributors (k < n under partial aggregation).

Uniform THC (Alg. 1) is the same pipeline with the identity table (g = 2^b − 1),
no transform, and [m, M] the global min/max from the preliminary stage.

Random draws are passed in (``uniforms``: an array of U[0, 1) values, or a
:class:`thc_ps.compression.stochastic.CounterUniforms` stream that the C encode computes in
place), so every function here is deterministic; numpy arrays and torch tensors are both
accepted.
"""
from __future__ import annotations

import math
import os
import threading
from functools import lru_cache
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from thc_ps.compression.cores import idle_cores
from thc_ps.compression.hadamard import fwht, next_pow2, rademacher_bits, rademacher_signs
from thc_ps.compression.stochastic import CounterUniforms, key_from

try:   # fused C kernels for the numpy path; the numpy code below stays the reference
    from thc_ps.compression import _kernels
except ImportError:  # pragma: no cover - source checkout without a build
    _kernels = None
# the job's defaults, one definition
from thc_ps.proto.job import DEFAULT_BLOCK_LOG2, DEFAULT_ROTATION, DEFAULT_TAIL_LOG2, ROTATIONS
from thc_ps.proto.packing import check_lane_capacity, pack_indices, packed_size, unpack_indices
from thc_ps.proto.tables import Table, identity_table, lower_interval_index, parse_p, solve_table


@dataclass(frozen=True)
class ThcConfig:
    """What every worker and the PS of one job agree on."""

    bits: int = 4
    granularity: int = 30
    p: Fraction = Fraction(1, 32)
    lane_bits: int = 8
    block_log2: int = DEFAULT_BLOCK_LOG2
    seed: int = 0
    rotation: str = DEFAULT_ROTATION
    tail_log2: int = DEFAULT_TAIL_LOG2

    def __post_init__(self):
        object.__setattr__(self, "p", parse_p(self.p))
        for name in ("block_log2", "tail_log2"):
            if not 0 <= getattr(self, name) <= 30:
                raise ValueError(f"{name} must be in 0..30, got {getattr(self, name)}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {', '.join(ROTATIONS)}, got {self.rotation!r}")
        _ = self.table  # validates (b, g)

    def sign_round(self, round_no: int) -> int:
        """The round whose sign diagonals D this round uses: its own (Alg. 3's D^r), or
        round 0's in every round of a job with one rotation (docs/protocol.md §4 step 3)."""
        return round_no if self.rotation == "round" else 0

    @property
    def table(self) -> Table:
        return solve_table(self.bits, self.granularity, self.p)

    def check_workers(self, workers: int) -> None:
        """Refuse n·g overflowing the sum lane, before any traffic."""
        check_lane_capacity(workers, self.granularity, self.lane_bits)

    @classmethod
    def of_job(cls, job) -> ThcConfig:
        """The THC parameters of a job (proto/job.py JobConfig)."""
        return cls(bits=job.bits, granularity=job.granularity, p=job.p, lane_bits=job.lane_bits,
                   block_log2=job.block_log2, seed=job.seed, rotation=job.rotation, tail_log2=job.tail_log2)

    def layout(self, dim: int, segments=None) -> Layout:
        """How this job cuts a vector of `dim` coordinates (tensors of `segments` sizes back to
        back, or one tensor) into RHT blocks (`make_layout`).  Kept per (dim, segments): a
        round asks for its layout more than once (the size check, the round, its chunk
        count), and a bucket of tens of tensors takes ~50 µs to cut."""
        return _layout(dim, self.block_log2, self.tail_log2, None if segments is None else tuple(segments))


@dataclass(frozen=True)
class Layout:
    """How a flat vector of d coordinates is cut into power-of-two RHT blocks."""

    dim: int
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    padded: tuple[int, ...]

    @property
    def padded_dim(self) -> int:
        return sum(self.padded)

    def padded_offsets(self) -> list[int]:
        out, acc = [], 0
        for p in self.padded:
            out.append(acc)
            acc += p
        return out


#: How a round's vector is cut into RHT blocks, as a saved state records it: "per-tensor", each
#: tensor of a bucket its own blocks (`make_layout`'s segments).  A job rotation's residual is
#: kept in those blocks, so a residual saved under another rule is not carried over.
BLOCK_RULE = "per-tensor"


def make_layout(dim: int, block_log2: int = DEFAULT_BLOCK_LOG2, tail_log2: int = DEFAULT_TAIL_LOG2,
                segments=None) -> Layout:
    """Blocks of 2^block_log2 coordinates, then the rest r < 2^block_log2 in power-of-two blocks
    (docs/protocol.md §4 step 1): r rounded up to a multiple of 2^tail_log2 and cut at its binary
    digits, largest block first, the last one padded with zeros; a rest of at most 2^tail_log2
    is one block, padded to its next power of two.  So a tensor carries fewer than 2^tail_log2
    coordinates of padding where one block of next_pow2(r) could nearly double it (a DDP bucket
    of 570,112 floats: 573,440 coordinates instead of 1,048,576).

    `segments`: the sizes of the tensors the vector holds back to back (a DDP bucket's
    parameters, a model's gradients); each is cut by the rule on its own, its blocks after the
    last one's.  A block then never mixes two tensors, so each tensor is quantized on its own
    norm's scale: the error THC bounds by a block's norm (§5) stays in proportion to that
    tensor's gradient instead of the bucket's largest (docs/design.md, "A block never spans
    two tensors")."""
    if segments is not None:
        if sum(segments) != dim or min(segments, default=0) < 0:
            raise ValueError(f"segments must be sizes adding up to {dim:,}, got {len(segments)} "
                             f"adding up to {sum(segments):,}")
        segments = [n for n in segments if n]           # an empty tensor has no blocks
    if segments is not None and len(segments) > 1:
        starts, lengths, padded, at = [], [], [], 0
        for n in segments:
            one = make_layout(n, block_log2, tail_log2)
            starts += [at + s for s in one.starts]
            lengths += one.lengths
            padded += one.padded
            at += n
        return Layout(dim, tuple(starts), tuple(lengths), tuple(padded))
    if dim <= 0:
        raise ValueError(f"dimension must be positive, got {dim}")
    cap = 1 << block_log2
    starts, lengths, padded = [], [], []
    for s in range(0, dim - dim % cap, cap):
        starts.append(s)
        lengths.append(cap)
        padded.append(cap)
    s, rest = dim - dim % cap, dim % cap
    if 0 < rest <= 1 << tail_log2:
        starts.append(s)
        lengths.append(rest)
        padded.append(next_pow2(rest))
    elif rest:
        grain = 1 << tail_log2
        covered = -(-rest // grain) * grain          # ≤ cap: tail_log2 < block_log2 here
        for k in range(block_log2, tail_log2 - 1, -1):
            if covered >> k & 1:
                starts.append(s)
                lengths.append(min(1 << k, dim - s))
                padded.append(1 << k)
                s += 1 << k
    return Layout(dim, tuple(starts), tuple(lengths), tuple(padded))


@lru_cache(maxsize=256)
def _layout(dim: int, block_log2: int, tail_log2: int, segments: tuple | None) -> Layout:
    return make_layout(dim, block_log2, tail_log2, segments)


# ----------------------------------------------------------------------------- helpers

class Pieces:
    """A flat float32 vector given as consecutive pieces (a model's gradients, tensor by
    tensor), so that a job rotation's transform reads each piece where it lies instead of a
    copy of all of them in one vector first (`rotate`; docs/design.md, "One rotation per
    job").  `concatenate` makes the one vector for every other path."""

    def __init__(self, arrays):
        self.arrays = tuple(np.asarray(a).reshape(-1) for a in arrays)
        for a in self.arrays:
            if a.dtype != np.float32 or not a.flags.c_contiguous:
                raise ValueError(f"every piece must be a contiguous float32 array, got {a.dtype}")
        self.size = sum(a.size for a in self.arrays)
        self._ends = np.cumsum([a.size for a in self.arrays])

    @property
    def sizes(self) -> tuple[int, ...]:
        """Each piece's size, in order: the segments of the round's layout (`make_layout`)."""
        return tuple(a.size for a in self.arrays)

    def span(self, start: int, stop: int) -> tuple:
        """The pieces' parts holding coordinates [start, stop), in order."""
        parts, lo = [], 0
        for a, hi in zip(self.arrays, self._ends.tolist()):
            if hi > start and lo < stop:
                parts.append(a[max(start - lo, 0):min(stop, hi) - lo])
            lo = hi
        return tuple(parts)

    def concatenate(self, out: np.ndarray | None = None) -> np.ndarray:
        """The vector itself, into `out` if given (float32, `size` values)."""
        out = np.empty(self.size, dtype=np.float32) if out is None else out
        if self.arrays:
            np.concatenate(self.arrays, out=out)
        return out


def _is_torch(x) -> bool:
    return not isinstance(x, np.ndarray)


def _asarray(values: np.ndarray, like):
    if isinstance(like, np.ndarray):
        return values
    import torch
    return torch.from_numpy(np.ascontiguousarray(values))


def _zeros(n: int, like):
    if isinstance(like, np.ndarray):
        return np.zeros(n, dtype=np.float32)
    import torch
    return torch.zeros(n, dtype=torch.float32)


def _block_padded(x, layout: Layout, j: int):
    s, n, p = layout.starts[j], layout.lengths[j], layout.padded[j]
    if n == p:
        return x[s:s + n]
    out = _zeros(p, x)
    out[:n] = x[s:s + n]
    return out


def stochastic_round(y, table: np.ndarray, interval_of: np.ndarray, uniforms):
    """Unbiased rounding of grid values y ∈ [0, g] to table indices (T⁻¹ of Alg. 2).

    y lies in [T[j], T[j+1]] (j = interval_of[⌊y⌋]); it becomes j+1 when
    u < (y − T[j])·w_j and j otherwise, w_j = float32(1 / (T[j+1] − T[j])), all in float32
    (exactly the C kernels' operations), so E[T[Z]] = y.
    """
    tab = table.astype(np.float32)
    inv = np.float32(1.0) / (tab[1:] - tab[:-1])
    if _is_torch(y):
        import torch
        tab_t, inv_t = torch.from_numpy(tab), torch.from_numpy(inv)
        iv = torch.from_numpy(interval_of)
        j = iv[torch.floor(y).long()]
        up = (uniforms < (y - tab_t[j]) * inv_t[j]).long()
        return (j + up).to(torch.uint8)
    j = interval_of[y.astype(np.int64)]
    return (j + (uniforms < (y - tab[j]) * inv[j])).astype(np.uint8)


def _clip(x, lo, hi):
    if _is_torch(x):
        import torch
        return torch.clamp(x, lo, hi)
    return np.clip(x, lo, hi)


def _grid(r, big_m: float, g: int):
    """Alg. 3 lines 11-15 on rotated coordinates: clamp to [−M, M], then y = (a + M)·g/2M
    in [0, g], in float32 as docs/protocol.md §4 step 4 says; y = g/2 when M = 0."""
    if big_m > 0:
        y = (_clip(r, -big_m, big_m) + big_m) * (g / (2.0 * big_m))
        return _clip(y, 0.0, float(g))
    return r * 0 + g / 2.0


# ----------------------------------------------------------------------------- THC

#: The float64 partial sums of a block's sum of squares (docs/protocol.md §4 step 2).
NORM_LANES = 16


def sum_of_squares(seg: np.ndarray) -> float:
    """Σ x_i² of float32 values, defined to the bit: NORM_LANES float64 partial sums, lane k
    adding x_i² (exact in float64) for i ≡ k (mod NORM_LANES) in increasing i, then lanes 0,
    1, … added left to right.  The C kernel (`_kernels.sumsq`) and this numpy code give the
    same float64; a float32 BLAS dot would not (its summation order is the library's)."""
    seg = np.ascontiguousarray(seg, dtype=np.float32)
    if _kernels is not None:
        return _kernels.sumsq(seg)
    rows = -(-seg.size // NORM_LANES)
    sq = np.zeros(rows * NORM_LANES, dtype=np.float64)
    sq[:seg.size] = seg
    sq *= sq
    # accumulate: sequential down each lane by definition (add.reduce may sum pairwise)
    lanes = np.add.accumulate(sq.reshape(rows, NORM_LANES), axis=0)[-1] if rows else np.zeros(NORM_LANES)
    total = 0.0
    for v in lanes.tolist():
        total += v
    return total


def _norm(seg: np.ndarray) -> np.float32:
    """The float64 square root of a segment's :func:`sum_of_squares`, rounded to float32 (the
    value the NORM packet carries)."""
    return np.float32(math.sqrt(sum_of_squares(seg)))


def _norms(x: np.ndarray, segments) -> np.ndarray:
    """`_norm` of each (start, length) segment of x, as float64."""
    return np.array([_norm(x[s:s + n]) for s, n in segments], dtype=np.float32).astype(np.float64)


def block_norms(x, layout: Layout) -> np.ndarray:
    """‖x_j‖ per RHT block (the preliminary-stage message) over its unpadded coordinates."""
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    return _norms(x, list(zip(layout.starts, layout.lengths)))


def _scale(max_norm: float, padded: int, tp: float) -> float:
    """M = t_p·ℓ/√d (Alg. 3 line 11); 0 for an all-zero round."""
    return tp * max_norm / math.sqrt(padded) if max_norm > 0 else 0.0


_tls = threading.local()


def _workspace(n: int, name: str = "work") -> np.ndarray:
    """A per-thread float32 scratch block of n floats, reused across calls (no page faults);
    `name` keeps scratch blocks in use at the same time apart."""
    w = getattr(_tls, name, None)
    if w is None or w.size < n:
        w = np.empty(n, dtype=np.float32)
        setattr(_tls, name, w)
    return w[:n]


_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def codec_threads() -> int:
    """Threads one encode or decode may use, one RHT block each: $THC_CODEC_THREADS, else this
    thread and one per core that sat idle lately or that this process's own threads kept busy
    beyond one (`thc_ps.compression.cores.idle_cores`): a worker with cores to spare uses
    them, one on a host whose cores are busy (ranks sharing them, other work) adds no
    hand-offs to it (docs/bench.md, "Codec threads where cores are idle").  Blocks are
    independent (own signs, own scale, own slice of the uniforms), so the result is the same
    bit for bit whatever the count."""
    env = os.environ.get("THC_CODEC_THREADS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"THC_CODEC_THREADS must be a positive integer, got {env!r}")
        return int(env)
    cores = os.cpu_count() or 1
    return min(cores, 1 + idle_cores(cores))


def _forget_pool() -> None:
    global _pool, _pool_size
    _pool, _pool_size = None, 0         # a forked child has none of the parent's threads


os.register_at_fork(after_in_child=_forget_pool)


def _each_of(fn, blocks: range) -> None:
    """fn(j) for the RHT blocks j in `blocks` (a range), as `_each_block` shares them."""
    _each_block(lambda i: fn(blocks[i]), len(blocks))


def _each_block(fn, blocks: int) -> None:
    """fn(j) for every RHT block j, shared among this thread and the pool's threads when there
    are several blocks and several codec threads (the C kernels release the GIL).  Each thread
    takes the next block not yet taken, so the blocks spread evenly whatever their count (a
    2^24 round has 16 blocks of 2^20) and a pool thread busy with another caller's blocks
    (the error-feedback decode in its helper thread) delays nothing.  On a host with more
    cores than workers a 2^24 compress takes 26 ms on two threads against 42 on one
    (docs/bench.md, "Codec threads share the RHT blocks"); with more workers than cores it lets the last worker of a round use
    every core."""
    threads = min(blocks, codec_threads()) if blocks > 1 else 1     # one block: nothing to share
    if threads <= 1:
        for j in range(blocks):
            fn(j)
        return
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < threads - 1:
            if _pool is not None:
                _pool.shutdown(wait=False)      # more threads asked for: its idle threads exit
            _pool, _pool_size = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="thc-block"), threads - 1
        pool = _pool
    taken, lock = [0], threading.Lock()

    def drain():
        while True:
            with lock:
                j = taken[0]
                taken[0] += 1
            if j >= blocks:
                return
            fn(j)
    rest = [pool.submit(drain) for _ in range(threads - 1)]
    try:
        drain()
    finally:
        # every block is taken: a helper that has not started (its pool thread busy with
        # another caller's blocks) is cancelled, not waited for; one that runs finishes its block
        started = [f for f in rest if not f.cancel()]
        wait(started)
    for f in started:
        f.result()


def result_vector(out, dim: int) -> np.ndarray:
    """The float32 result vector of a decode, flat: `out` if given (checked), else a new one."""
    if out is None:
        return np.empty(dim, dtype=np.float32)
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.size != dim \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writable contiguous float32 numpy array of {dim} elements")
    return out if out.ndim == 1 else out.reshape(-1)


def _kernel_ok(x, cfg: ThcConfig) -> bool:
    return _kernels is not None and not _is_torch(x) and cfg.granularity <= 255


def _packs_per_block(cfg: ThcConfig, layout: Layout) -> bool:
    """Packed indices whose bytes never straddle two RHT blocks (every block's b·P_j bits whole
    bytes: even blocks at 4 bits, multiples of 8 at 5): the C kernels pack block by block."""
    return all(p * cfg.bits % 8 == 0 for p in layout.padded)


def _bytes_of(cfg: ThcConfig, a: int, b: int) -> slice:
    """The bytes of packed coordinates [a, b) (both on a byte: `_packs_per_block`)."""
    return slice(a * cfg.bits // 8, b * cfg.bits // 8)


def _encode_kernels(x: np.ndarray, max_norms, cfg: ThcConfig, layout: Layout, round_no: int,
                    uniforms: np.ndarray, packed: bool = False, blocks: range | None = None,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Alg. 3 lines 9-16 per RHT block in one C call (§5.1 signs + FWHT, clamp, stochastic
    rounding, optional b-bit packing); equal to the reference below.  `blocks`: only those
    RHT blocks, into their part of `out` (a block's signs and uniforms depend on its index and
    offset only, so encoding the blocks piece by piece gives the same bytes)."""
    table = cfg.table
    tab8 = bytes(table.values)
    if out is None:
        out = np.empty(packed_size(layout.padded_dim, cfg.bits) if packed else layout.padded_dim, dtype=np.uint8)
    stream = isinstance(uniforms, CounterUniforms)
    u = None if stream else np.ascontiguousarray(uniforms, dtype=np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    offsets = layout.padded_offsets()

    def block(j):
        off, p, s, n = offsets[j], layout.padded[j], layout.starts[j], layout.lengths[j]
        big_m = _scale(float(max_norms[j]), p, table.t_p)
        o = out[_bytes_of(cfg, off, off + p)] if packed else out[off:off + p]
        _kernels.rht_encode(x[s:s + n], p, rademacher_bits(cfg.seed, cfg.sign_round(round_no), j, p), big_m,
                            cfg.granularity, tab8, (uniforms.key, off) if stream else u[off:off + p], o,
                            cfg.bits if packed else 0, _workspace(p))
    _each_of(block, range(len(offsets)) if blocks is None else blocks)
    return out


def encode(x, max_norms, cfg: ThcConfig, layout: Layout, round_no: int, uniforms, use_kernels=True):
    """Table indices Z (uint8, one per padded coordinate) of x for this round.

    `uniforms` holds layout.padded_dim draws from U[0, 1) (the worker's own RNG), or is
    the counter stream they come from (:class:`thc_ps.compression.stochastic.CounterUniforms`).
    """
    if use_kernels and _kernel_ok(x, cfg):
        return _encode_kernels(x, max_norms, cfg, layout, round_no, uniforms)
    if isinstance(uniforms, CounterUniforms):
        uniforms = _asarray(uniforms.take(0, layout.padded_dim), x)
    table = cfg.table
    tab = table.as_array()
    iv = lower_interval_index(tab)
    g, tp = cfg.granularity, table.t_p
    parts = []
    for j, off in enumerate(layout.padded_offsets()):
        p = layout.padded[j]
        signs = rademacher_signs(cfg.seed, cfg.sign_round(round_no), j, p)
        r = fwht(_block_padded(x, layout, j) * _asarray(signs, x))
        big_m = _scale(float(max_norms[j]), p, tp)
        parts.append(stochastic_round(_grid(r, big_m, g), tab, iv, uniforms[off:off + p]))
    if _is_torch(x):
        import torch
        return torch.cat(parts)
    return np.concatenate(parts)


def encode_packed(x, max_norms, cfg: ThcConfig, layout: Layout, round_no: int, uniforms) -> np.ndarray:
    """The wire form of :func:`encode`: b-bit indices packed MSB first (thc_ps.proto.packing), uint8.

    On numpy input the C kernels pack block by block as they quantize (`_packs_per_block`).
    """
    if _kernel_ok(x, cfg) and _packs_per_block(cfg, layout):
        return _encode_kernels(x, max_norms, cfg, layout, round_no, uniforms, packed=True)
    z = encode(x, max_norms, cfg, layout, round_no, uniforms)
    return pack_indices(z.numpy() if _is_torch(z) else z, cfg.bits)


def lookup_sum(indices, table) -> np.ndarray:
    """PS arithmetic (Alg. 2 line 13): Y = Σ_i T[Z_i] over the given workers, int64."""
    tab = np.asarray(table, dtype=np.int64)
    total = None
    for z in indices:
        v = tab[np.asarray(z, dtype=np.intp)]
        total = v if total is None else total + v
    if total is None:
        raise ValueError("lookup_sum needs at least one worker's indices")
    return total


def _decode_kernels(src, kind: int, contributors: int, max_norms, cfg: ThcConfig, layout: Layout,
                    round_no: int, lut: np.ndarray | None = None, out=None,
                    blocks: range | None = None) -> np.ndarray:
    """Alg. 3 lines 19-21 per RHT block in one C call: a = v·2M/(g·k) − M from the source
    (kind 0: float32 values, 1: packed b-bit indices, 2: byte indices, v = T[z]; 3: bytes,
    v = lut[byte]), then the inverse RHT of §5.1 (FWHT, then the signs D); into `out` if
    given.  `blocks`: only those RHT blocks (the rest of `out` is left as it is).  Packed
    indices of b != 4 bits are widened to bytes block by block first (C, proto/lanes.h)."""
    g, table = cfg.granularity, cfg.table
    tab8 = lut.tobytes() if lut is not None else bytes(table.values) if kind else b""
    out = result_vector(out, layout.dim)
    offsets = layout.padded_offsets()

    def block(j):
        off, p, s, n = offsets[j], layout.padded[j], layout.starts[j], layout.lengths[j]
        big_m = _scale(float(max_norms[j]), p, table.t_p)
        seg, kd = src[off:off + p], kind
        if kind == 1:
            seg = src[_bytes_of(cfg, off, off + p)]
            if cfg.bits != 4:
                seg, kd = _widen(seg, cfg.bits, p), 2
        _kernels.rht_decode(seg, kd, 2.0 * big_m / (g * contributors), big_m, p,
                            rademacher_bits(cfg.seed, cfg.sign_round(round_no), j, p), tab8, out[s:s + n],
                            None if n == p else _workspace(p))
    _each_of(block, range(len(offsets)) if blocks is None else blocks)
    return out


def _widen(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """`count` packed b-bit indices (b in 1..8) as one byte each, by the C lane widening."""
    if bits == 8:
        return packed[:count]
    out = np.empty(count, dtype=np.uint8)
    _kernels.widen_lanes(packed, np.array([0, packed.size], dtype=np.int64), np.array([0, count], dtype=np.int64),
                         0, 1, bits, out)
    return out


def decode(sums, contributors: int, max_norms, cfg: ThcConfig, layout: Layout, round_no: int):
    """x̂ = RHT⁻¹(m + (Y/k)·(M − m)/g) (Alg. 3 lines 19–21), length layout.dim, float32."""
    if contributors <= 0:
        raise ValueError(f"contributors must be positive, got {contributors}")
    if _kernels is not None and not _is_torch(sums):
        return _decode_kernels(np.ascontiguousarray(sums, dtype=np.float32), 0, contributors,
                               max_norms, cfg, layout, round_no)
    g, tp = cfg.granularity, cfg.table.t_p
    out = _zeros(layout.dim, sums)
    for j, off in enumerate(layout.padded_offsets()):
        p, s, n = layout.padded[j], layout.starts[j], layout.lengths[j]
        big_m = _scale(float(max_norms[j]), p, tp)
        yj = sums[off:off + p]
        yj = yj.float() if _is_torch(yj) else yj.astype(np.float32)
        a = yj * (2.0 * big_m / (g * contributors)) - big_m
        signs = rademacher_signs(cfg.seed, cfg.sign_round(round_no), j, p)
        out[s:s + n] = (fwht(a) * _asarray(signs, a))[:n]
    return out


def decode_own(z, max_norms, cfg: ThcConfig, layout: Layout, round_no: int, packed: bool = False,
               out=None):
    """RHT⁻¹(X) of this worker's own indices (the error-feedback term of Alg. 3 line 22).

    Equal to ``decode(lookup_sum([z], T), 1, ...)``; on numpy input the table lookup is
    fused into the inverse transform.  `packed`: z is the wire form of :func:`encode_packed`.
    `out`: a float32 vector the C path may write into (the other paths ignore it).
    """
    if _kernel_ok(z, cfg) and (not packed or _packs_per_block(cfg, layout)):
        return _decode_kernels(np.ascontiguousarray(z, dtype=np.uint8), 1 if packed else 2, 1,
                               max_norms, cfg, layout, round_no, out=out)
    if packed:
        z = unpack_indices(np.asarray(z, dtype=np.uint8), cfg.bits, layout.padded_dim)
    own = lookup_sum([z.numpy() if _is_torch(z) else z], cfg.table.values)
    return decode(_asarray(own, z), 1, max_norms, cfg, layout, round_no)


def decode_lanes(lanes, contributors: int, max_norms, cfg: ThcConfig, layout: Layout, round_no: int,
                 out=None, blocks: range | None = None):
    """x̂ from the PS's 8-bit sum lanes Y (uint8, one per padded coordinate) and k contributors.

    Equal to ``decode((Y / k).astype(float32), 1, ...)`` (Alg. 3 lines 19–21), with the
    division done by a 256-entry table inside the fused decode; into `out` (a float32 numpy
    vector of layout.dim) if given.  `blocks` (C kernels only): just those RHT blocks, the
    blocks whose lanes all came back with this k.
    """
    lut = (np.arange(256, dtype=np.int64) / contributors).astype(np.float32)
    lanes = np.ascontiguousarray(lanes, dtype=np.uint8)
    if _kernels is None:
        if blocks is not None:
            raise ValueError("decoding some blocks only needs the C kernels (compression/_kernels.c)")
        est = decode(lut[lanes], 1, max_norms, cfg, layout, round_no)
        if out is None:
            return est
        np.copyto(result_vector(out, layout.dim), est)
        return out
    return _decode_kernels(lanes, 3, 1, max_norms, cfg, layout, round_no, lut=lut, out=out, blocks=blocks)


# ----------------------------------------------------------------------------- one rotation per job

def rotate(x, cfg: ThcConfig, layout: Layout, carry=None, out=None, norms=None) -> np.ndarray:
    """R = H·D·x per RHT block (§5.1) with the job's one diagonal D (cfg.rotation "job"), plus
    `carry` if given: the rotated residual of the last round, so that R(∇ + e) = R∇ + R·e is
    formed without leaving the rotated domain.  float32, one value per padded coordinate
    (blocks in order), into `out` if given.  x may be :class:`Pieces` (read where they lie).
    `norms` (a float64 array, one per block): ‖R_j‖ as `rotated_norms` computes it, each
    taken right after its block's transform, while the block is still in cache."""
    if cfg.rotation != "job":
        raise ValueError("rotate() holds for a job with one rotation; a rotation per round encodes with encode()")
    n = layout.padded_dim
    if out is None:
        out = np.empty(n, dtype=np.float32)
    if isinstance(x, Pieces):
        if _kernels is None:
            x = x.concatenate()
    else:
        if _is_torch(x):
            x = x.detach().cpu().numpy()
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if carry is not None and (carry.shape != (n,) or carry.dtype != np.float32):
        raise ValueError(f"carry must be {n} float32 values, got {carry.dtype} {carry.shape}")
    offsets = layout.padded_offsets()

    def block(j):
        off, p, s, m = offsets[j], layout.padded[j], layout.starts[j], layout.lengths[j]
        bits = rademacher_bits(cfg.seed, cfg.sign_round(0), j, p)
        c = None if carry is None else carry[off:off + p]
        if _kernels is not None:
            _kernels.rht_rotate(x.span(s, s + m) if isinstance(x, Pieces) else x[s:s + m], p, bits, c,
                                out[off:off + p])
        else:
            r = fwht(_block_padded(x, layout, j) * rademacher_signs(cfg.seed, cfg.sign_round(0), j, p))
            out[off:off + p] = r if c is None else r + c
        if norms is not None:
            norms[j] = _norm(out[off:off + p])
    _each_block(block, len(offsets))
    return out


def unrotate(xr: np.ndarray, cfg: ThcConfig, layout: Layout) -> np.ndarray:
    """x = D·H·R per RHT block, the inverse of `rotate` without a carry (the normalized RHT is
    orthogonal, §5.1), cut to layout.dim: what a rotated residual is in the gradient's own
    coordinates (its share in a block's padding is dropped).  float32."""
    if cfg.rotation != "job":
        raise ValueError("unrotate() inverts a job's one rotation")
    xr = np.ascontiguousarray(xr, dtype=np.float32).reshape(-1)
    if xr.size != layout.padded_dim:
        raise ValueError(f"a rotated vector of this layout has {layout.padded_dim} values, got {xr.size}")
    out = np.empty(layout.dim, dtype=np.float32)
    for j, off in enumerate(layout.padded_offsets()):
        p, s, n = layout.padded[j], layout.starts[j], layout.lengths[j]
        out[s:s + n] = (fwht(xr[off:off + p]) * rademacher_signs(cfg.seed, cfg.sign_round(0), j, p))[:n]
    return out


def rotated_norms(xr: np.ndarray, layout: Layout) -> np.ndarray:
    """‖R_j‖ per RHT block of a rotated vector, over its P_j coordinates: ‖x_j‖ itself (the
    normalized RHT is orthogonal), computed as `block_norms` computes it."""
    return _norms(xr, list(zip(layout.padded_offsets(), layout.padded)))


def quantize_rotated(xr: np.ndarray, max_norms, cfg: ThcConfig, layout: Layout, uniforms, *,
                     packed: bool = False, out: np.ndarray | None = None, resid: np.ndarray | None = None,
                     blocks: range | None = None) -> np.ndarray:
    """Alg. 3 lines 11-16 on a vector already rotated (`rotate`): the table indices Z, bytes
    or packed as `encode_packed` packs them (equal to `encode` of the unrotated x, byte for
    byte), and, into `resid` if given, the own error in the rotated domain, R − X with
    X = T[Z]·2M/g − M (line 22 without its RHT⁻¹; float32, the k = 1 decode's operations).
    `blocks`: only those RHT blocks, into their parts of `out` and `resid`."""
    table, g = cfg.table, cfg.granularity
    n = layout.padded_dim
    fused = _kernel_ok(xr, cfg) and (not packed or _packs_per_block(cfg, layout))
    if out is None:
        out = np.empty(packed_size(n, cfg.bits) if packed else n, dtype=np.uint8)
    z = out if fused or not packed else np.empty(n, dtype=np.uint8)     # the reference packs at the end
    stream = isinstance(uniforms, CounterUniforms)
    offsets = layout.padded_offsets()
    tab8 = bytes(table.values)
    if not fused:
        tab32 = table.as_array().astype(np.float32)
        iv = lower_interval_index(table.as_array())

    def block(j):
        off, p = offsets[j], layout.padded[j]
        big_m = _scale(float(max_norms[j]), p, table.t_p)
        if fused:
            _quantize_ef(xr, off, off + p, big_m, g, tab8, uniforms, z, cfg.bits if packed else 0, resid)
            return
        r = resid[off:off + p] if resid is not None else None
        u = uniforms.take(off, p) if stream else uniforms[off:off + p]
        zj = z[off:off + p] = stochastic_round(_grid(xr[off:off + p], big_m, g), tab32, iv, u)
        if r is not None:
            own = tab32[zj] * np.float32(2.0 * big_m / g) - np.float32(big_m)
            np.subtract(xr[off:off + p], own, out=r)
    _each_of(block, range(len(offsets)) if blocks is None else blocks)
    if z is not out:
        if blocks is not None:
            raise ValueError("packing some blocks only needs the C kernels and blocks of whole bytes")
        out[:] = pack_indices(z, cfg.bits)
    return out


def quantize_span(xr: np.ndarray, max_norms, cfg: ThcConfig, layout: Layout, uniforms: CounterUniforms,
                  j: int, lo: int, hi: int, out: np.ndarray, resid: np.ndarray | None = None) -> None:
    """`quantize_rotated(..., packed=True, blocks=range(j, j + 1))` for coordinates [lo, hi)
    of RHT block j only (even offsets inside the block): the same bytes and residuals, since
    the clamp and scale are the block's and a coordinate's uniform is the counter stream's
    value at its own index (§5.1; compression/stochastic.py).  A pipelined round sends the
    first chunks of a big block while the rest of it is quantized (worker/client.py)."""
    p = layout.padded[j]
    if not (0 <= lo < hi <= p and lo * cfg.bits % 8 == 0 and hi * cfg.bits % 8 == 0):
        raise ValueError(f"a span of block {j} ({p} coordinates) must be offsets 0 <= lo < hi <= {p} on whole "
                         f"bytes of {cfg.bits}-bit indices, got [{lo}, {hi})")
    if not (_kernel_ok(xr, cfg) and _packs_per_block(cfg, layout) and isinstance(uniforms, CounterUniforms)):
        raise ValueError("quantizing part of a block needs the C kernels, blocks of whole bytes and the counter stream")
    table = cfg.table
    off = layout.padded_offsets()[j]
    _quantize_ef(xr, off + lo, off + hi, _scale(float(max_norms[j]), p, table.t_p), cfg.granularity,
                 bytes(table.values), uniforms, out, cfg.bits, resid)


def _quantize_ef(xr, a: int, b: int, big_m: float, g: int, tab8: bytes, uniforms, z, bits: int, resid) -> None:
    """The C quantizer over padded coordinates [a, b) of one RHT block (scale `big_m`): Z into
    z (bits 0: a byte each from a; else packed b-bit from byte a·b/8), R − X into resid; the
    uniforms from the counter stream at a, or the caller's."""
    o = z[a * bits // 8:b * bits // 8] if bits else z[a:b]
    u = (uniforms.key, a) if isinstance(uniforms, CounterUniforms) else \
        np.ascontiguousarray(uniforms[a:b], dtype=np.float32)
    _kernels.quantize_ef(xr[a:b], big_m, g, tab8, u, o, bits, resid[a:b] if resid is not None else None)


def prepare(cfg: ThcConfig, dim: int, memory=None, key=None, segments=None) -> None:
    """Make now what the first round of a `dim`-coordinate tensor would otherwise make inside
    itself: the job's table, the sign diagonals of a job rotation (the rotation's D, drawn once
    and kept), and two vectors for `memory`'s spare buffers under `key`, written once so that
    their pages are mapped: all a job rotation's rounds use (x and the residual, handed back
    and forth: `WorkerRound`); a rotation per round keeps a third, which its second round
    makes.  Nothing on the wire or in the values changes; the first round of a training run
    no longer faults in tens of MB nor draws the diagonals on the critical path (docs/bench.md,
    "A first step like the others")."""
    layout = cfg.layout(dim, segments)
    _ = cfg.table
    if cfg.rotation == "job":
        for j, p in enumerate(layout.padded):
            rademacher_bits(cfg.seed, cfg.sign_round(0), j, p)
    if memory is not None:
        n = layout.padded_dim if cfg.rotation == "job" else dim
        spare = [np.empty(n, dtype=np.float32) for _ in range(2)]
        for b in spare:
            b.fill(0.0)             # np.zeros would map its pages only when first written
        memory.recycle(key, *spare)


class WorkerRound:
    """One worker's THC round (Alg. 3), the steps every caller shares; only the exchange of
    norms and of indices/sums (PS over UDP, torch all-reduce, in-process sum) differs:

        rnd = WorkerRound(cfg, grad, memory, key)   x = ∇ + e (error feedback, line 4)
        rnd.norms()                                 ‖x_j‖ per RHT block → max over workers
        rnd.encode(max_norms, rng, round_no)        Z (b-bit indices; packed=True: wire form)
        rnd.decode(sums, k) / rnd.decode_lanes(Y, k) x̂ from the aggregate (lines 19-21)
        rnd.feedback()                              e ← x − RHT⁻¹(X) into `memory` (line 22)

    `memory` is a :class:`thc_ps.compression.codec.ErrorFeedback` (None: no error feedback);
    `compensate=False` keeps x = ∇ but still records the new residual.  The uniforms of the
    stochastic rounding are the counter stream of one 64-bit key drawn from `rng` per encode
    (compression/stochastic.py), computed inside the C encode.

    With a memory and a float32 numpy gradient the round allocates no vector of d in its
    steady state: x and the residual take the memory's spare buffers (`ErrorFeedback.buffer`)
    and `feedback` gives back x and the old residual; the uniforms are never stored, and
    `decode_lanes(..., out=)` writes x̂ where the caller says.  Fresh 64 MB
    vectors at d = 2^24 cost the kernel's page zeroing every round (docs/bench-history.md,
    "Rounds without new vectors").

    With cfg.rotation "job" the same calls run in the rotated domain: x is R = H·D·∇ + e_R
    (padded_dim values, its block norms ‖R_j‖ taken right after each block's transform), `encode`
    makes Z and writes R − X over R in the same pass, and the memory keeps that vector as e_R:
    no inverse transform for the residual, and two vectors of d per key instead of three.  The
    gradient may then be :class:`Pieces`, read where they lie (no copy into one vector).
    """

    def __init__(self, cfg: ThcConfig, grad, memory=None, key=None, *, compensate: bool = True,
                 segments=None):
        self.cfg, self.memory, self.key = cfg, memory, key
        if segments is None and isinstance(grad, Pieces):
            segments = grad.sizes
        self.layout = cfg.layout(grad.size if isinstance(grad, (np.ndarray, Pieces)) else grad.numel(), segments)
        self.max_norms = self.z = self.round_no = None
        self.packed = False
        self._uniforms = self._residual = None
        self.rotated = cfg.rotation == "job"
        self._norms = None
        if self.rotated:
            # x is R = H·D·∇ + e_R from the start (the memory keeps e_R, padded_dim values)
            n = self.layout.padded_dim
            shape = np.broadcast_to(np.float32(0), (n,))
            self.pooled = self._own_x = memory is not None
            carry = memory.get(key, shape) if memory is not None and compensate else None
            self._norms = np.empty(len(self.layout.starts), dtype=np.float64)
            self.x = rotate(grad, cfg, self.layout, carry=carry,
                            out=memory.buffer(key, shape) if self.pooled else None, norms=self._norms)
            return
        if isinstance(grad, Pieces):
            grad = grad.concatenate()
        self.pooled = memory is not None and isinstance(grad, np.ndarray) and grad.dtype == np.float32 \
            and grad.ndim == 1 and grad.flags.c_contiguous
        self._own_x = self.pooled and compensate          # x is the memory's buffer, not grad
        if memory is not None and compensate:
            self.x = memory.compensate(key, grad, out=memory.buffer(key, grad) if self.pooled else None)
        else:
            self.x = grad

    def norms(self) -> np.ndarray:
        """‖x_j‖ per RHT block (the preliminary stage's message, float64)."""
        if self.rotated:
            return self._norms.copy()
        return block_norms(self.x, self.layout)

    def _residual_vector(self) -> np.ndarray | None:
        """Where a rotated round's quantize writes R − X: over R itself, which nothing reads
        afterwards (None without a memory)."""
        if self.memory is None:
            return None
        self._residual = self.x
        return self._residual

    def encode(self, max_norms, rng, round_no: int, *, packed: bool = False, uniforms=None):
        """Z for this round with the shared norms: uint8 indices, or packed MSB first.  The
        stochastic rounding uses the counter stream of one key drawn from `rng`, unless the
        caller passes `uniforms` (padded_dim float32 values)."""
        self.max_norms, self.round_no, self.packed = max_norms, round_no, packed
        n = self.layout.padded_dim
        if uniforms is None:
            uniforms = CounterUniforms(key_from(rng))
        elif uniforms.shape != (n,) or uniforms.dtype != np.float32:
            raise ValueError(f"uniforms must be {n} float32 values, got {uniforms.dtype} {uniforms.shape}")
        if self.rotated:
            self.z = quantize_rotated(self.x, max_norms, self.cfg, self.layout, uniforms, packed=packed,
                                      resid=self._residual_vector())
            return self.z
        fn = encode_packed if packed else encode
        self.z = fn(self.x, max_norms, self.cfg, self.layout, round_no, uniforms)
        return self.z

    # -- the same round a block at a time (a pipelined round: worker/client.py) --------------
    def can_pipeline(self) -> bool:
        """Whether encode, decode and residual can go block by block here: the C kernels,
        a float32 numpy x and indices packed within each block (`_packs_per_block`)."""
        return (_kernel_ok(self.x, self.cfg) and isinstance(self.x, np.ndarray) and self.x.dtype == np.float32
                and self.x.flags.c_contiguous and _packs_per_block(self.cfg, self.layout))

    def start_packed(self, max_norms, rng, round_no: int) -> np.ndarray:
        """The packed wire buffer of this round's Z, to be filled by `encode_blocks` (the
        uniforms' key is drawn from `rng` now, as `encode` draws it)."""
        self.max_norms, self.round_no, self.packed = max_norms, round_no, True
        self._uniforms = CounterUniforms(key_from(rng))
        self.z = np.empty(packed_size(self.layout.padded_dim, self.cfg.bits), dtype=np.uint8)
        return self.z

    def encode_blocks(self, blocks: range) -> None:
        """Z of these RHT blocks into the buffer of `start_packed`: once every block is
        done, the buffer is byte for byte what `encode(..., packed=True)` returns."""
        if self.rotated:        # the blocks' residuals come in the same pass
            quantize_rotated(self.x, self.max_norms, self.cfg, self.layout, self._uniforms, packed=True,
                             out=self.z, resid=self._residual_vector(), blocks=blocks)
            return
        _encode_kernels(self.x, self.max_norms, self.cfg, self.layout, self.round_no, self._uniforms,
                        packed=True, blocks=blocks, out=self.z)

    def encode_span(self, j: int, lo: int, hi: int) -> None:
        """Z of coordinates [lo, hi) of RHT block j into the buffer of `start_packed`, with
        their residuals (a rotated round only: `quantize_span`)."""
        if not self.rotated:
            raise ValueError("a round with a rotation per round encodes whole blocks (the transform is part of it)")
        quantize_span(self.x, self.max_norms, self.cfg, self.layout, self._uniforms, j, lo, hi, self.z,
                      self._residual_vector())

    def residual_blocks(self, blocks: range) -> np.ndarray:
        """`residual()` for these blocks (their Z made), into the round's residual vector,
        which is returned; once every block is done it equals `residual()` bit for bit."""
        if self.rotated:        # made by encode_blocks
            return self._residual
        if self._residual is None:
            self._residual = (self.memory.buffer(self.key, self.x) if self.pooled
                              else np.empty(self.layout.dim, dtype=np.float32))
        e = self._residual
        _decode_kernels(self.z, 1, 1, self.max_norms, self.cfg, self.layout, self.round_no, out=e, blocks=blocks)
        lo = self.layout.starts[blocks[0]]
        hi = self.layout.starts[blocks[-1]] + self.layout.lengths[blocks[-1]]
        np.subtract(self.x[lo:hi], e[lo:hi], out=e[lo:hi])
        return e

    def decode(self, sums, contributors: int = 1):
        """x̂ from Σ T[Z] over k contributors (or from Y/k with contributors=1)."""
        return decode(sums, contributors, self.max_norms, self.cfg, self.layout, self.round_no)

    def decode_lanes(self, lanes, contributors: int, out=None, blocks: range | None = None):
        """x̂ from the PS's 8-bit lanes Y and k, Y/k inside the fused decode (into `out`;
        `blocks`: only those RHT blocks)."""
        return decode_lanes(lanes, contributors, self.max_norms, self.cfg, self.layout, self.round_no,
                            out=out, blocks=blocks)

    def residual(self):
        """e' = x − RHT⁻¹(X): this worker's own decode with k = 1, so the clamping error is
        carried too (Alg. 3 line 22).  A rotated round made R − X while it quantized."""
        if self.rotated:
            return self._residual
        spare = self.memory.buffer(self.key, self.x) if self.pooled else None
        own = decode_own(self.z, self.max_norms, self.cfg, self.layout, self.round_no, packed=self.packed,
                         out=spare)
        if isinstance(self.x, np.ndarray) and isinstance(own, np.ndarray) and self.x.dtype == own.dtype:
            return np.subtract(self.x, own, out=own)        # no new vector
        return self.x - own

    def feedback(self, residual=None) -> None:
        """Keep the residual (`residual` if the caller computed it already, e.g. in a thread
        during the exchange) in `memory` under `key` (nothing without a memory); a pooled
        round gives back x and the old residual for the next round to reuse."""
        if self.memory is None:
            return
        e = self.residual() if residual is None else residual
        old = self.memory.get(self.key)
        self.memory.update(self.key, e)
        if self.pooled:
            self.memory.recycle(self.key, old)
        if self._own_x:
            self.memory.recycle(self.key, self.x)
            self.x = None           # its buffer is the next round's


# ----------------------------------------------------------------------------- uniform THC

@dataclass(frozen=True)
class UhcConfig:
    """Uniform THC (Alg. 1): identity table, g = 2^b − 1."""

    bits: int = 4
    lane_bits: int = 8

    @property
    def table(self) -> Table:
        return identity_table(self.bits)

    @property
    def granularity(self) -> int:
        return (1 << self.bits) - 1

    def check_workers(self, workers: int) -> None:
        check_lane_capacity(workers, self.granularity, self.lane_bits)


def uhc_encode(x: np.ndarray, lo: float, hi: float, cfg: UhcConfig, uniforms: np.ndarray) -> np.ndarray:
    """Homomorphic USQ with the global [m, M] (Alg. 1 line 15)."""
    g = cfg.granularity
    tab = cfg.table.as_array()
    if hi > lo:
        y = np.clip((x.astype(np.float32) - lo) * (g / (hi - lo)), 0.0, float(g))
    else:
        y = np.zeros(x.shape, np.float32)
    return stochastic_round(y, tab, lower_interval_index(tab), uniforms)


def uhc_decode(sums: np.ndarray, contributors: int, lo: float, hi: float, cfg: UhcConfig) -> np.ndarray:
    """m + (X/k)·(M − m)/(2^b − 1) (Alg. 1 line 21)."""
    return (lo + sums.astype(np.float64) / contributors * ((hi - lo) / cfg.granularity)).astype(np.float32)
