"""NMSE of one aggregation round, ‖x̂ − x̄‖² / ‖x̄‖² (THC paper §2.2, App. C.1).

The same synthetic workload for every codec: a gradient per worker drawn from
lognormal(0, 1), normal or Laplace, either one vector copied to every worker
(App. C.1's method) or independent draws.
"""
from __future__ import annotations

import math

import numpy as np

from thc_ps.compression import baselines, thc

CODECS = ("thc", "uhc", "topk", "terngrad", "none")


def all_codecs() -> list:
    """The built-in reference paths plus every codec of the registry."""
    from thc_ps.compression import registry
    return list(dict.fromkeys(list(CODECS) + registry.names()))
DISTS = ("lognormal", "normal", "laplace")


def draw(dist: str, dim: int, rng: np.random.Generator) -> np.ndarray:
    if dist == "lognormal":
        return rng.lognormal(0.0, 1.0, dim).astype(np.float32)
    if dist == "normal":
        return rng.standard_normal(dim, dtype=np.float32)
    if dist == "laplace":
        return rng.laplace(0.0, 1.0, dim).astype(np.float32)
    raise ValueError(f"unknown distribution {dist!r}; choose from {', '.join(DISTS)}")


def workload(dist: str, workers: int, dim: int, copies: bool, rng) -> list[np.ndarray]:
    if copies:
        x = draw(dist, dim, rng)
        return [x] * workers
    return [draw(dist, dim, rng) for _ in range(workers)]


def one_round(codec: str, grads, rng, *, bits=4, granularity=30, p="1/32", topk=0.1,
              lane_bits=None, seed=0, round_no=0, block_log2=thc.DEFAULT_BLOCK_LOG2,
              tail_log2=thc.DEFAULT_TAIL_LOG2):
    """Estimate of the mean of `grads` after one round of `codec`, and its (bits_up, bits_down)."""
    n, d = len(grads), grads[0].size
    if codec == "none":
        return np.mean(grads, axis=0, dtype=np.float64).astype(np.float32), (32.0, 32.0)
    if codec == "thc":
        from thc_ps.proto.packing import lane_bits_for
        lanes = lane_bits or lane_bits_for(n, granularity)
        cfg = thc.ThcConfig(bits=bits, granularity=granularity, p=p, lane_bits=lanes, seed=seed,
                            block_log2=block_log2, tail_log2=tail_log2)
        cfg.check_workers(n)
        rounds = [thc.WorkerRound(cfg, g) for g in grads]
        norms = np.max([r.norms() for r in rounds], axis=0)
        zs = [r.encode(norms, rng, round_no) for r in rounds]
        est = rounds[0].decode(thc.lookup_sum(zs, cfg.table.values), n)
        pad = rounds[0].layout.padded_dim / d
        return est, (bits * pad, lanes * pad)
    if codec == "uhc":
        from thc_ps.proto.packing import lane_bits_for
        cfg = thc.UhcConfig(bits=bits, lane_bits=lane_bits or lane_bits_for(n, (1 << bits) - 1))
        cfg.check_workers(n)
        lo = float(min(g.min() for g in grads))
        hi = float(max(g.max() for g in grads))
        zs = [thc.uhc_encode(g, lo, hi, cfg, rng.random(d, dtype=np.float32)) for g in grads]
        return thc.uhc_decode(thc.lookup_sum(zs, cfg.table.values), n, lo, hi, cfg), (bits, cfg.lane_bits)
    if codec == "topk":
        k = baselines.topk_count(d, topk)
        msgs = [baselines.topk_encode(g, k) for g in grads]
        idx, vals = baselines.topk_ps_aggregate(msgs, d, k, n)
        bpc = baselines.topk_bits_per_coordinate(k, d)
        return baselines.topk_decode(idx, vals, d), (bpc, bpc)
    if codec == "terngrad":
        s = float(max(np.abs(g).max() for g in grads))
        ts = [baselines.terngrad_encode(g, s, rng.random(d, dtype=np.float32)) for g in grads]
        total = np.sum([t.astype(np.int32) for t in ts], axis=0)
        return baselines.terngrad_decode(total, n, s), (2.0, float(baselines.terngrad_down_bits(n)))
    from thc_ps.compression import registry
    from thc_ps.compression.codec import run_round
    kwargs = {"bits": bits} if codec == "casq" else {}
    impl = registry.get(codec, **kwargs)
    est, ups, down = run_round(impl, grads, rng, round_no=round_no)
    return est, (float(np.mean([8.0 * len(u) / d for u in ups])), 8.0 * len(down) / d)


def run(codec: str, *, workers: int = 2, dim: int = 1 << 20, dist: str = "lognormal",
        copies: bool = True, trials: int = 10, seed: int = 0, **params) -> dict:
    """Mean NMSE over `trials` independent rounds, with its standard error."""
    if workers < 1 or dim < 1 or trials < 1:
        raise ValueError("workers, dim and trials must be positive")
    rng = np.random.default_rng(seed)
    values, bits = [], (0.0, 0.0)
    for t in range(trials):
        grads = workload(dist, workers, dim, copies, rng)
        mean = np.mean(grads, axis=0, dtype=np.float64)
        est, bits = one_round(codec, grads, rng, seed=seed, round_no=t, **params)
        values.append(float(np.sum((est - mean) ** 2) / np.sum(mean ** 2)))
    arr = np.asarray(values)
    return {"codec": codec, "nmse": float(arr.mean()),
            "nmse_stderr": float(arr.std(ddof=1) / math.sqrt(trials)) if trials > 1 else 0.0,
            "bits_up": bits[0], "bits_down": bits[1], "workers": workers, "dim": dim,
            "dist": dist, "copies": copies, "trials": trials, "seed": seed,
            **{k: (str(v) if k == "p" else v) for k, v in params.items()}}
