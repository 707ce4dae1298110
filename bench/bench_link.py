"""THC rounds over a rate-limited link, step by step (root: network namespaces and tc).

A PS (`thc ps`) in one namespace and N worker processes in another, joined by a veth pair
with a token bucket on both ends (deploy/netns.two_hosts, as `thc experiment bandwidth`).
The workers run bench_floor.py's rounds — the gradient made first, untimed; a barrier;
the allreduce timed — so a round is the data path and the codec without a model's compute
in between, and `--timeline` shows where the median round went.

    .venv/bin/python bench/bench_link.py [--rate 1000] [--dim-log2 21] [--workers 2] [--rounds 16] [--timeline]

Inside the worker namespace this script runs itself again with `--inside HOST` (the workers).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # `bench` is not installed: run from a checkout
import numpy as np  # noqa: E402

from bench import bench_floor  # noqa: E402
from thc_ps.deploy.procs import each_report  # noqa: E402
from thc_ps.proto.job import JobConfig  # noqa: E402

PORT = 9000


def workers_inside(host: str, args) -> None:
    """The worker processes, run inside the worker namespace."""
    job = JobConfig(num_workers=args.workers)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=bench_floor.worker_rounds, daemon=True,
                         args=((host, PORT, PORT + 1), r, job.to_msg(), 1 << args.dim_log2, args.rounds, q, 0,
                               args.timeline))
             for r in range(args.workers)]
    for p in procs:
        p.start()
    reports = sorted(each_report(q, procs, 600), key=lambda rep: rep[0])    # (rank, out, spans, marks, threads)
    for p in procs:
        p.join(timeout=30)
    per = np.array([out for _rank, out, *_ in reports])              # workers × rounds × 6
    wall = 1e3 * per[:, :, 0].max(axis=0)
    print(f"rounds ms {np.round(wall).astype(int).tolist()}; mean {wall.mean():.1f}, median "
          f"{np.median(wall):.1f}; retransmissions {int(per[:, -1, 4].sum())}; up {per[0, :, 2].mean() / 1e6:.2f} "
          f"MB, down {per[0, :, 3].mean() / 1e6:.2f} MB per worker and round", flush=True)
    if args.timeline:
        bench_floor.print_timeline({rank: marks for rank, _o, _s, marks, _t in reports},
                                    {rank: spans for rank, _o, spans, _m, _t in reports})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=1000.0, help="link rate in Mbit/s (0: no limit)")
    ap.add_argument("--dim-log2", type=int, default=21)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--timeline", action="store_true", help="print the median round's steps per worker")
    ap.add_argument("--inside", metavar="HOST", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inside:
        workers_inside(args.inside, args)
        return
    from thc_ps.deploy import netns
    from thc_ps.deploy.experiments import ps_in_namespace
    from thc_ps.deploy.procs import stop_gracefully
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    print(f"d = 2^{args.dim_log2}, {args.workers} workers, link {args.rate:g} Mbit/s", flush=True)
    with netns.two_hosts(rate_mbit=args.rate or None) as net:
        ps = ps_in_namespace(net, JobConfig(num_workers=args.workers), PORT, env)
        try:
            inner = [sys.executable, __file__, "--inside", net.ps_ip, "--dim-log2", str(args.dim_log2),
                     "--workers", str(args.workers), "--rounds", str(args.rounds)] + \
                (["--timeline"] if args.timeline else [])
            subprocess.run(net.prefix(net.worker_ns) + inner, env=env, cwd=ROOT, timeout=900, check=True)
        finally:
            stop_gracefully(ps)


if __name__ == "__main__":
    main()
