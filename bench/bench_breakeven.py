"""The link rate below which a THC-PS round beats DDP's plain all-reduce, measured.

For each d, in one run: N processes time a gloo all-reduce of d float32 (what DDP runs,
a ring: each rank sends and receives 2(N−1)/N · 4d bytes), and a PS + N worker processes
time a THC-PS round of d coordinates (`bench/bench_floor.py`'s rounds: 4-bit indices up,
the job's lanes down — 7 bits for 4 ranks —, measured bytes).  Both are timed alike: the ranks meet at a barrier, the
collective is timed, a round's time is its slowest rank's; the median of R rounds is kept.

On a link of rate B (bits/s) each rank's round costs its compute-and-protocol time t plus
its bytes on the link, bytes·8/B (a full-duplex link: the larger direction counts; the
PS's own link is assumed not to be the bottleneck, as with a switch or a PS on a faster
link).  THC-PS wins while t_THC + 8·b_THC/B < t_gloo + 8·b_ring/B, i.e. below

    B* = 8 · (b_ring − b_THC) / (t_THC − t_gloo)

(if t_THC ≤ t_gloo, THC-PS wins at every rate).  On loopback bytes are almost free, so t is
what this machine's CPU and protocol cost; docs/bench.md, "Break-even link rate", records
a run.

    .venv/bin/python bench/bench_breakeven.py [--workers 4] [--dims 20 22 24] [--rounds 5] [--json FILE]
        [--background N] [--background-memory M]     # a busy host
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_floor import run_rounds  # noqa: E402
from bench.common import add_background_args, background_from_args  # noqa: E402
from thc_ps.deploy.launch import gradient  # noqa: E402
from thc_ps.deploy.procs import each_report, free_tcp_port, single_threaded_children  # noqa: E402
from thc_ps.proto.job import DEFAULT_BLOCK_LOG2  # noqa: E402


def ring_bytes(dim: int, workers: int) -> float:
    """Bytes a rank sends (and receives) in a ring all-reduce of d float32."""
    return 2 * (workers - 1) / workers * 4 * dim


def _gloo_rank(rank: int, workers: int, port: int, dim: int, rounds: int, q) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=workers)
    try:
        times = []
        for r in range(rounds + 1):                    # round 0 warms up
            x = torch.from_numpy(gradient(0, r, rank, dim))
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if r:
                times.append(time.perf_counter() - t0)
        q.put((rank, times))
    finally:
        dist.destroy_process_group()


def gloo_round_ms(dim: int, workers: int, rounds: int) -> float:
    """Median over rounds of the slowest rank's gloo all-reduce time, ms."""
    port = free_tcp_port()
    single_threaded_children()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, workers, port, dim, rounds, q), daemon=True)
             for r in range(workers)]
    for p in procs:
        p.start()
    try:
        per = dict(each_report(q, procs, 600, "gloo rank"))
    finally:
        for p in procs:
            p.join(timeout=30)
    return 1e3 * float(np.median(np.max([per[r] for r in range(workers)], axis=0)))


def break_even_bps(b_ring: float, b_thc: float, t_gloo_s: float, t_thc_s: float) -> float:
    """B* in bits/s (inf: THC-PS is faster at every rate; 0: at none)."""
    if b_thc >= b_ring:
        return 0.0 if t_thc_s >= t_gloo_s else float("inf")
    if t_thc_s <= t_gloo_s:
        return float("inf")
    return 8 * (b_ring - b_thc) / (t_thc_s - t_gloo_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--workers", type=int, default=4, help="ranks N")
    ap.add_argument("--dims", type=int, nargs="+", default=[20, 22, 24], help="log2 of d")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per measurement (after one warm-up)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON here")
    ap.add_argument("--block-log2", type=int, default=DEFAULT_BLOCK_LOG2,
                    help="log2 of the THC job's RHT block (the authors' cap is 23)")
    add_background_args(ap)
    args = ap.parse_args(argv)
    with background_from_args(args):
        rows = _measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _measure(args) -> list:
    if args.background or args.background_memory or args.background_compile:
        print(f"background: {args.background} busy loop(s) and {args.background_memory} memory-bound "
              f"process(es) and {args.background_compile} compiler loop(s) at nice 19, the whole run", flush=True)
    print(f"{args.workers} ranks, {os.cpu_count()} cores, {args.rounds} rounds each (median of the "
          f"slowest rank's time)", flush=True)
    print(f"{'d':>6}{'gloo ms':>9}{'THC-PS ms':>11}{'ring MB':>9}{'THC up MB':>11}{'THC down MB':>13}"
          f"{'B* Gbit/s':>11}", flush=True)
    rows = []
    for k in args.dims:
        dim = 1 << k
        t_gloo = gloo_round_ms(dim, args.workers, args.rounds)
        thc = run_rounds("thc", dim, args.workers, args.rounds, quiet=True, block_log2=args.block_log2)
        b_ring = ring_bytes(dim, args.workers)
        b_thc = max(thc["up_mb"], thc["down_mb"]) * 1e6
        bstar = break_even_bps(b_ring, b_thc, t_gloo / 1e3, thc["median_ms"] / 1e3)
        rows.append({"dim_log2": k, "gloo_ms": t_gloo, "thc_ms": thc["median_ms"], "ring_bytes": b_ring,
                     "thc_up_bytes": thc["up_mb"] * 1e6, "thc_down_bytes": thc["down_mb"] * 1e6,
                     "break_even_gbps": bstar / 1e9})
        print(f"{'2^' + str(k):>6}{t_gloo:9.1f}{thc['median_ms']:11.1f}{b_ring / 1e6:9.2f}{thc['up_mb']:11.2f}"
              f"{thc['down_mb']:13.2f}{bstar / 1e9:11.2f}", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
