"""FastSGD on the workloads of docs/codec-fastsgd.md notes 2.2 and 6.

1. Speed. Encode and decode MB/s. The pure key-value API is timed on D N(0,1) nonzeros on
   random keys in Dm = 54,686,452 (KDD12's feature count). The dense codec path is timed on a
   2^20 float32 tensor and shown beside TopK 10% and `none` from the registry. Last comes a
   linear-time check: dense encode at 10^6 and 10^7. MB/s counts the uncompressed input, which
   is 8 bytes per key-value pair for the sparse API and 4 bytes per coordinate for dense tensors.
2. Compression ratio against dimension. Seeded inputs: dense N(0,1), dense signed
   lognormal(σ=2), and sparse N(0,1) at 2% density (Dm = 50·D). The docs/codec-fastsgd.md note 2.2 ratios are shown
   next to how much of the signal survives: the kept share of S = Σ|v|, and the NMSE of the
   decoded vector against the input (1 = everything lost). 2b is a Fig. 4(b)-style component ablation.
3. Bits per key against l (paper Table VI) on heavy-tailed gaps ⌊Pareto(1.2) + 1⌋ ≤ 10^6, beside a
   byte-granular LEB128 varint (the SketchML-style baseline of Table V).
4. One PS round (run_round, W = 4, dim 2^20): NMSE of the decoded mean, and bytes up and down.

    .venv/bin/python bench/bench_codec_fastsgd.py [--reps 3] [--max-exp 7]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import sys as _sys  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))   # `bench` is not installed: run from a checkout
from bench.common import best
from thc_ps.compression import fastsgd as F
from thc_ps.compression import registry
from thc_ps.compression.codec import Context, run_round

KDD12_DM = 54_686_452


def timed(fn, reps):
    out = fn()
    return out, best(fn, reps)


def signed_lognormal(rng, n, sigma=2.0):
    return (rng.choice([-1.0, 1.0], n) * rng.lognormal(0, sigma, n)).astype(np.float32)


def sparse_keys(rng, D, density):
    """Strictly increasing keys with geometric gaps (mean 1/density): Dm ≈ D/density."""
    return np.cumsum(rng.geometric(density, D)).astype(np.int64) - 1


def speed(reps):
    print("== 1. speed (best of %d)" % reps)
    print(f"{'input':<38}{'d':>9}{'bytes':>10}{'CR_kv':>10}{'CR_dense':>10}{'enc MB/s':>10}{'dec MB/s':>10}"
          f"{'enc ms':>9}{'dec ms':>9}")
    rng = np.random.default_rng(0)
    for D, kind in ((10**6, "normal"), (2 * 10**5, "normal"), (10**6, "lognormal")):
        keys = np.sort(rng.choice(KDD12_DM, D, replace=False))
        vals = rng.standard_normal(D).astype(np.float32) if kind == "normal" else signed_lognormal(rng, D)
        msg, te = timed(lambda: F.encode(keys, vals), reps)
        _, td = timed(lambda: F.decode(msg), reps)
        st = F.message_stats(msg, D, KDD12_DM)
        mb = 8 * D / 1e6
        print(f"{f'sparse API D={D:.0e} {kind}, Dm=54.7M':<38}{st['d']:>9}{len(msg):>10}{st['cr_kv']:>10.1f}"
              f"{st['cr_dense']:>10.1f}"
              f"{mb / te:>10.1f}{mb / td:>10.1f}{1e3 * te:>9.1f}{1e3 * td:>9.1f}")
    n = 1 << 20
    ctx = Context("bench", n)
    for kind in ("normal", "lognormal"):
        x = rng.standard_normal(n).astype(np.float32) if kind == "normal" else signed_lognormal(rng, n)
        for name, params in (("fastsgd", {}), ("topk", {"fraction": 0.1, "error_feedback": False}), ("none", {})):
            codec = registry.get(name, **params)
            p, te = timed(lambda: codec.encode(x, codec.new_state(), np.random.default_rng(1), ctx), reps)
            _, td = timed(lambda: codec.decode(p, ctx), reps)
            d = F.decode(p)[2]["d"] if name == "fastsgd" else ""
            print(f"{f'dense 2^20 {kind}, {name}':<38}{d:>9}{len(p):>10}{8 * n / len(p):>10.1f}{4 * n / len(p):>10.1f}"
                  f"{4 * n / 1e6 / te:>10.1f}{4 * n / 1e6 / td:>10.1f}{1e3 * te:>9.1f}{1e3 * td:>9.1f}")
    print("linear time, dense N(0,1) codec encode:")
    codec = registry.get("fastsgd")
    for n in (10**6, 10**7):
        x = rng.standard_normal(n).astype(np.float32)
        _, te = timed(lambda: codec.encode(x, {}, None, Context("bench", n)), reps)
        print(f"  n = {n:.0e}: {1e3 * te:8.1f} ms  ({4 * n / 1e6 / te:.0f} MB/s)")


def sweep(max_exp):
    print("\n== 2. compression ratio vs dimension (b = 1.1, tau = 128, l = 2; cap b^tau = %d)"
          % F.kept_cap(1.1, 128))
    print(f"{'input':<20}{'D':>10}{'Dm':>12}{'d':>8}{'d/D':>9}{'bits/key':>9}{'CR_kv':>11}{'CR_payload':>11}"
          f"{'CR_dense':>11}{'kept S':>8}{'NMSE':>8}")
    for kind in ("dense normal", "dense lognormal", "sparse 2% normal"):
        for e in range(3, max_exp + 1):
            D = 10**e
            rng = np.random.default_rng(1000 + e)
            vals = signed_lognormal(rng, D) if "lognormal" in kind else rng.standard_normal(D).astype(np.float32)
            keys = sparse_keys(rng, D, 0.02) if kind.startswith("sparse") else np.arange(D)
            dm = int(keys[-1]) + 1
            msg = F.encode(keys, vals)
            st = F.message_stats(msg, D, dm)
            k2, v2, h = F.decode(msg)
            pos = np.searchsorted(keys, k2)
            err = vals.astype(np.float64).copy()
            err[pos] -= v2
            nmse = float(np.sum(err ** 2) / np.sum(vals.astype(np.float64) ** 2))
            kept_s = float(np.abs(vals[pos].astype(np.float64)).sum() / h["S"])
            print(f"{kind:<20}{D:>10.0e}{dm:>12}{st['d']:>8}{st['kept_fraction']:>9.2e}{st['bits_per_key']:>9.2f}"
                  f"{st['cr_kv']:>11.4g}{st['cr_payload']:>11.4g}{st['cr_dense']:>11.4g}{kept_s:>8.3f}{nmse:>8.3f}")


def ablation():
    """Fig. 4(b)-style ablation on one message. The paper's components are added one at a time;
    message size is counted as in §3.4 (payload bits, no header), against 64 bits per pair."""
    print("\n== 2b. component ablation, one message, D = 10^6 in Dm = 54.7M (paper Fig. 4(b): 1.4x ... 18,720x)")
    rng = np.random.default_rng(3)
    keys = np.sort(rng.choice(KDD12_DM, 10**6, replace=False))
    for kind in ("normal", "lognormal"):
        vals = rng.standard_normal(keys.size).astype(np.float32) if kind == "normal" else signed_lognormal(rng, keys.size)
        all_key_bits = F.encode_keys(keys, 2)[2]
        msg = F.encode(keys, vals)
        st = F.message_stats(msg, keys.size, KDD12_DM)
        base = 64 * keys.size
        print(f"  {kind:<10} keys only (32-bit values): {base / (32 * keys.size + all_key_bits):.2f}x   "
              f"+ log quantization (8-bit values): {base / (8 * keys.size + all_key_bits):.2f}x   "
              f"+ threshold filter: {st['cr_payload']:.4g}x (d = {st['d']})")


def bits_per_key():
    print("\n== 3. bits per key vs l (paper Table VI: 8.65 / 6.04 / 7.06 / 12.27 / 14.78; Table V SketchML 9.95)")
    rng = np.random.default_rng(0)
    gaps = np.minimum(np.floor(rng.pareto(1.2, 200_000) + 1), 1e6).astype(np.int64)
    uniform = np.sort(np.random.default_rng(1).choice(KDD12_DM, 200_000, replace=False))
    for label, keys in (("Pareto(1.2) gaps, 2e5 keys", np.cumsum(gaps)), ("uniform 2e5 keys in 54.7M", uniform)):
        delta = np.diff(keys, prepend=0)
        bitlen = np.floor(np.log2(np.maximum(delta, 1))).astype(int) + 1
        varint = 8 * np.maximum(1, -(-bitlen // 7)).mean()
        row = "  ".join(f"l={l}: {F.encode_keys(keys, l)[2] / keys.size:.2f}" for l in range(1, 6))
        print(f"  {label:<28} {row}   varint: {varint:.2f}")


def ps_round():
    print("\n== 4. one PS round, W = 4, dim 2^20 (decode every payload, mean, re-encode)")
    n, W = 1 << 20, 4
    for label in ("correlated N(0,1) (+5% noise)", "independent N(0,1)", "independent lognormal"):
        rng = np.random.default_rng(2)
        if label.startswith("correlated"):
            base = rng.standard_normal(n)
            grads = [(base + 0.05 * rng.standard_normal(n)).astype(np.float32) for _ in range(W)]
        elif "lognormal" in label:
            grads = [signed_lognormal(rng, n) for _ in range(W)]
        else:
            grads = [rng.standard_normal(n).astype(np.float32) for _ in range(W)]
        codec = registry.get("fastsgd")
        t = time.perf_counter()
        est, ups, down = run_round(codec, grads, rng)
        ms = 1e3 * (time.perf_counter() - t)
        mean = np.mean(np.array(grads, np.float64), axis=0)
        nmse = float(np.sum((est - mean) ** 2) / np.sum(mean ** 2))
        print(f"  {label:<32} NMSE {nmse:.4f}   up {np.mean([len(u) for u in ups]):>10.0f} B/worker   "
              f"down {len(down):>8} B   round {ms:.0f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-exp", type=int, default=7, help="largest D in the sweep is 10^max_exp")
    args = ap.parse_args()
    speed(args.reps)
    sweep(args.max_exp)
    ablation()
    bits_per_key()
    ps_round()


if __name__ == "__main__":
    main()
