"""Randomized Hadamard transform (THC paper §5.1), numpy and torch.

RHT(x) = H·D·x with H the normalized Walsh–Hadamard matrix (orthogonal and
symmetric, so H⁻¹ = H) and D a diagonal of ±1 signs; RHT⁻¹(y) = D·H·y.

The fast transform uses the Kronecker structure H_n = H_{m1} ⊗ H_{m2} ⊗ …:
viewing a vector of n = 2^k coordinates as a (m1, m2, …) tensor, H_n applies a
small dense H_m along every axis.  Each factor is one batched matrix product
(BLAS), so the whole transform is a few passes over memory — O(n·Σm) flops
instead of log2(n) strided butterfly passes — and the same code runs on numpy
arrays and torch tensors.

Signs D are drawn from a seed every worker derives identically from
(job seed, round, block) so the PS never needs them and no worker sends them.
"""
from __future__ import annotations

import collections
import functools
import math
import os
import threading

import numpy as np

try:
    from thc_ps.compression import _kernels
except ImportError:  # pragma: no cover - source checkout without a build
    _kernels = None

_MAX_FACTOR_BITS = 6


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=16)
def hadamard_matrix(m: int) -> np.ndarray:
    """Normalized Sylvester Hadamard matrix of order m (a power of two), float32."""
    if not is_pow2(m):
        raise ValueError(f"Hadamard order must be a power of two, got {m}")
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < m:
        h = np.block([[h, h], [h, -h]])
    out = (h / math.sqrt(m)).astype(np.float32)
    out.flags.writeable = False
    return out


def _factor_bits(k: int) -> list[int]:
    parts = max(1, -(-k // _MAX_FACTOR_BITS))
    base, extra = divmod(k, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _matrix_like(m: int, like):
    h = hadamard_matrix(m)
    if isinstance(like, np.ndarray):
        return h
    import torch
    return torch.from_numpy(np.array(h)).to(like.dtype)


def fwht(x, exact: bool = True):
    """Normalized fast Walsh–Hadamard transform along the last axis (length a power of two).

    Accepts a numpy array or a torch tensor and returns a new one of the same kind
    (float32 for numpy input).  Leading axes are independent rows.  A 1-D numpy input
    goes through the C butterflies when built (`exact`): bit-identical in every process,
    whereas a multi-threaded BLAS may round differently from one process to another.
    """
    n = x.shape[-1]
    if not is_pow2(n):
        raise ValueError(f"FWHT length must be a power of two, got {n}")
    if isinstance(x, np.ndarray):
        if exact and x.ndim == 1 and _kernels is not None:
            out = np.array(x, dtype=np.float32, copy=True)
            _kernels.fwht(out)
            return out
        x = x.astype(np.float32, copy=False)
    lead = x.shape[:-1]
    rows = int(np.prod(lead)) if lead else 1
    if n == 1:
        return x.reshape(lead + (1,)) * 1
    bits = _factor_bits(n.bit_length() - 1)
    y = x.reshape(rows, n)
    inner = n
    for b in bits:           # axis with m = 2^b entries; q = product of the axes after it
        m = 1 << b
        inner //= m
        h = _matrix_like(m, y)
        if inner == 1:
            y = (y.reshape(-1, m) @ h).reshape(rows, n)
        else:
            y = (h @ y.reshape(-1, m, inner)).reshape(rows, n)
    return y.reshape(lead + (n,))


class _BitsCache:
    """The most recent sign diagonals, bounded by their bytes, for every thread of a process.

    A round's encode, error-feedback decode and decode each walk all of a tensor's RHT blocks
    in turn, so a cache counted in entries misses on every block once a round has more
    blocks than entries (an LRU of 8 did, at 16 blocks of 2^20 for d = 2^24, drawing each
    diagonal three times a round).  Bounded by bytes, it keeps whole rounds: 32 MiB is one
    round of 2^28 coordinates.  A round's diagonals are never drawn again once later rounds
    began, so only the newest `rounds` rounds are kept: a long job of small rounds holds a
    few rounds' bits, not 32 MiB of past ones (a job with one rotation uses round 0 only).
    """

    def __init__(self, limit_bytes: int, rounds: int = 4):
        self.limit, self.rounds = limit_bytes, rounds
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._bytes = 0
        self._newest: dict = {}             # job seed -> the newest round it drew
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key, value: bytes) -> None:
        """Keep `value` under key (job seed, round, block, n); drop the least recently used
        entries while over the byte limit or from rounds `rounds` behind their seed's newest."""
        seed, rnd = key[0], key[1]
        with self._lock:
            newest = self._newest[seed] = max(self._newest.get(seed, rnd), rnd)
            if key in self._items or rnd <= newest - self.rounds:
                return
            self._items[key] = value
            self._bytes += len(value)
            while len(self._items) > 1:
                (s, r, _, _), old = next(iter(self._items.items()))
                if self._bytes <= self.limit and r > self._newest[s] - self.rounds:
                    break
                self._items.popitem(last=False)
                self._bytes -= len(old)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def reset(self) -> None:
        """Empty, with a fresh lock (a forked child may have inherited the lock held)."""
        self._items, self._bytes, self._lock = collections.OrderedDict(), 0, threading.Lock()
        self._newest = {}


_signs_cache = _BitsCache(32 << 20)
os.register_at_fork(after_in_child=_signs_cache.reset)


def rademacher_bits(job_seed: int, round_no: int, block: int, n: int) -> bytes:
    """The diagonal D of (job seed, round, block) as packed bits, MSB first (set = −1).

    Identical in every process: all workers derive it, nobody sends it.  A round's encode,
    decode and error-feedback decode take the same blocks' bits, so they are drawn once and
    kept (`_BitsCache`; bytes are immutable).
    """
    key = (job_seed, round_no, block, n)
    bits = _signs_cache.get(key)
    if bits is None:
        rng = np.random.default_rng(np.random.SeedSequence([job_seed & 0xFFFFFFFF, round_no & 0xFFFFFFFF, block]))
        bits = rng.bytes((n + 7) // 8)
        _signs_cache.put(key, bits)
    return bits


def rademacher_signs(job_seed: int, round_no: int, block: int, n: int) -> np.ndarray:
    """±1 float32 diagonal for (job seed, round, block)."""
    bits = np.unpackbits(np.frombuffer(rademacher_bits(job_seed, round_no, block, n), dtype=np.uint8))[:n]
    return (1.0 - 2.0 * bits).astype(np.float32)


def rht(x, signs):
    """H·D·x along the last axis."""
    return fwht(x * _like(signs, x))


def irht(y, signs):
    """D·H·y along the last axis (inverse of :func:`rht`)."""
    return fwht(y) * _like(signs, y)


def _like(arr: np.ndarray, ref):
    if isinstance(ref, np.ndarray):
        return arr
    import torch
    return torch.from_numpy(arr).to(ref.dtype)
