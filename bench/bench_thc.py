"""Throughput of THC compress (RHT + clamp + quantize + pack) and decompress, numpy and torch.

Every figure is quoted beside one np.copyto of the same float32 vector, measured in the
same run, so the ratio survives a noisy shared machine.

    .venv/bin/python bench/bench_thc.py [--dims 20 24] [--repeat 5]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import best
import torch

from compression import thc
from proto.packing import pack_indices, unpack_lanes




def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[20, 24], help="log2 of d")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    cfg = thc.ThcConfig()
    print(f"torch threads {torch.get_num_threads()}, numpy {np.__version__}, torch {torch.__version__}")
    print(f"{'d':>6} {'backend':>7} {'stage':>10} {'ms':>9} {'Mcoord/s':>9} {'x copyto':>9}")
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
        y = thc.lookup_sum([z] * 4, cfg.table.values)
        lanes = y.astype(">u1").tobytes()
        yt = torch.from_numpy(y)
        rows = {
            ("numpy", "compress"): lambda: pack_indices(thc.encode(x, norms, cfg, layout, 0, u), 4),
            ("torch", "compress"): lambda: pack_indices(thc.encode(xt, norms, cfg, layout, 0, ut).numpy(), 4),
            ("numpy", "decompress"): lambda: thc.decode(unpack_lanes(lanes, 8), 4, norms, cfg, layout, 0),
            ("torch", "decompress"): lambda: thc.decode(yt, 4, norms, cfg, layout, 0),
        }
        print(f"{k:>6} {'numpy':>7} {'copyto':>10} {copy * 1e3:9.2f} {d / copy / 1e6:9.0f} {1.0:9.1f}")
        for (backend, stage), fn in rows.items():
            t = best(fn, args.repeat)
            print(f"{k:>6} {backend:>7} {stage:>10} {t * 1e3:9.2f} {d / t / 1e6:9.1f} {t / copy:9.1f}", flush=True)


if __name__ == "__main__":
    main()
