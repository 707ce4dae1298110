"""THC, uniform THC, TopK, TernGrad and float32 as codecs of the common interface.

THC, uniform THC and TernGrad (shared max) are homomorphic: `aggregate` is a lookup-and-sum
on the compressed data.  TopK aggregates by decoding, averaging and re-sparsifying (the
bidirectional baseline of THC §2.2).  Payload layouts are defined here and validated on
decode; anything inconsistent raises CodecError.
"""
from __future__ import annotations

import struct

import numpy as np

from thc_ps.compression import baselines, thc
from thc_ps.compression.codec import Codec, CodecError, Context
from thc_ps.proto.packing import LANE_DTYPES as _LANE
from thc_ps.proto.packing import lane_bits_for, pack_indices, packed_size, unpack_indices


def _need(payload: bytes, n: int, what: str) -> None:
    if len(payload) != n:
        raise CodecError(f"{what}: expected {n} bytes, got {len(payload)}")


def _index_sum(payloads, table, bits, count, lane_bits) -> bytes:
    tab = np.asarray(table, dtype=np.int64)
    total = np.zeros(count, dtype=np.int64)
    for p in payloads:
        _need(p, packed_size(count, bits), "index payload")
        total += tab[unpack_indices(p, bits, count)]
    return total.astype(_LANE[lane_bits]).tobytes()


