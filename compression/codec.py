"""The codec interface every compressor implements (GRACE/DDP-hook shape, docs/prior-art.md §3).

A codec is pure apart from the RNG and the explicit state objects passed in:

  worker:  stats = codec.preliminary(x, state)            optional, combined by max at the PS
           payload = codec.encode(x, state, rng, ctx)     bytes, worker → PS
  PS:      down = codec.aggregate(payloads, ps_state, ctx) bytes, PS → workers; decodes to the MEAN
                                                           of the contributors' inputs
  worker:  x̂ = codec.decode(down, ctx)                    float32, length ctx.dim

Homomorphic codecs (THC, uniform THC, TernGrad with a shared max) aggregate by
lookup-and-sum on the compressed data; all others aggregate by decoding every
payload, averaging and re-encoding — the bidirectional baseline of THC §2.2.

Corrupt or truncated payloads raise :class:`CodecError` (a ValueError) and never
anything else, so the PS can count and drop them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


class CodecError(ValueError):
    """A payload that cannot be decoded (truncated, corrupt, wrong sizes)."""


def header_bytes(payload, head, codec: str) -> bytes:
    """`payload` as bytes, checked to be bytes-like and to hold at least the `head` struct;
    the shared first step of every codec's message parser."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CodecError(f"{codec}: payload must be bytes, got {type(payload).__name__}")
    payload = bytes(payload)
    if len(payload) < head.size:
        raise CodecError(f"{codec}: message of {len(payload)} bytes is shorter than its "
                         f"{head.size}-byte header")
    return payload


@dataclass(frozen=True)
class Context:
    """What both ends know about one tensor in one round.

    key:  stable name of the tensor or bucket (error-feedback state is keyed by it)
    dim:  number of coordinates
    round_no: the round number (shared seeds derive from it)
    shared: result of the preliminary stage (max over workers of `preliminary`), or None
    contributors: k, the number of workers whose payloads were aggregated
    """

    key: str
    dim: int
    round_no: int = 0
    shared: Any = None
    contributors: int = 1


class ErrorFeedback:
    """Error-feedback memory, one residual e per key (GRACE's ``Memory``, BytePS's
    error-feedback decorator): ``compensate`` gives x + e before compression, ``update``
    keeps the new residual (what the compressed message missed of x + e).

    A residual whose shape differs from the new input is not applied (the tensor under that
    key changed; it starts again from zero).  `store` is the mapping the residuals live in:
    the worker keeps one per tensor name; a codec's per-tensor state dict is its own store
    (key "e"), so ``state["e"]`` is the residual.
    """

    def __init__(self, store: dict | None = None):
        self.errors = {} if store is None else store
        self._spare: dict = {}          # key -> buffers a round may take again (see `buffer`)

    def get(self, key, like=None):
        """The residual kept under `key` if it has the shape of `like` (any shape when `like`
        is None: the caller checks it, as 3LC's accumulate does), else None."""
        e = self.errors.get(key)
        if e is None or (like is not None and np.shape(e) != np.shape(like)):
            return None
        return e

    def compensate(self, key, x, dtype=None, out=None):
        """x + e (x itself, converted to `dtype` if given, when no matching residual is kept).

        `out` (a numpy array shaped like x, e.g. from `buffer`): x + e is written there, and
        so is x when no residual is kept, so the result never aliases x."""
        if dtype is not None:
            x = x.astype(dtype)
        e = self.get(key, x)
        if out is None:
            return x if e is None else x + e
        if e is None:
            np.copyto(out, x)
            return out
        return np.add(x, e, out=out)

    def buffer(self, key, like) -> np.ndarray:
        """An array shaped and typed like `like` for a round of `key`: one the round gave back
        with `recycle` when there is one, else a new one.  A THC round at d = 2^24 needs three
        64 MB vectors; fresh ones cost the kernel's page zeroing every round (docs/bench-history.md,
        "Rounds without new vectors")."""
        pool = self._spare.get(key, [])
        while pool:
            b = pool.pop()
            if b.shape == np.shape(like) and b.dtype == like.dtype:
                return b
        return np.empty_like(like)

    def recycle(self, key, *arrays) -> None:
        """Give back arrays a round of `key` no longer reads (at most two are kept; never the
        residual kept under `key`)."""
        pool = self._spare.setdefault(key, [])
        for a in arrays:
            if isinstance(a, np.ndarray) and a.flags.owndata and a is not self.errors.get(key) \
                    and all(a is not b for b in pool) and len(pool) < 2:
                pool.append(a)

    def state_dict(self) -> dict:
        """The residuals, copied (key -> array): what a checkpoint keeps of this memory."""
        return {k: np.array(e, copy=True) for k, e in self.errors.items()}

    def load_state_dict(self, state: dict) -> None:
        """Take the residuals of `state_dict()` (copied); spare buffers start afresh."""
        self.errors.clear()
        self.errors.update({k: np.array(e, copy=True) for k, e in state.items()})
        self._spare.clear()

    def update(self, key, residual) -> None:
        """Keep `residual` as the error of `key` for the next round (the memory owns it from
        now on: once replaced, a round may `recycle` its buffer)."""
        self.errors[key] = residual

    put = update


