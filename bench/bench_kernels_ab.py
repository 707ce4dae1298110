"""The worker's C kernels of this checkout against another build's, in one process, calls
interleaved: a kernel change's ratio on a host whose speed drifts between runs (another
build's process run after this one's can land in another minute of the host's load).

    git worktree add --detach /tmp/base BASE && (cd /tmp/base && .venv/bin/python setup.py build_ext --inplace)
    .venv/bin/python bench/bench_kernels_ab.py --base /tmp/base/compression/_kernels.cpython-311-x86_64-linux-gnu.so \\
        [--dims 16 20] [--calls 200] [--json OUT]

(the base build can use this checkout's venv: `/work/main/.venv/bin/python setup.py ...`).
Per kernel and size, the two builds run the same call in turn `--calls` times on their own
output buffers, each build first in every other pair (the first call of a pair brings the
shared inputs into cache for the second) and each writing either set of output buffers in
turn (two copies of one build measured 0.92-1.14x on the memory-bound kernels with a set of
their own each: where the buffers lie weighs that much); printed are each build's fastest and median call and the median of the
pairwise ratios base/this (> 1: this build is faster).  Every pair's outputs must be equal
byte for byte (the kernels are defined to the bit: docs/protocol.md §4), else the script
stops with the kernel's name.  The kernels are the job rotation's step (docs/bench.md,
"One rotation per job"): the rotate from the gradient's pieces with the carried residual,
the quantizer with its residual (counter uniforms, packed 4-bit indices) and the decode of
8-bit lanes.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `bench` is not installed: run from a checkout
from thc_ps.compression import _kernels, thc  # noqa: E402
from thc_ps.compression.hadamard import rademacher_bits  # noqa: E402
from thc_ps.proto.job import JobConfig  # noqa: E402


def load_build(path: str):
    """Another build's _kernels extension as a module of its own (a second dlopen handle)."""
    spec = importlib.util.spec_from_file_location("thc_ps.compression._kernels", path)
    if spec is None:
        raise SystemExit(f"--base {path}: not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module is _kernels:
        raise SystemExit(f"--base {path} is this checkout's own build")
    return module


def cases(p: int):
    """(name, call(K, out), buffers()) per kernel on a block of p coordinates: `buffers()`
    makes one set of output buffers (a dict; keys ending in "work" are scratch, not compared),
    allocated before any call is timed, and `call` fills such a set with build K's kernel."""
    rng = np.random.default_rng(p)
    cfg = thc.ThcConfig.of_job(JobConfig(num_workers=4))
    tab, g = bytes(cfg.table.values), cfg.granularity
    x = rng.standard_normal(p - p // 64).astype(np.float32)           # a gradient short of the block
    pieces = (x[:len(x) // 3], x[len(x) // 3:])
    carry = rng.standard_normal(p).astype(np.float32)
    signs = rademacher_bits(1, 0, 0, p)
    rotated = rng.standard_normal(p).astype(np.float32)
    big_m = 2.5 * float(np.linalg.norm(rotated)) / np.sqrt(p)
    lanes = rng.integers(0, 4 * g + 1, p).astype(np.uint8)
    divided = (np.arange(256) / 4).astype(np.float32).tobytes()        # Y/k with k = 4

    def rotate(K, o):
        K.rht_rotate(pieces, p, signs, carry, o["r"])

    def quantize(K, o):
        K.quantize_ef(rotated, big_m, g, tab, (12345, 0), o["idx"], 4, o["resid"])

    def decode(K, o):
        K.rht_decode(lanes, 3, 2.0 * big_m / g, big_m, p, signs, divided, o["d"], o["work"])

    return [("rotate (pieces + carry)", rotate, lambda: {"r": np.zeros(p, np.float32)}),
            ("quantize_ef (packed + residual)", quantize,
             lambda: {"idx": np.zeros(p // 2, np.uint8), "resid": np.zeros(p, np.float32)}),
            ("decode (8-bit lanes / k)", decode,
             lambda: {"d": np.zeros(len(x), np.float32), "work": np.zeros(p, np.float32)})]


def compare(base, dims, calls: int) -> list[dict]:
    rows = []
    for log2 in dims:
        p = 1 << log2
        for name, call, buffers in cases(p):
            sets = (buffers(), buffers())                     # two sets of output buffers
            times = ([], [])
            for c in range(calls):
                for k in ((0, 1) if c % 2 else (1, 0)):         # each build first in half the pairs
                    t = time.perf_counter()
                    call((base, _kernels)[k], sets[(c + k) % 2])   # and into either set of buffers
                    times[k].append(time.perf_counter() - t)
                for key in sets[0]:
                    if not key.endswith("work") and sets[0][key].tobytes() != sets[1][key].tobytes():
                        raise SystemExit(f"{name} at 2^{log2}: the builds' outputs differ ({key})")
            b, t = np.array(times[0]), np.array(times[1])
            rows.append({"kernel": name, "log2": log2, "base_min_us": 1e6 * b.min(), "base_median_us": 1e6 * np.median(b),
                         "this_min_us": 1e6 * t.min(), "this_median_us": 1e6 * np.median(t),
                         "ratio": float(np.median(b / t))})
            r = rows[-1]
            print(f"2^{log2:<3d} {name:32s} base {r['base_min_us']:9.1f} / {r['base_median_us']:9.1f} us   "
                  f"this {r['this_min_us']:9.1f} / {r['this_median_us']:9.1f} us   base/this {r['ratio']:.2f}x",
                  flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the other build's compression/_kernels*.so")
    ap.add_argument("--dims", type=int, nargs="+", default=[16, 20], help="log2 of the block sizes (7..24)")
    ap.add_argument("--calls", type=int, default=200, help="calls per build, kernel and size")
    ap.add_argument("--json", metavar="OUT", default=None, help="also write the rows as JSON to OUT")
    args = ap.parse_args(argv)
    if not Path(args.base).is_file():
        ap.error(f"--base {args.base}: no such file (build the other checkout first: see the docstring)")
    if any(not 7 <= d <= 24 for d in args.dims) or args.calls < 1:
        ap.error("--dims take 7..24 and --calls a positive count")
    print("fastest / median call; base/this is the median of the pairwise ratios (> 1: this build is faster)")
    rows = compare(load_build(args.base), args.dims, args.calls)
    if args.json:
        Path(args.json).write_text(json.dumps({"base": args.base, "calls": args.calls, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
