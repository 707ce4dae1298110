"""The next round's stochastic-rounding uniforms, drawn ahead in the worker's helper thread.

A THC encode needs one uniform per padded coordinate (Alg. 3's stochastic rounding); at
d = 2^21 drawing them is ~40% of the encode.  They do not depend on the gradient, so the
worker draws round r+1's while round r's DATA phase waits on the network (and the caller
computes its next gradient), and round r+1's encode does not wait for them when the round
is bound by the link.

`ahead=False` (the worker's default from $THC_UNIFORMS_AHEAD, "0" for off) draws each
round's values when the round asks, into the same reused buffer: the comparison case.

Exact: a round gets the values it would have drawn itself.
- Keyed generators (`Worker(per_round_rng=True)`): one generator per round, so values drawn
  ahead for round r are used only by round r with the same count; otherwise they are dropped
  and the round draws its own.
- One stream (the default): what was drawn ahead is the stream's next values, so a round
  takes them first, in order, and draws only the rest.  Values a smaller round leaves over
  are kept for the next round, and nothing is drawn ahead until they are used up.
  Generator.random(float32) takes one 32-bit output per value, and PCG64 keeps the unused
  half of a 64-bit output between calls, so drawing in pieces gives the same values as
  drawing at once (tests/test_uniforms.py checks both).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np


class UniformsAhead:
    """Round uniforms, drawn ahead where possible (see the module docstring).

    `rng_for(round_no)` is the generator a round draws from: a new one per round (keyed) or
    always the same one (one stream)."""

    def __init__(self, rng_for: Callable[[int], np.random.Generator], keyed: bool, ahead: bool | None = None):
        self.rng_for, self.keyed = rng_for, keyed
        self.ahead = os.environ.get("THC_UNIFORMS_AHEAD", "1") != "0" if ahead is None else ahead
        self._buf = np.empty(0, np.float32)      # reused, so no new vector of d per round
        self._ahead: tuple[int, int, Future] | None = None     # (round, count, drawing)
        self._left = np.empty(0, np.float32)    # one stream: drawn, not used yet (in order)

    def take(self, round_no: int, n: int) -> np.ndarray:
        """The n float32 uniforms of round `round_no`, valid until the next draw_ahead (the
        caller encodes with them first)."""
        got = self._wait()
        if self.keyed:
            if got is not None and got == (round_no, n):
                return self._buf[:n]
            return self._draw(self.rng_for(round_no), n)
        m = 0                                   # the stream's next values, at _buf[:m]
        if got is not None:
            m = got[1]
        elif self._left.size:
            m = self._left.size
            self._grow(m, keep=0)
            self._buf[:m] = self._left
        self._left = self._buf[n:m].copy() if m > n else np.empty(0, np.float32)
        if m < n:
            self._grow(n, keep=m)
            self.rng_for(round_no).random(n - m, dtype=np.float32, out=self._buf[m:n])
        return self._buf[:n]

    def draw_ahead(self, submit: Callable[[Callable], Future], round_no: int, n: int) -> None:
        """Start drawing round `round_no`'s n uniforms with `submit` (the helper thread)."""
        if not self.ahead or (not self.keyed and self._left.size):
            return                  # off, or the next round starts with the values left over
        self._grow(n, keep=0)
        rng = self.rng_for(round_no)
        self._ahead = (round_no, n, submit(lambda: self._draw(rng, n)))

    def _grow(self, n: int, keep: int) -> None:
        """_buf holds at least n values, its first `keep` kept."""
        if self._buf.size < n:
            buf = np.empty(n, np.float32)
            buf[:keep] = self._buf[:keep]
            self._buf = buf

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        self._grow(n, keep=0)
        return rng.random(n, dtype=np.float32, out=self._buf[:n])

    def _wait(self):
        """(round, count) of the values drawn ahead, now in _buf[:count] (None if none)."""
        if self._ahead is None:
            return None
        round_no, n, fut = self._ahead
        self._ahead = None
        fut.result()
        return round_no, n