class Codec:
    """Base class; subclasses set `name`, `homomorphic` and implement the methods."""

    name = "abstract"
    homomorphic = False

    def new_state(self) -> dict:
        """Fresh per-tensor worker state (error feedback lives here)."""
        return {}

    def new_ps_state(self) -> dict:
        """Fresh per-tensor PS state (e.g. 3LC's shared pull context)."""
        return {}

    def preliminary(self, x: np.ndarray, state: dict) -> np.ndarray | None:
        """Local statistics exchanged before encoding (combined elementwise by max)."""
        return None

    def encode(self, x: np.ndarray, state: dict, rng: np.random.Generator, ctx: Context) -> bytes:
        raise NotImplementedError

    def aggregate(self, payloads: list[bytes], ps_state: dict, ctx: Context) -> bytes:
        raise NotImplementedError

    def decode(self, payload: bytes, ctx: Context) -> np.ndarray:
        raise NotImplementedError

    def bits_per_coordinate(self, payload: bytes, dim: int) -> float:
        return 8.0 * len(payload) / dim

    #: the codec's name in messages ("CASQ: nothing to aggregate")
    label = None

    @staticmethod
    def memory(state: dict) -> ErrorFeedback:
        """The error feedback of one tensor's worker (or PS) state: residual in ``state["e"]``."""
        return ErrorFeedback(state)

    def decoded_mean(self, payloads, ctx: Context, *, dense=None, mean: bool = True) -> np.ndarray:
        """The first half of decode–average–re-encode (THC §2.2's bidirectional baseline): the
        float64 sum of every payload decoded (by `dense(payload, dim)`, default
        ``self.decode``), divided by the number of payloads unless `mean` is False.  The
        codec re-encodes the result for the downlink."""
        if not payloads:
            raise CodecError(f"{self.label or self.name}: nothing to aggregate")
        total = np.zeros(ctx.dim, dtype=np.float64)
        for p in payloads:
            total += dense(p, ctx.dim) if dense is not None else self.decode(p, ctx)
        return total / len(payloads) if mean else total


def combine_preliminary(stats: list) -> Any:
    """The PS's combine rule for preliminary statistics: elementwise max."""
    stats = [s for s in stats if s is not None]
    if not stats:
        return None
    return np.max(np.stack([np.asarray(s, dtype=np.float64) for s in stats]), axis=0)


def run_round(codec: Codec, grads: list[np.ndarray], rng: np.random.Generator, *, key: str = "t",
              round_no: int = 0, states: list | None = None, ps_state: dict | None = None):
    """One in-process round (no network): returns (mean estimate, up payloads, down payload).

    The reference every networked path is checked against.
    """
    n, dim = len(grads), grads[0].size
    states = states if states is not None else [codec.new_state() for _ in range(n)]
    ps_state = ps_state if ps_state is not None else codec.new_ps_state()
    shared = combine_preliminary([codec.preliminary(g, s) for g, s in zip(grads, states)])
    ctx = Context(key, dim, round_no, shared, n)
    ups = [codec.encode(g, s, rng, ctx) for g, s in zip(grads, states)]
    down = codec.aggregate(ups, ps_state, ctx)
    return codec.decode(down, ctx), ups, down
