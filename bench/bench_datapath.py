"""Data-path packet rate: a PS (C engine) and W worker processes doing real THC DATA phases
on loopback with pre-encoded payloads (random packed 4-bit indices, no codec work), against
bench_transport.py's UDP GSO/GRO blaster in the same run (one sender process, one receiver
process, THC-sized datagrams).  The data path's rate counts datagrams both ways (DATA up,
RESULT fan-out down) per second of wall time; the blaster's counts one way.

    .venv/bin/python bench/bench_datapath.py [--workers 2] [--dim-log2 22] [--phases 10] [--window 512]
                                             [--repeat 1]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import numpy as np


def ps_proc(workers, ports_q, stop_q):
    from thc_ps.proto.job import JobConfig
    from thc_ps.ps_server.server import PSServer
    server = PSServer(JobConfig(num_workers=workers), ("127.0.0.1", 0), control_port=0).start()
    ports_q.put((server.data_addr[1], server.control_port))
    engine = None
    while engine is None:                   # the job's engine (gone from the server when it ends)
        engine = server.engine
        time.sleep(0.01)
    stop_q.get()
    ps_stats = server.stats()
    io = engine.io_stats() if hasattr(engine, "io_stats") else {}
    if hasattr(server.mux, "io_stats"):
        io.update(server.mux.io_stats())    # the receive side is the job table's (one socket, every job)
    server.stop()
    ports_q.put((ps_stats, io))


def worker_proc(rank, ports, dim, phases, window, out_q):
    from thc_ps.proto import headers as H
    from thc_ps.proto.packing import pack_indices
    from thc_ps.worker.transport import PackedChunks, Transport
    t = Transport("127.0.0.1", ports[0], rank, control_port=ports[1], window=window)
    z = np.random.default_rng(rank).integers(0, 16, dim).astype(np.uint8)
    chunks = PackedChunks(pack_indices(z, 4), dim, 4, t.job.elems_per_packet)
    t.run_phase(H.DATA, chunks)                       # warm-up
    t.barrier("go")
    c0 = dict(t.stats.counters)
    start = time.perf_counter()
    for _ in range(phases):
        t.run_phase(H.DATA, chunks)
    secs = time.perf_counter() - start
    c = {k: t.stats.counters[k] - c0[k] for k in ("packets_sent", "packets_received", "retransmissions")}
    t.barrier("done")
    t.close()
    out_q.put((rank, secs, c, len(chunks), dict(t.io)))


def datapath(workers, dim, phases, window):
    from thc_ps.deploy.procs import each_report, single_threaded_children
    single_threaded_children()                # no spinning BLAS threads beside the data path
    ctx = mp.get_context("spawn")
    ports_q, stop_q, out_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    ps = ctx.Process(target=ps_proc, args=(workers, ports_q, stop_q))
    ps.start()
    ports = ports_q.get(timeout=60)
    procs = [ctx.Process(target=worker_proc, args=(r, ports, dim, phases, window, out_q)) for r in range(workers)]
    for p in procs:
        p.start()
    res = list(each_report(out_q, procs, 600))
    for p in procs:
        p.join(30)
    stop_q.put(1)
    ps_stats, io = ports_q.get(timeout=60)
    ps.join(30)
    secs = max(r[1] for r in res)
    pkts = sum(r[2]["packets_sent"] + r[2]["packets_received"] for r in res)
    return secs, pkts, res, ps_stats, io


def main():
    from thc_ps.worker.transport import DEFAULT_WINDOW
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dim-log2", type=int, default=22)
    ap.add_argument("--phases", type=int, default=10)
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="chunks in flight per worker")
    ap.add_argument("--repeat", type=int, default=1,
                    help="alternate data path and blaster this many times; the median ratio is the result")
    ap.add_argument("--blast", type=int, default=2_000_000, help="datagrams the blaster sends")
    args = ap.parse_args()
    from bench.bench_transport import run as blast
    from thc_ps.proto import headers as H
    from thc_ps.proto.job import JobConfig
    job = JobConfig(num_workers=args.workers)
    size = H.HEADER_SIZE + job.up_payload_len(job.elems_per_packet)
    dim = 1 << args.dim_log2
    print(f"offload {'on' if os.environ.get('THC_UDP_OFFLOAD', '1') != '0' else 'OFF'}, "
          f"{args.workers} workers, d = 2^{args.dim_log2}, {args.phases} DATA phases each, "
          f"window {args.window}, {os.cpu_count()} cores")
    ratios = []
    for _ in range(args.repeat):
        secs, pkts, res, ps_stats, io = datapath(args.workers, dim, args.phases, args.window)
        rate = pkts / secs
        print(f"data path: {pkts} datagrams (up + down, {res[0][3]} chunks per phase) in {secs:.2f} s "
              f"= {rate / 1e6:.3f} Mpps; retransmissions {sum(r[2]['retransmissions'] for r in res)}")
        print(f"  worker io: {[r[4] for r in res]}")
        print(f"  PS io: {io}")
        t, got, _ = blast("gso", args.blast, size)
        brate = args.blast / t
        print(f"GSO/GRO blaster: {args.blast} datagrams of {size} B in {t:.2f} s = {brate / 1e6:.3f} Mpps "
              f"sent, {got / args.blast:.1%} received")
        ratios.append(rate / brate)
        print(f"data path / blaster: {ratios[-1]:.2f}", flush=True)
    if args.repeat > 1:
        print(f"median of {args.repeat}: data path / blaster = {float(np.median(ratios)):.2f}")


if __name__ == "__main__":
    main()
