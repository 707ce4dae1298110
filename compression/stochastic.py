"""The uniforms of THC's stochastic rounding, from a counter generator keyed per encode.

An encode needs one U[0, 1) draw per padded coordinate (Alg. 3 line 14, App. B).  Drawn
with numpy (`Generator.random`, float32) they cost about as much as the fused transform
itself at d = 2^24 and take a 64 MiB buffer the encode then reads back
(docs/bench.md, "Counter uniforms: B* before and after").  Here uniform i of a stream is a pure function of (key, i), so the C
encode computes each one where it uses it and writes nothing.

The function is SplitMix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014) read as a counter-based generator: output number m ≥ 1 from seed
`key` is mix13(key + m·γ), γ = 0x9e3779b97f4a7c15, and it passes BigCrush used this way.
Uniform i takes 24 bits of output i//2 + 1: the high 24 bits for even i, the next 24 for
odd i.  Each value is k·2^-24 with k in [0, 2^24), exact in float32, the resolution of
numpy's float32 draws.

One key per encode comes from the caller's generator (`key_from`), so seeding, per-round
keying (`thc_ps.worker.client.round_rng`) and reproducibility stay where they were; two encodes'
streams overlap only if their keys are fewer than d·γ-steps apart, chance ~d/2^64.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (mix13) on uint64 values, elementwise."""
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _check_key(key) -> None:
    if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or not 0 <= key < 1 << 64:
        raise ValueError(f"key must be a 64-bit unsigned integer, got {key!r}")


def counter_uniforms(key: int, n: int, start: int = 0) -> np.ndarray:
    """Uniforms start..start+n-1 of stream `key` as float32 (the reference of the C path)."""
    _check_key(key)
    i = np.arange(start, start + n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = splitmix64(np.uint64(key) + ((i >> np.uint64(1)) + np.uint64(1)) * GAMMA)
    bits = np.where(i & np.uint64(1), (h >> np.uint64(8)) & np.uint64(0xFFFFFF), h >> np.uint64(40))
    return bits.astype(np.float32) * np.float32(2.0 ** -24)


def key_from(rng: np.random.Generator) -> int:
    """One encode's stream key: a single 64-bit draw from the caller's generator."""
    return int(rng.integers(0, 1 << 64, dtype=np.uint64))


@dataclass(frozen=True)
class CounterUniforms:
    """The uniforms of one encode, as their stream: `take(start, n)` materializes a slice
    (reference paths); the C encode takes (key, start) and computes them in place."""

    key: int

    def __post_init__(self):
        _check_key(self.key)        # the C encode takes it as an unsigned 64-bit integer

    def take(self, start: int, n: int) -> np.ndarray:
        return counter_uniforms(self.key, n, start)
