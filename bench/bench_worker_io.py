"""Worker-side transport cost: one worker against a PS (C engine) in this process, THC rounds
of d coordinates, time spent inside the data-plane phases vs the whole allreduce.  Workers
batching datagrams (sendmmsg/recvmmsg) and one system call per datagram, same run.

    .venv/bin/python bench/bench_worker_io.py [--dim-log2 20] [--rounds 20]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from proto.job import JobConfig
from ps_server.server import PSServer
from worker.client import Worker
from worker.transport import Transport


def measure(batched: bool, dim: int, rounds: int) -> tuple[float, float, float]:
    """(ms per allreduce, ms per round in run_phase, packets per second through run_phase)."""
    server = PSServer(JobConfig(num_workers=1), ("127.0.0.1", 0), control_port=0).start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port, batched=batched)
    try:
        in_phase = [0.0]
        run_phase = t.run_phase

        def timed(kind, chunks):
            s = time.perf_counter()
            try:
                return run_phase(kind, chunks)
            finally:
                in_phase[0] += time.perf_counter() - s

        t.run_phase = timed
        w = Worker(t)
        x = np.random.default_rng(0).standard_normal(dim).astype(np.float32)
        w.allreduce(x)
        in_phase[0] = 0.0
        sent0 = t.stats.counters["packets_sent"]
        start = time.perf_counter()
        for _ in range(rounds):
            w.allreduce(x)
        total = time.perf_counter() - start
        pkts = t.stats.counters["packets_sent"] - sent0
        return total / rounds * 1e3, in_phase[0] / rounds * 1e3, 2 * pkts / in_phase[0]
    finally:
        t.close()
        server.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim-log2", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    print(f"{'worker I/O':>14}{'allreduce ms':>14}{'in phases ms':>14}{'pkts/s (both ways)':>20}")
    res = {}
    for batched in (True, False, True, False):      # twice, interleaved: the machine is noisy
        res.setdefault(batched, []).append(measure(batched, 1 << args.dim_log2, args.rounds))
    for batched, runs in res.items():
        best = min(runs, key=lambda r: r[1])
        print(f"{'sendmmsg' if batched else 'per-datagram':>14}{best[0]:14.1f}{best[1]:14.1f}{best[2]:20.0f}")
    print(f"phase time ratio per-datagram / sendmmsg: "
          f"{min(r[1] for r in res[False]) / min(r[1] for r in res[True]):.2f}")


if __name__ == "__main__":
    main()
