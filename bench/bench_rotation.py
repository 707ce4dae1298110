"""A worker's codec CPU per step: a fresh sign diagonal every round (rotation "round", THC's
Alg. 3) against one per job (rotation "job", error feedback kept rotated), side by side.

One step is bench_floor's `_codec_round`, what Worker._thc_round runs besides the transport,
through thc.WorkerRound with error feedback: x (∇ + e, or R∇ + e_R), the block norms, the
packed encode, the residual (round: RHT⁻¹ of the own indices and x − it; job: made by the
encode), the 8-bit lanes decode into the gradient's vector, and the feedback.  The two rotations alternate step by
step in one process on one codec thread, so the host's drift hits both alike; the figures
are medians of the thread's CPU time and of the wall time per step.

    .venv/bin/python bench/bench_rotation.py [--dim 2067010] [--steps 30] [--json OUT]

The default d is the peers experiment's mlp-wide (2,067,010 parameters, two RHT blocks).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `bench` is not installed: run from a checkout
os.environ.setdefault("THC_CODEC_THREADS", "1")                 # one codec thread, as a rank on a busy host
from bench.bench_floor import _codec_round  # noqa: E402
from compression import thc  # noqa: E402
from compression.codec import ErrorFeedback  # noqa: E402
from proto.job import JobConfig  # noqa: E402

ROTATIONS = ("round", "job")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=2_067_010, help="coordinates per step")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per rotation")
    ap.add_argument("--block-log2", type=int, default=thc.DEFAULT_BLOCK_LOG2)
    ap.add_argument("--json", metavar="OUT", default=None, help="also write the results as JSON to OUT")
    args = ap.parse_args(argv)
    if args.dim < 1 or args.steps < 1:
        ap.error("--dim and --steps must be positive")
    rng = np.random.default_rng(0)
    grads = [(rng.standard_normal(args.dim) * rng.lognormal(0, 1, args.dim)).astype(np.float32) for _ in range(2)]
    layout = thc.make_layout(args.dim, args.block_log2)
    lanes = rng.integers(0, 121, layout.padded_dim).astype(np.uint8)
    state = {}
    for rot in ROTATIONS:
        job = JobConfig(num_workers=4, block_log2=args.block_log2, rotation=rot)
        state[rot] = (thc.ThcConfig.of_job(job), job, ErrorFeedback(), np.empty(args.dim, np.float32),
                      np.random.default_rng(1))
    times = {rot: ([], []) for rot in ROTATIONS}
    for r in range(args.steps + 2):                 # two untimed steps: buffers and caches warm
        for rot in ROTATIONS:
            cfg, job, memory, grad, rrng = state[rot]
            np.copyto(grad, grads[r % 2])
            w0 = time.perf_counter()
            cpu = _codec_round(cfg, job, grad, memory, lanes, rrng, r)
            if r >= 2:
                times[rot][0].append(1e3 * cpu)
                times[rot][1].append(1e3 * (time.perf_counter() - w0))
    res = {"dim": args.dim, "block_log2": args.block_log2, "steps": args.steps,
           "cpu_ms": {rot: float(np.median(times[rot][0])) for rot in ROTATIONS},
           "wall_ms": {rot: float(np.median(times[rot][1])) for rot in ROTATIONS}}
    res["cpu_ratio"] = res["cpu_ms"]["round"] / res["cpu_ms"]["job"]
    print(f"d = {args.dim:,}, blocks of 2^{args.block_log2}, {args.steps} steps each, one codec thread")
    print(f"{'rotation':<10}{'CPU ms/step':>14}{'wall ms/step':>15}")
    for rot in ROTATIONS:
        print(f"{rot:<10}{res['cpu_ms'][rot]:>14.2f}{res['wall_ms'][rot]:>15.2f}")
    print(f"round / job CPU: {res['cpu_ratio']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
