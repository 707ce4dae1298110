"""FWHT speed: the project's kernel (AVX-512, AVX2 and the scalar fallback) vs the `fht-cpu` library vs a copy.

All rows transform the same float32 array in place, one process, each row once per repetition in
turn (so the host's drift hits every row alike), best of --repeat:

    .venv/bin/python bench/bench_fwht.py [--dims 16 20 24] [--repeat 5]

`fht-cpu` (pip install '.[bench]') computes the unnormalized transform; its row is skipped,
with a line saying so, when it is not installed.  The project's scalar row is the kernel of
the previous version (the same butterflies, which the vector paths equal bit for bit); the
AVX-512 row is there when the CPU has it (it is the default path then).
"""
from __future__ import annotations

import argparse

import numpy as np

import sys as _sys  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))   # `bench` is not installed: run from a checkout
from bench.common import best
from thc_ps.compression import _kernels

try:
    import fht_cpu
except ImportError:  # optional benchmark dependency
    fht_cpu = None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[16, 20, 24], help="log2 of the length")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"numpy {np.__version__}, project kernel default path: {_kernels.simd()}")
    if fht_cpu is None:
        print("fht-cpu NOT INSTALLED (pip install '.[bench]'): its rows are skipped")
    else:
        print(f"fht-cpu {getattr(fht_cpu, '__version__', '?')} (unnormalized, in place, 1-D single-threaded)")
    print(f"{'d':>4} {'transform':>22} {'ms':>9} {'Mcoord/s':>9} {'x copyto':>9} {'vs fht-cpu':>10}")
    for k in args.dims:
        n = 1 << k
        x = np.random.default_rng(k).standard_normal(n).astype(np.float32)
        dst = np.empty_like(x)
        rows = [("np.copyto", lambda: np.copyto(dst, x))]
        if fht_cpu is not None:
            rows.append(("fht-cpu", lambda: fht_cpu.fht(x)))
        if _kernels.has_avx512():
            rows.append(("project AVX-512", lambda: _kernels.fwht(x, 2)))
        if _kernels.has_avx2():
            rows.append(("project AVX2", lambda: _kernels.fwht(x, 1)))
        rows.append(("project scalar (before)", lambda: _kernels.fwht(x, 0)))
        times = {name: float("inf") for name, _ in rows}
        for r in range(args.repeat + 1):           # repetition 0 warms: pages touched, code loaded
            for name, fn in rows:
                t = best(fn, 1)
                if r:
                    times[name] = min(times[name], t)
                if name == "fht-cpu":              # keep the values O(1) for the next rows
                    x *= np.float32(1 / np.sqrt(n))
        ref = times.get("fht-cpu")
        for name, t in times.items():
            vs = f"{ref / t:10.2f}" if ref else f"{'n/a':>10}"
            print(f"{k:>4} {name:>22} {t * 1e3:9.3f} {n / t / 1e6:9.0f} {t / times['np.copyto']:9.1f} {vs}",
                  flush=True)


if __name__ == "__main__":
    main()