class ThcCodec(Codec):
    """THC (paper Alg. 3) with error feedback; payload up = packed b-bit indices, down = lanes.

    Down payload: u8 contributors k, then the lanes of Σ T[Z] (lane width from n·g).
    """

    name = "thc"
    homomorphic = True

    def __init__(self, bits: int = 4, granularity: int = 30, p="1/32", seed: int = 0,
                 block_log2: int = thc.DEFAULT_BLOCK_LOG2, error_feedback: bool = True):
        self.cfg = thc.ThcConfig(bits=bits, granularity=granularity, p=p, seed=seed, lane_bits=32,
                                 block_log2=block_log2)
        self.error_feedback = error_feedback

    def preliminary(self, x, state):
        rnd = state["round"] = thc.WorkerRound(self.cfg, x, self.memory(state) if self.error_feedback else None, "e")
        return rnd.norms().astype(np.float32)

    def encode(self, x, state, rng, ctx: Context) -> bytes:
        rnd = state.pop("round", None)
        if rnd is None:     # no preliminary stage: x as given, the residual still kept
            rnd = thc.WorkerRound(self.cfg, x, self.memory(state) if self.error_feedback else None, "e",
                                  compensate=False)
        z = rnd.encode(np.asarray(ctx.shared, dtype=np.float64), rng, ctx.round_no)
        rnd.feedback()
        return pack_indices(z, self.cfg.bits).tobytes()

    def aggregate(self, payloads, ps_state, ctx: Context) -> bytes:
        layout = self.cfg.layout(ctx.dim)
        lanes = lane_bits_for(len(payloads), self.cfg.granularity)
        return bytes([len(payloads), lanes]) + _index_sum(payloads, self.cfg.table.values, self.cfg.bits,
                                                          layout.padded_dim, lanes)

    def decode(self, payload, ctx: Context) -> np.ndarray:
        layout = self.cfg.layout(ctx.dim)
        if len(payload) < 2 or payload[1] not in _LANE or payload[0] == 0:
            raise CodecError("THC down payload: bad header")
        k, lanes = payload[0], payload[1]
        _need(payload, 2 + layout.padded_dim * lanes // 8, "THC down payload")
        y = np.frombuffer(payload, dtype=_LANE[lanes], offset=2).astype(np.int64)
        y_avg = (y / k).astype(np.float32)
        return thc.decode(y_avg, 1, np.asarray(ctx.shared, dtype=np.float64), self.cfg, layout, ctx.round_no)


class UhcCodec(Codec):
    """Uniform THC (Alg. 1): global [min, max] in the preliminary stage, identity table."""

    name = "uhc"
    homomorphic = True

    def __init__(self, bits: int = 4):
        self.cfg = thc.UhcConfig(bits=bits, lane_bits=32)

    def preliminary(self, x, state):
        return np.array([-float(x.min()), float(x.max())])   # max of (−min, max) gives (−m, M)

    def encode(self, x, state, rng, ctx):
        lo, hi = -float(ctx.shared[0]), float(ctx.shared[1])
        z = thc.uhc_encode(x, lo, hi, self.cfg, rng.random(x.size, dtype=np.float32))
        return pack_indices(z, self.cfg.bits).tobytes()

    def aggregate(self, payloads, ps_state, ctx):
        lanes = lane_bits_for(len(payloads), self.cfg.granularity)
        return bytes([len(payloads), lanes]) + _index_sum(payloads, self.cfg.table.values, self.cfg.bits,
                                                          ctx.dim, lanes)

    def decode(self, payload, ctx):
        if len(payload) < 2 or payload[1] not in _LANE or payload[0] == 0:
            raise CodecError("UHC down payload: bad header")
        _need(payload, 2 + ctx.dim * payload[1] // 8, "UHC down payload")
        y = np.frombuffer(payload, dtype=_LANE[payload[1]], offset=2).astype(np.int64)
        return thc.uhc_decode(y, payload[0], -float(ctx.shared[0]), float(ctx.shared[1]), self.cfg)


class TernGradCodec(Codec):
    """TernGrad with a shared max s: ternary {−1,0,1} as 2-bit codes {0,1,2}; the PS sums codes
    (a lookup-and-sum with the identity table) and the worker subtracts k: x̂ = s·(Y − k)/k."""

    name = "terngrad"
    homomorphic = True

    def __init__(self, error_feedback: bool = False):
        self.error_feedback = error_feedback

    def preliminary(self, x, state):
        return np.array([float(np.abs(x).max())])

    def encode(self, x, state, rng, ctx):
        t = baselines.terngrad_encode(x, float(ctx.shared[0]), rng.random(x.size, dtype=np.float32))
        return pack_indices((t + 1).astype(np.uint8), 2).tobytes()

    def aggregate(self, payloads, ps_state, ctx):
        lanes = lane_bits_for(len(payloads), 2)
        return bytes([len(payloads), lanes]) + _index_sum(payloads, (0, 1, 2, 3), 2, ctx.dim, lanes)

    def decode(self, payload, ctx):
        if len(payload) < 2 or payload[1] not in _LANE or payload[0] == 0:
            raise CodecError("TernGrad down payload: bad header")
        _need(payload, 2 + ctx.dim * payload[1] // 8, "TernGrad down payload")
        k = payload[0]
        y = np.frombuffer(payload, dtype=_LANE[payload[1]], offset=2).astype(np.int64) - k
        return baselines.terngrad_decode(y, k, float(ctx.shared[0]))

    def bits_per_coordinate(self, payload, dim):
        return 8.0 * len(payload) / dim


class TopKCodec(Codec):
    """TopK with error feedback; payload = u32 k, k × u32 index, k × f32 value (big-endian).
    The PS decodes every worker, averages, and re-sparsifies to k (bidirectional TopK)."""

    name = "topk"
    homomorphic = False

    def __init__(self, fraction: float = 0.1, error_feedback: bool = True):
        if not 0 < fraction <= 1:
            raise ValueError(f"TopK fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction
        self.error_feedback = error_feedback

    @staticmethod
    def pack(idx: np.ndarray, vals: np.ndarray) -> bytes:
        return struct.pack(">I", idx.size) + idx.astype(">u4").tobytes() + vals.astype(">f4").tobytes()

    @staticmethod
    def unpack(payload: bytes, dim: int):
        if len(payload) < 4:
            raise CodecError("TopK payload shorter than its count")
        (k,) = struct.unpack_from(">I", payload)
        _need(payload, 4 + 8 * k, "TopK payload")
        idx = np.frombuffer(payload, dtype=">u4", count=k, offset=4).astype(np.int64)
        if k and (idx.max() >= dim or np.any(np.diff(idx) <= 0)):
            raise CodecError("TopK payload: indices out of range or not increasing")
        vals = np.frombuffer(payload, dtype=">f4", count=k, offset=4 + 4 * k).astype(np.float32)
        return idx, vals

    def encode(self, x, state, rng, ctx):
        memory = self.memory(state) if self.error_feedback else None
        xe = memory.compensate("e", x) if memory else x
        idx, vals = baselines.topk_encode(xe, baselines.topk_count(ctx.dim, self.fraction))
        if memory:
            e = xe.copy()
            e[idx] = 0.0
            memory.update("e", e)
        return self.pack(idx, vals)

    def aggregate(self, payloads, ps_state, ctx):
        msgs = [self.unpack(p, ctx.dim) for p in payloads]
        idx, vals = baselines.topk_ps_aggregate(msgs, ctx.dim, baselines.topk_count(ctx.dim, self.fraction),
                                                len(payloads))
        return self.pack(idx, vals)

    def decode(self, payload, ctx):
        idx, vals = self.unpack(payload, ctx.dim)
        return baselines.topk_decode(idx, vals, ctx.dim)


class NoneCodec(Codec):
    """Uncompressed float32; the PS averages."""

    name = "none"
    homomorphic = True

    def encode(self, x, state, rng, ctx):
        return np.asarray(x, dtype=">f4").tobytes()

    def aggregate(self, payloads, ps_state, ctx):
        total = np.zeros(ctx.dim, dtype=np.float32)
        for p in payloads:
            _need(p, 4 * ctx.dim, "float32 payload")
            total += np.frombuffer(p, dtype=">f4")
        return (total / len(payloads)).astype(">f4").tobytes()

    def decode(self, payload, ctx):
        _need(payload, 4 * ctx.dim, "float32 payload")
        return np.frombuffer(payload, dtype=">f4").astype(np.float32)
