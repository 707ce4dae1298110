"""Where a worker's CPU goes in a real 2^24 round: PS + N worker processes exactly as in
bench_floor.py (gradients made before a per-round barrier, error feedback on), rank 0's
allreduce under cProfile with CPU time as the clock; prints its top functions by own
time, in ms per round.  Complements profile_round.py (one worker in one process), since
here the worker shares the cores with the other ranks and the PS as in a real round.

    .venv/bin/python bench/profile_cluster.py [--dim-log2 24] [--workers 4] [--rounds 3] [--top 15]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `bench` is not installed: run from a checkout
from bench.bench_floor import run_rounds  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim-log2", type=int, default=24)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    d = run_rounds("thc", 1 << args.dim_log2, args.workers, args.rounds, quiet=True, profile_top=args.top)
    print(f"round (slowest worker, mean of {args.rounds}): {d['round_ms']:.1f} ms")


if __name__ == "__main__":
    main()
