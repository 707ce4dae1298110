"""Throughput of THC compress (RHT + clamp + quantize + pack) and decompress, before and after
the fused SIMD kernels, numpy and torch.

Every figure is quoted beside one np.copyto of the same float32 vector, measured in the
same run, so the ratio survives a noisy shared machine.

    .venv/bin/python bench/bench_thc.py [--dims 16 20 24] [--repeat 5]

"before" is the pipeline of commit d92a8a5, rebuilt here from the kernels it used (which
_kernels.c keeps): copy + apply_signs + scalar FWHT + quantize passes, numpy 4-bit packing;
decode: numpy affine map + scalar FWHT + apply_signs.  "after" is thc.encode_packed /
thc.decode (one fused C call per RHT block, AVX-512 or AVX2 when the CPU has it).  "lanes decode" is
what the worker now runs on a complete round: 8-bit sum lanes → Y/k → RHT⁻¹ in the fused
call (thc.decode_lanes).  "own decode" is the error-feedback term RHT⁻¹(X) from the packed
indices (thc.decode_own).  "u+compress" is an encode with its uniforms: before, numpy's
float32 draw into a buffer then the encode reading it; after, the counter uniforms computed
inside the encode (compression/stochastic.py).  "norms" is the preliminary stage's per-block
norms: before, a float32 BLAS dot per block (its summation order the library's); after, the
sum of squares in 16 float64 lanes in a fixed order (thc.block_norms, docs/protocol.md §4).
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import torch

import sys as _sys  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))   # `bench` is not installed: run from a checkout
from bench.common import best
from thc_ps.compression import _kernels, thc
from thc_ps.compression.stochastic import CounterUniforms
from thc_ps.compression.hadamard import rademacher_bits
from thc_ps.proto.packing import pack_indices, unpack_lanes


def encode_before(x, norms, cfg, layout, round_no, uniforms):
    """Table indices through the separate scalar passes of the previous version."""
    table = cfg.table
    tab8 = bytes(table.values)
    out = np.empty(layout.padded_dim, dtype=np.uint8)
    for j, off in enumerate(layout.padded_offsets()):
        p = layout.padded[j]
        xb = np.array(thc._block_padded(x, layout, j), dtype=np.float32, copy=True)
        _kernels.apply_signs(xb, rademacher_bits(cfg.seed, round_no, j, p))
        r = xb.copy()                       # hadamard.fwht returned a new array
        _kernels.fwht(r, 0)
        big_m = thc._scale(float(norms[j]), p, table.t_p)
        _kernels.quantize(r, big_m, cfg.granularity, tab8, uniforms[off:off + p], out[off:off + p])
    return out


def norms_before(x, layout):
    """‖x_j‖ per block as the previous version computed it: a float32 BLAS dot."""
    return np.array([np.sqrt(float(np.dot(x[s:s + n], x[s:s + n]))) for s, n in zip(layout.starts, layout.lengths)])


def decode_before(sums, contributors, norms, cfg, layout, round_no):
    g, tp = cfg.granularity, cfg.table.t_p
    out = np.zeros(layout.dim, dtype=np.float32)
    for j, off in enumerate(layout.padded_offsets()):
        p, s, n = layout.padded[j], layout.starts[j], layout.lengths[j]
        big_m = thc._scale(float(norms[j]), p, tp)
        a = sums[off:off + p].astype(np.float32) * (2.0 * big_m / (g * contributors)) - big_m
        r = a.copy()
        _kernels.fwht(r, 0)
        _kernels.apply_signs(r, rademacher_bits(cfg.seed, round_no, j, p))
        out[s:s + n] = r[:n]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[16, 20, 24], help="log2 of d")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (1: one core like the C kernels; 2 spin-waits badly on a busy host)")
    ap.add_argument("--codec-threads", type=int, default=1,
                    help="threads per encode/decode, one RHT block each (THC_CODEC_THREADS; 1: one core)")
    ap.add_argument("--block-log2", type=int, default=thc.DEFAULT_BLOCK_LOG2,
                    help="log2 of the RHT block (the job's block_log2; the authors' cap is 23)")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    os.environ["THC_CODEC_THREADS"] = str(args.codec_threads)
    cfg = thc.ThcConfig(block_log2=args.block_log2)
    print(f"RHT blocks of 2^{cfg.block_log2}, torch threads {torch.get_num_threads()}, codec threads {thc.codec_threads()}, numpy {np.__version__}, "
          f"torch {torch.__version__}, kernels {_kernels.simd()}")
    print(f"{'d':>4} {'backend':>7} {'stage':>17} {'ms':>9} {'Mcoord/s':>9} {'x copyto':>9} {'after/before':>12}")
    for k in args.dims:
        d = 1 << k
        rng = np.random.default_rng(0)
        x = rng.lognormal(0, 1, d).astype(np.float32)
        dst = np.empty_like(x)
        copy = best(lambda: np.copyto(dst, x), args.repeat)
        layout = thc.make_layout(d, cfg.block_log2)
        norms = thc.block_norms(x, layout)
        u = rng.random(layout.padded_dim, dtype=np.float32)
        xt, ut = torch.from_numpy(x), torch.from_numpy(u)
        z = thc.encode(x, norms, cfg, layout, 0, u)
        packed = pack_indices(z, 4)
        assert np.array_equal(encode_before(x, norms, cfg, layout, 0, u), z)   # same bytes, before and after
        y = thc.lookup_sum([z] * 4, cfg.table.values)
        lanes = y.astype(">u1").tobytes()
        yt = torch.from_numpy(y)
        draw, ubuf = np.random.default_rng(1), np.empty(layout.padded_dim, np.float32)
        rows = [
            ("numpy", "norms before", lambda: norms_before(x, layout)),
            ("numpy", "norms", lambda: thc.block_norms(x, layout)),
            ("numpy", "compress before", lambda: pack_indices(encode_before(x, norms, cfg, layout, 0, u), 4)),
            ("numpy", "compress", lambda: thc.encode_packed(x, norms, cfg, layout, 0, u)),
            ("torch", "compress", lambda: pack_indices(thc.encode(xt, norms, cfg, layout, 0, ut).numpy(), 4)),
            ("numpy", "decompress before", lambda: decode_before(unpack_lanes(lanes, 8), 4, norms, cfg, layout, 0)),
            ("numpy", "decompress", lambda: thc.decode(unpack_lanes(lanes, 8), 4, norms, cfg, layout, 0)),
            ("numpy", "lanes decode", lambda: thc.decode_lanes(np.frombuffer(lanes, np.uint8), 4, norms, cfg, layout, 0)),
            ("numpy", "own decode", lambda: thc.decode_own(packed, norms, cfg, layout, 0, packed=True)),
            ("numpy", "u+compress before", lambda: thc.encode_packed(x, norms, cfg, layout, 0, draw.random(
                layout.padded_dim, dtype=np.float32, out=ubuf))),
            ("numpy", "u+compress", lambda: thc.encode_packed(x, norms, cfg, layout, 0, CounterUniforms(7))),
            ("torch", "decompress", lambda: thc.decode(yt, 4, norms, cfg, layout, 0)),
        ]
        print(f"{k:>4} {'numpy':>7} {'copyto':>17} {copy * 1e3:9.2f} {d / copy / 1e6:9.0f} {1.0:9.1f}")
        before = {}
        for backend, stage, fn in rows:
            fn()
            t = best(fn, args.repeat)
            if stage.endswith(" before"):
                before[stage.split()[0]] = t
            ratio = before.get(stage) if backend == "numpy" and stage in before else None
            col = f"{ratio / t:12.2f}" if ratio else ""
            print(f"{k:>4} {backend:>7} {stage:>17} {t * 1e3:9.2f} {d / t / 1e6:9.1f} {t / copy:9.1f} {col}",
                  flush=True)


if __name__ == "__main__":
    main()
