"""SKCompress encode/decode speed, with the C Huffman decoder and with the Python reference
decoder, same run (side by side: this machine is shared and noisy).

    .venv/bin/python bench/bench_codec_skcompress.py [--repeat 3]
"""
from __future__ import annotations

import argparse

import numpy as np

import sys as _sys  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))   # `bench` is not installed: run from a checkout
from bench.common import best
from thc_ps.compression import skcompress as S

#: (name, dimension, nonzeros): a dense 2^20 vector and the KDD10-like sparse shape.
CASES = (("dense 2^20", 1 << 20, 1 << 20), ("KDD10-like", 3_000_000, 300_000))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    c_decoder = S._bitstream
    print(f"{'input':<12}{'nnz':>9}{'bytes/nnz':>10}{'encode Mkv/s':>14}{'decode C':>10}"
          f"{'decode py':>11}{'C / py':>8}")
    for name, dim, nnz in CASES:
        keys = np.sort(rng.choice(dim, nnz, replace=False))
        vals = rng.standard_normal(nnz) * 1e-3
        msg = S.encode(keys, vals, dim)
        t_enc = best(lambda: S.encode(keys, vals, dim), args.repeat)
        t_c = best(lambda: S.decode(msg), args.repeat)
        try:
            S._bitstream = None
            t_py = best(lambda: S.decode(msg), args.repeat)
        finally:
            S._bitstream = c_decoder
        print(f"{name:<12}{nnz:>9}{len(msg) / nnz:>10.2f}{nnz / t_enc / 1e6:>14.2f}"
              f"{nnz / t_c / 1e6:>10.2f}{nnz / t_py / 1e6:>11.2f}{t_py / t_c:>8.1f}")


if __name__ == "__main__":
    main()
