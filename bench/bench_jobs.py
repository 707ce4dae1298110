"""Concurrent jobs on one PS: the aggregate packet rate of 1, 2 and 4 THC jobs at once against
one job alone, on the same PS process, in one run.

Each job has `--workers` worker processes doing real THC DATA phases on loopback with
pre-encoded payloads (random packed 4-bit indices: no codec work, the PS and the transport
are what is measured), under its own name, so the PS runs them side by side in regions of
its slot space.  The rate counts datagrams both ways (DATA up, RESULT fan-out down) of all
jobs per second of wall time, from the first job's start to the last job's end.

    .venv/bin/python bench/bench_jobs.py [--workers 2] [--dim-log2 20] [--phases 20]
                                         [--jobs 1 2 4] [--repeat 1]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def ps_proc(ports_q, stop_q):
    from thc_ps.ps_server.server import PSServer
    server = PSServer(None, ("127.0.0.1", 0), control_port=0).start()
    ports_q.put((server.data_addr[1], server.control_port))
    stop_q.get()
    stats = server.stats()
    server.stop()
    ports_q.put(stats)


def worker_proc(name, rank, workers, ports, dim, phases, out_q, everyone):
    from thc_ps.proto import headers as H
    from thc_ps.proto.job import JobConfig
    from thc_ps.proto.packing import pack_indices
    from thc_ps.worker.transport import PackedChunks, Transport
    job = JobConfig(num_workers=workers)
    t = Transport("127.0.0.1", ports[0], rank, control_port=ports[1], job_name=name, propose=job,
                  expect={"num_workers": workers})
    z = np.random.default_rng(rank).integers(0, 16, dim).astype(np.uint8)
    chunks = PackedChunks(pack_indices(z, 4), dim, 4, t.job.elems_per_packet)
    t.run_phase(H.DATA, chunks)                       # warm-up
    t.barrier("go")
    everyone.wait(300)                                # every job's workers start together
    c0 = dict(t.stats.counters)
    start = time.time()
    for _ in range(phases):
        t.run_phase(H.DATA, chunks)
    end = time.time()
    c = {k: t.stats.counters[k] - c0[k] for k in ("packets_sent", "packets_received", "retransmissions")}
    t.barrier("done")
    t.close()
    out_q.put((name, rank, start, end, c))


def run(ctx, ports, jobs: int, workers: int, dim: int, phases: int) -> dict:
    """`jobs` jobs of `workers` workers each at once; their aggregate rate."""
    from thc_ps.deploy.procs import each_report
    out_q = ctx.Queue()
    names = [f"bench-{jobs}-{j}-{time.monotonic_ns()}" for j in range(jobs)]
    everyone = ctx.Barrier(jobs * workers)
    procs = [ctx.Process(target=worker_proc, args=(names[j], r, workers, ports, dim, phases, out_q, everyone))
             for j in range(jobs) for r in range(workers)]
    for p in procs:
        p.start()
    res = list(each_report(out_q, procs, 900))
    for p in procs:
        p.join(30)
    start, end = min(r[2] for r in res), max(r[3] for r in res)
    pkts = sum(r[4]["packets_sent"] + r[4]["packets_received"] for r in res)
    per_job = {}
    for name, _, s, e, c in res:
        d = per_job.setdefault(name, [s, e, 0])
        d[0], d[1] = min(d[0], s), max(d[1], e)
        d[2] += c["packets_sent"] + c["packets_received"]
    return {"jobs": jobs, "seconds": end - start, "datagrams": pkts, "rate": pkts / (end - start),
            "per_job_rate": [n / (e - s) for s, e, n in per_job.values()],
            "retransmissions": sum(r[4]["retransmissions"] for r in res)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="workers per job")
    ap.add_argument("--dim-log2", type=int, default=20)
    ap.add_argument("--phases", type=int, default=20, help="DATA phases per worker")
    ap.add_argument("--jobs", type=int, nargs="+", default=[1, 2, 4], help="concurrent job counts")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the whole list; medians reported")
    args = ap.parse_args()
    from thc_ps.deploy.procs import single_threaded_children
    single_threaded_children()
    ctx = mp.get_context("spawn")
    ports_q, stop_q = ctx.Queue(), ctx.Queue()
    ps = ctx.Process(target=ps_proc, args=(ports_q, stop_q))
    ps.start()
    ports = ports_q.get(timeout=60)
    print(f"one PS, {args.workers} workers per job, d = 2^{args.dim_log2}, {args.phases} DATA phases per "
          f"worker, {os.cpu_count()} cores", flush=True)
    rates: dict = {}
    try:
        for _ in range(args.repeat):
            for jobs in args.jobs:
                doc = run(ctx, ports, jobs, args.workers, 1 << args.dim_log2, args.phases)
                rates.setdefault(jobs, []).append(doc["rate"])
                print(f"{jobs} job{'s' if jobs > 1 else ''} at once: {doc['datagrams']} datagrams in "
                      f"{doc['seconds']:.2f} s = {doc['rate'] / 1e6:.3f} Mpps aggregate; per job "
                      f"{', '.join(f'{r / 1e6:.3f}' for r in doc['per_job_rate'])} Mpps; retransmissions "
                      f"{doc['retransmissions']}", flush=True)
    finally:
        stop_q.put(1)
        stats = ports_q.get(timeout=60)
        ps.join(30)
    base = float(np.median(rates[args.jobs[0]]))
    for jobs in args.jobs:
        r = float(np.median(rates[jobs]))
        print(f"{jobs} job(s): {r / 1e6:.3f} Mpps aggregate = {r / base:.2f}x {args.jobs[0]} job(s) alone")
    print(f"PS: jobs started {stats['jobs_started']}, ended {stats['jobs_ended']}, drops "
          f"{ {k: v for k, v in stats['drops'].items() if v} }")


if __name__ == "__main__":
    main()
