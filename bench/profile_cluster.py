"""Where a worker's CPU goes in a real 2^24 round: PS + N worker processes as in
bench_floor.py (gradients made before a per-round barrier, error feedback on), rank 0's
allreduce under cProfile with CPU time as the clock; prints its top functions by own
time, in ms per round.  Complements profile_round.py (one worker in one process), since
here the worker shares the cores with the other ranks and the PS as in a real round.

    .venv/bin/python bench/profile_cluster.py [--dim-log2 24] [--workers 4] [--rounds 3] [--top 15]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `bench` is not installed: run from a checkout
import bench.bench_floor as floor  # noqa: E402


def _profiled_worker(addr, rank, job_msg, dim, rounds, q, top=15) -> None:
    from worker.client import Worker
    from worker.transport import Transport
    host, data_port, control_port = addr
    t = Transport(host, data_port, rank, control_port=control_port, expect=job_msg, timeout_ms=2000)
    w = Worker(t, error_feedback=True, seed=0, per_round_rng=True)
    prof = cProfile.Profile(timer=time.process_time)
    out = []
    try:
        for r in range(rounds + 1):                     # round 0 warms up
            g = floor.gradient(0, r, rank, dim)
            t.barrier(f"r{r}")
            t0 = time.perf_counter()
            if r and rank == 0:
                prof.enable()
            w.allreduce(g, key="grad", round_no=r)
            prof.disable()
            if r:
                out.append((time.perf_counter() - t0, 0.0, 0, 0, 0))
        t.barrier("end")
    finally:
        t.close()
    if rank == 0:
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        total = sum(v[2] for v in st.stats.values())
        print(f"rank 0: {1e3 * total / rounds:.1f} ms CPU per round under the profiler; top functions "
              f"by own CPU time (ms per round):")
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
        for (file, line, name), (_cc, nc, tt, ct, _callers) in rows:
            where = f"{Path(file).name}:{line}" if line else "built-in"
            print(f"  {1e3 * tt / rounds:8.1f}  {1e3 * ct / rounds:8.1f} cum  {nc // rounds:6d} calls  "
                  f"{name} ({where})")
    q.put((rank, out))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim-log2", type=int, default=24)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    floor._worker = _profiled_worker                    # the bench's worker, profiled
    d = floor.run_rounds("thc", 1 << args.dim_log2, args.workers, args.rounds, quiet=True)
    print(f"round (slowest worker, mean of {args.rounds}): {d['round_ms']:.1f} ms")


if __name__ == "__main__":
    main()
