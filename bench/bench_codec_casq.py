"""CASQ on the synthetic workload of docs/codec-casq.md note 8: NMSE, bits per coordinate,
compression ratio and encode/decode speed, beside unbiased uniform stochastic quantizers
(the paper's Fig 5 comparison: "CASQ-2bit below every 3-bit baseline").

Inputs (docs/codec-casq.md note 8 table): N(0,1), Laplace(0,1), Student-t ν=3, signed lognormal σ=1.5; one vector
each of --dim coordinates, ρ = 0.5%, 10% K-means sample.  NMSE = ‖ĝ − g‖²/‖g‖² of one
encode/decode (CASQ is deterministic given the hash; the uniform quantizers are stochastic, one
draw).  Bits count everything on the wire for CASQ (ids + bucket floats + header) and only the
level index for the uniform quantizers (their per-bucket scales are not added, which favours them).
Speed: MB/s of float32 input, best of --reps; "encode" includes the K-means refit (first step
of every τ), "enc steady" is a step that reuses the centers.

    .venv/bin/python bench/bench_codec_casq.py [--dim 1048576] [--reps 3]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from thc_ps.compression import casq as C
from thc_ps.compression.codec import Context

UNIFORM = (("qinf", 512), ("qinf", None), ("symmetric", 512), ("minmax", None))


def draw(dist: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if dist == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if dist == "laplace":
        return rng.laplace(0, 1, n).astype(np.float32)
    if dist == "student-t3":
        return rng.standard_t(3, n).astype(np.float32)
    return (rng.choice([-1, 1], n) * rng.lognormal(0, 1.5, n)).astype(np.float32)


def nmse(g, x) -> float:
    x = x.astype(np.float64)
    return float(np.sum((np.asarray(g, np.float64) - x) ** 2) / np.sum(x ** 2))


def best(fn, reps):
    out, t = None, float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        t = min(t, time.perf_counter() - t0)
    return out, t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=1 << 20)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n, mb = args.dim, args.dim * 4 / 1e6
    rng = np.random.default_rng(0)
    ctx = Context("bench", n)
    print(f"N = {n}, rho = 0.5%, sample 10%, one vector per distribution, speeds best of {args.reps}")
    print(f"{'input':<12}{'codec':<22}{'NMSE':>9}{'bits/coord':>12}{'ratio':>8}"
          f"{'encode MB/s':>13}{'enc steady':>12}{'decode MB/s':>13}")
    summary = []
    for dist in ("normal", "laplace", "student-t3", "lognormal"):
        x = draw(dist, n, rng)
        res = {}
        for bits in (1, 2, 3):
            codec = C.CASQCodec(bits=bits, error_feedback=False)
            p, te = best(lambda: codec.encode(x, {}, np.random.default_rng(1), ctx), args.reps)
            st = {}
            codec.encode(x, st, np.random.default_rng(1), ctx)
            _, ts = best(lambda: codec.encode(x, st, None, ctx), args.reps)
            g, td = best(lambda: codec.decode(p, ctx), args.reps)
            bpc = C.bits_per_coordinate(p)
            res[f"casq{bits}"] = nmse(g, x)
            print(f"{dist:<12}{f'CASQ {bits}-bit':<22}{res[f'casq{bits}']:>9.4f}{bpc:>12.3f}{32 / bpc:>8.2f}"
                  f"{mb / te:>13.1f}{mb / ts:>12.1f}{mb / td:>13.1f}")
        for alloc in ("even", "variance"):
            codec = C.CASQCodec(bits=2, error_feedback=False, alloc=alloc)
            p = codec.encode(x, {}, np.random.default_rng(1), ctx)
            print(f"{dist:<12}{f'CASQ 2-bit {alloc}':<22}{nmse(codec.decode(p, ctx), x):>9.4f}"
                  f"{C.bits_per_coordinate(p):>12.3f}")
        for bits in (2, 3):
            for scheme, bucket in UNIFORM:
                name = f"{scheme} {bits}b " + (f"/{bucket}" if bucket else "whole")
                q, tq = best(lambda: C.uniform_sq(x, bits, np.random.default_rng(2), scheme=scheme, bucket=bucket),
                             args.reps)
                res[name] = nmse(q, x)
                print(f"{dist:<12}{name:<22}{res[name]:>9.4f}{bits:>12.3f}{32 / bits:>8.2f}{mb / tq:>13.1f}")
        best3 = min((v, k) for k, v in res.items() if " 3b " in k)
        summary.append((dist, res["casq2"], best3[1], best3[0], best3[0] / res["casq2"]))
    print("\nCASQ 2-bit vs the best 3-bit uniform stochastic quantizer")
    print(f"{'input':<12}{'CASQ-2b':>9}  {'best 3-bit uniform':<22}{'NMSE':>9}{'ratio':>8}")
    for dist, c2, name, v, r in summary:
        print(f"{dist:<12}{c2:>9.4f}  {name:<22}{v:>9.4f}{r:>7.2f}x")


if __name__ == "__main__":
    main()
