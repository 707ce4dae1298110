"""Worker-side transport cost: one worker against a PS (C engine) in this process, THC rounds
of d coordinates, time spent inside the data-plane phases vs the whole allreduce.  Four worker
data paths in the same run: the phase in C with UDP GSO/GRO (default), the phase in C
without offload (THC_UDP_OFFLOAD=0, PS included), the Python phase loop with
sendmmsg/recvmmsg, and one system call per datagram.

    .venv/bin/python bench/bench_worker_io.py [--dim-log2 20] [--rounds 20]
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.server import PSServer
from thc_ps.worker.client import Worker
from thc_ps.worker.transport import Transport


MODES = {  # name: (batched, phase engine, UDP offload)
    "C phase+GSO/GRO": (True, "c", "1"),
    "C phase": (True, "c", "0"),
    "Python sendmmsg": (True, "python", "0"),
    "per-datagram": (False, "python", "0"),
}


def measure(mode: str, dim: int, rounds: int) -> tuple[float, float, float]:
    """(ms per allreduce, ms per round in run_phase, packets per second through run_phase)."""
    batched, engine, offload = MODES[mode]
    os.environ["THC_UDP_OFFLOAD"] = offload
    server = PSServer(JobConfig(num_workers=1), ("127.0.0.1", 0), control_port=0).start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port, batched=batched,
                  phase_engine=engine)
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
    print(f"{'worker I/O':>16}{'allreduce ms':>14}{'in phases ms':>14}{'Mpps (both ways)':>18}{'x C+GSO':>9}")
    res = {}
    for _ in range(2):                               # twice, interleaved: the machine is noisy
        for mode in MODES:
            res.setdefault(mode, []).append(measure(mode, 1 << args.dim_log2, args.rounds))
    best = {mode: min(runs, key=lambda r: r[1]) for mode, runs in res.items()}
    ref = best["C phase+GSO/GRO"][1]
    for mode, b in best.items():
        print(f"{mode:>16}{b[0]:14.1f}{b[1]:14.1f}{b[2] / 1e6:18.3f}{b[1] / ref:9.2f}")


if __name__ == "__main__":
    main()
