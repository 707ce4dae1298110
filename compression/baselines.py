"""Reference baselines the THC paper compares against (§2.2, §8): TopK and TernGrad.

Pure functions of one aggregation round; random draws are passed in.
"""
from __future__ import annotations

import math

import numpy as np


def topk_count(dim: int, fraction: float) -> int:
    """k = ⌈fraction·d⌉, at least 1."""
    if not 0 < fraction <= 1:
        raise ValueError(f"TopK fraction must be in (0, 1], got {fraction}")
    return max(1, math.ceil(fraction * dim))


def topk_encode(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest-magnitude coordinates of x: (int64 indices sorted, float32 values)."""
    if k >= x.size:
        idx = np.arange(x.size, dtype=np.int64)
    else:
        idx = np.sort(np.argpartition(np.abs(x), x.size - k)[x.size - k:]).astype(np.int64)
    return idx, x[idx].astype(np.float32)


def topk_decode(idx: np.ndarray, values: np.ndarray, dim: int) -> np.ndarray:
    out = np.zeros(dim, dtype=np.float32)
    out[idx] = values
    return out


def topk_ps_aggregate(messages, dim: int, k: int, contributors: int) -> tuple[np.ndarray, np.ndarray]:
    """Bidirectional TopK at the PS: decode every worker, average, re-sparsify to k."""
    total = np.zeros(dim, dtype=np.float64)
    for idx, vals in messages:
        np.add.at(total, idx, vals)
    return topk_encode((total / contributors).astype(np.float32), k)


def topk_bits_per_coordinate(k: int, dim: int) -> float:
    """32-bit value plus 32-bit index per kept coordinate."""
    return 64.0 * k / dim


def terngrad_encode(x: np.ndarray, shared_max: float, uniforms: np.ndarray) -> np.ndarray:
    """Stochastic ternary {−1, 0, 1}: sign(x)·Bernoulli(|x|/s) with the workers' shared max s."""
    if shared_max <= 0:
        return np.zeros(x.shape, dtype=np.int8)
    keep = uniforms < np.abs(x) / shared_max
    return (np.sign(x) * keep).astype(np.int8)


def terngrad_decode(sums: np.ndarray, contributors: int, shared_max: float) -> np.ndarray:
    """The PS sums ternaries in integers (homomorphic with a shared max); x̂ = s·Y/k."""
    return (sums.astype(np.float64) * (shared_max / contributors)).astype(np.float32)


def terngrad_down_bits(workers: int) -> int:
    """Bits of a sum of n ternaries (2n + 1 values)."""
    return max(1, math.ceil(math.log2(2 * workers + 1)))
