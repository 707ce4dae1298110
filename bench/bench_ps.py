"""PS core lookup-and-sum: C (AVX2 pshufb and plain C) vs numpy vs a plain copy, one run.

Input: d packed 4-bit indices (d/2 bytes) added into d 8-bit lanes, as the PS does per
worker packet.  Rates are packed input bytes per second and coordinates per second; the
ratio column divides each time by a plain copy of the same packed bytes (memory speed).

    .venv/bin/python bench/bench_ps.py [--log2 24] [--repeat 7]
"""
from __future__ import annotations

import argparse

import numpy as np

import sys as _sys  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))   # `bench` is not installed: run from a checkout
from bench.common import best

from thc_ps.proto.packing import unpack_indices
from thc_ps.ps_server._fastpath import has_avx2, lookup_accumulate

TABLE = [0, 3, 5, 7, 9, 11, 13, 14, 15, 17, 19, 21, 23, 25, 27, 30]




def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log2", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    d = 1 << args.log2
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, d // 2, dtype=np.uint8)
    raw = packed.tobytes()
    acc = np.zeros(d, np.uint8)
    tab = np.asarray(TABLE, np.uint8)
    dst = np.empty_like(packed)

    def numpy_path():
        np.add(acc, tab[unpack_indices(packed, 4, d)], out=acc)

    rows = [("copy of the packed bytes", lambda: np.copyto(dst, packed)),
            (f"C AVX2 pshufb{'' if has_avx2() else ' (absent: scalar)'}", lambda: lookup_accumulate(acc, raw, TABLE, 4)),
            ("C scalar", lambda: lookup_accumulate(acc, raw, TABLE, 4, True)),
            ("numpy (unpack, take, add)", numpy_path)]
    times = {name: best(fn, args.repeat) for name, fn in rows}
    base = times[rows[0][0]]
    print(f"d = 2^{args.log2} coordinates, {d // 2 / 2**20:.0f} MiB packed input, best of {args.repeat}")
    print(f"{'path':<28}{'ms':>9}{'GB/s in':>9}{'Gcoord/s':>10}{'x copy':>8}")
    for name, _ in rows:
        t = times[name]
        print(f"{name:<28}{t * 1e3:9.2f}{d / 2 / t / 1e9:9.2f}{d / t / 1e9:10.2f}{t / base:8.2f}")


if __name__ == "__main__":
    main()
