"""The end-to-end round at d = 2^24 against its CPU floor on this machine.

Floor: every worker's own codec work in a round — block norms, the uniforms, the fused
encode, the fused lanes decode and the error-feedback decode (what Worker._thc_round does
besides the transport) — measured as CPU time in this process (best of 3), times the
number of workers, divided by the cores they share.  Then, in the same run, the PS and the
workers on loopback (deploy.launch.run_launch: R rounds, mean allreduce time) for THC and
for float32 (codec none) through the same path; the data path's offload (GSO/GRO) and
phase engine as the environment says (THC_UDP_OFFLOAD, THC_PHASE_ENGINE).

    .venv/bin/python bench/bench_floor.py [--dim-log2 24] [--workers 4] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from compression import thc
from deploy.launch import run_launch
from proto.job import JobConfig


def codec_cpu_ms(dim: int) -> float:
    job = JobConfig(num_workers=4)
    cfg = thc.ThcConfig(bits=job.bits, granularity=job.granularity, p=job.p, lane_bits=job.lane_bits,
                        block_log2=job.block_log2, seed=job.seed)
    layout = thc.make_layout(dim, cfg.block_log2)
    x = np.random.default_rng(0).standard_normal(dim).astype(np.float32)
    rng = np.random.default_rng(1)
    best = float("inf")
    for r in range(3):
        t = time.process_time()
        norms = thc.block_norms(x, layout).astype(np.float64)
        packed = thc.encode_packed(x, norms, cfg, layout, r, rng.random(layout.padded_dim, dtype=np.float32))
        lanes = np.full(layout.padded_dim, 60, np.uint8)
        thc.decode_lanes(lanes, 4, norms, cfg, layout, r)
        own = thc.decode_own(packed, norms, cfg, layout, r, packed=True)
        np.subtract(x, own, out=own)
        best = min(best, time.process_time() - t)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim-log2", type=int, default=24)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dim, cores = 1 << args.dim_log2, os.cpu_count()
    cpu = codec_cpu_ms(dim)
    floor = cpu * args.workers / cores
    print(f"d = 2^{args.dim_log2}, {args.workers} workers, {cores} cores; offload "
          f"{os.environ.get('THC_UDP_OFFLOAD', '1')}, phase engine {os.environ.get('THC_PHASE_ENGINE', 'c')}")
    print(f"one worker's codec CPU per round: {cpu:.1f} ms -> floor {args.workers} x {cpu:.1f} / {cores} "
          f"= {floor:.1f} ms")
    print(f"{'codec':>6}{'round ms':>10}{'x floor':>9}{'up MB':>8}{'down MB':>9}")
    for codec in ("thc", "none"):
        doc = run_launch(workers=args.workers, rounds=args.rounds, dim=dim, codec=codec, check=False,
                         timeout_ms=2000)
        ms = doc["mean_round_ms"]
        print(f"{codec:>6}{ms:10.1f}{ms / floor:9.2f}{doc['bytes_up_per_round'] / 1e6:8.2f}"
              f"{doc['bytes_down_per_round'] / 1e6:9.2f}", flush=True)


if __name__ == "__main__":
    main()
