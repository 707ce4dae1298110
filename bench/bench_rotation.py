"""A worker's codec CPU per step: a fresh sign diagonal every round (rotation "round", THC's
Alg. 3) against one per job (rotation "job", error feedback kept rotated), side by side, from
the model's gradient tensors to the average decoded into the bucket, and the memory floor of
the job rotation's step.

One step is bench_floor's `_codec_round` (what Worker._thc_round runs besides the transport,
through thc.WorkerRound with error feedback: x (∇ + e, or R∇ + e_R), the block norms, the
packed encode, the residual, the 8-bit lanes decode into the bucket, the feedback), after
what GradientSync does first.  Three ways alternate step by step in one process on one codec
thread, so the host's drift hits them alike:

    round          the gradient tensors copied into the bucket, then a round-rotation step
    job, bucket    the same copy, then a job-rotation step from the bucket
    job, pieces    a job-rotation step that reads the tensors where they lie (thc.Pieces;
                   what GradientSync does now): no copy

The figures are medians of the thread's CPU time and of the wall time per step; "copy" is
the bucket copy's share.  The gradient is cut into tensors as the WideMLP's are (weights,
bias, weights, bias).

The floor: the job step's sweeps over its vectors, each beyond L2 (an RHT block of 2^20
floats is 4 MiB), with the bytes each moves, against a copy of a vector of the step's size
timed in the same steps (np.copyto, its bytes read plus written): floor = bytes / that
copy's bandwidth (docs/bench.md, "One rotation per job").

    .venv/bin/python bench/bench_rotation.py [--dim 2067010] [--steps 30] [--codec-threads 1|N|auto] [--json OUT]

The default d is the peers experiment's mlp-wide (2,067,010 parameters, two RHT blocks).  One
codec thread by default (CPU per step compares builds); `--codec-threads auto` leaves
THC_CODEC_THREADS unset, as a worker runs (compression/cores.py): with more than one thread
the CPU column counts the calling thread only, and the wall column is the one to compare.
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
from bench.bench_floor import _codec_round  # noqa: E402
from thc_ps.compression import thc  # noqa: E402
from thc_ps.compression.codec import ErrorFeedback  # noqa: E402
from thc_ps.proto.job import JobConfig  # noqa: E402

WAYS = ("round", "job, bucket", "job, pieces")
#: The WideMLP's tensors (784x2600 weights, 2600 biases, 2600x10 weights, 10 biases).
WIDE_MLP = (2_038_400, 2_600, 26_000, 10)


def tensor_sizes(dim: int) -> list[int]:
    """`dim` cut as the WideMLP's gradient is (its own sizes at its d)."""
    total = sum(WIDE_MLP)
    sizes = [max(1, dim * s // total) for s in WIDE_MLP[1:]]
    return [dim - sum(sizes), *sizes] if dim > sum(sizes) else [dim]


def job_sweeps(dim: int, padded: int) -> list[tuple[str, int]]:
    """The job rotation step's sweeps over memory (each over vectors beyond L2) and the bytes
    each reads plus writes, d coordinates padded to P: 4-byte floats, 1-byte lanes, 4-bit
    indices.  The transforms run in place in the 2^20-float blocks: the low chunks, a level
    over each chunk of 2^17 floats (512 KiB, L2's size: counted as in L2), then the top level
    (compression/_kernels.c), so two sweeps each."""
    d, p = dim, padded
    return [("rotate, first sweep: the gradient's tensors in, R out", 4 * d + 4 * p),
            ("rotate, last sweep: R in and out, + the carried e_R", 12 * p),
            ("block norms of R (right after each block's transform)", 4 * p),
            ("quantize: R in, indices out, R - X over R", 8 * p + p // 2),
            ("decode, first sweep: the lanes in, the average out", p + 4 * p),
            ("decode, last sweep: the average in and out (the bucket)", 8 * p)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=2_067_010, help="coordinates per step")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per way")
    ap.add_argument("--block-log2", type=int, default=thc.DEFAULT_BLOCK_LOG2)
    ap.add_argument("--codec-threads", default="1", metavar="N|auto",
                    help="THC_CODEC_THREADS for the run (auto: unset, the worker's default)")
    ap.add_argument("--json", metavar="OUT", default=None, help="also write the results as JSON to OUT")
    args = ap.parse_args(argv)
    if args.dim < 1 or args.steps < 1:
        ap.error("--dim and --steps must be positive")
    if args.codec_threads == "auto":
        os.environ.pop("THC_CODEC_THREADS", None)
    elif not args.codec_threads.isdigit() or int(args.codec_threads) < 1:
        ap.error(f"--codec-threads must be a positive integer or auto, got {args.codec_threads!r}")
    else:
        os.environ["THC_CODEC_THREADS"] = args.codec_threads
    rng = np.random.default_rng(0)
    grads = [(rng.standard_normal(args.dim) * rng.lognormal(0, 1, args.dim)).astype(np.float32) for _ in range(2)]
    sizes = tensor_sizes(args.dim)                  # each tensor its own blocks, as a worker cuts them
    layout = thc.make_layout(args.dim, args.block_log2, segments=sizes)
    lanes = rng.integers(0, 121, layout.padded_dim).astype(np.uint8)
    cuts = np.cumsum([0, *sizes])
    state = {}
    for way in WAYS:
        job = JobConfig(num_workers=4, block_log2=args.block_log2, rotation=way.split(",")[0])
        tensors = [np.empty(b - a, np.float32) for a, b in zip(cuts, cuts[1:])]
        state[way] = (thc.ThcConfig.of_job(job), job, ErrorFeedback(), tensors, np.empty(args.dim, np.float32),
                      np.random.default_rng(1))
    src, dst = np.ones(layout.padded_dim, np.float32), np.empty(layout.padded_dim, np.float32)
    times = {way: ([], [], []) for way in WAYS}
    stages = {}                                     # the job step's CPU by stage, per timed step
    copies = []
    for r in range(args.steps + 2):                 # two untimed steps: buffers and caches warm
        for way in WAYS:
            cfg, job, memory, tensors, bucket, rrng = state[way]
            for t, a in zip(tensors, cuts):         # backward's new gradients
                np.copyto(t, grads[r % 2][a:a + t.size])
            w0, c0 = time.perf_counter(), time.thread_time()
            if way == "job, pieces":
                grad = thc.Pieces(tensors)
            else:                                   # GradientSync's copy into its bucket
                grad = np.concatenate(tensors, out=bucket)
            copy = time.thread_time() - c0
            split = {}
            cpu = copy + _codec_round(cfg, job, grad, memory, lanes, rrng, r, out=bucket, stages=split,
                                      segments=sizes)
            if r >= 2 and way == "job, pieces":
                for name, t in split.items():
                    stages.setdefault(name, []).append(1e3 * t)
            if r >= 2:
                times[way][0].append(1e3 * cpu)
                times[way][1].append(1e3 * (time.perf_counter() - w0))
                times[way][2].append(1e3 * copy)
        c0 = time.thread_time()
        np.copyto(dst, src)
        if r >= 2:
            copies.append(1e3 * (time.thread_time() - c0))
    med = {way: [float(np.median(v)) for v in times[way]] for way in WAYS}
    copy_ms = float(np.median(copies))
    bandwidth = 8 * layout.padded_dim / (copy_ms / 1e3)
    sweeps = job_sweeps(args.dim, layout.padded_dim)
    floor_ms = 1e3 * sum(b for _, b in sweeps) / bandwidth
    res = {"dim": args.dim, "block_log2": args.block_log2, "steps": args.steps, "codec_threads": args.codec_threads,
           "cpu_ms": {w: med[w][0] for w in WAYS}, "wall_ms": {w: med[w][1] for w in WAYS},
           "copy_ms": {w: med[w][2] for w in WAYS},
           "vector_copy_ms": copy_ms, "copy_gb_s": bandwidth / 1e9,
           "job_sweeps": [{"sweep": n, "bytes": b} for n, b in sweeps], "job_floor_ms": floor_ms,
           "job_step_over_floor": med["job, pieces"][0] / floor_ms,
           "job_stage_cpu_ms": {name: float(np.median(v)) for name, v in stages.items()}}
    res["cpu_ratio"] = res["cpu_ms"]["round"] / res["cpu_ms"]["job, pieces"]
    print(f"d = {args.dim:,}, blocks of 2^{args.block_log2}, {args.steps} steps each, codec threads: {args.codec_threads}")
    print(f"{'way':<14}{'CPU ms/step':>13}{'of it copy':>12}{'wall ms/step':>14}")
    for w in WAYS:
        print(f"{w:<14}{med[w][0]:>13.2f}{med[w][2]:>12.2f}{med[w][1]:>14.2f}")
    print(f"round / job, pieces CPU: {res['cpu_ratio']:.2f}x")
    print("job, pieces by stage (median CPU ms): " +
          ", ".join(f"{name} {ms:.2f}" for name, ms in res["job_stage_cpu_ms"].items()))
    print(f"the job step's sweeps over memory ({len(sweeps)}):")
    for n, b in sweeps:
        print(f"  {b / 1e6:8.2f} MB  {n}")
    print(f"  {sum(b for _, b in sweeps) / 1e6:8.2f} MB in all; a copy of {layout.padded_dim:,} floats took "
          f"{copy_ms:.2f} ms ({bandwidth / 1e9:.1f} GB/s read + written): floor {floor_ms:.2f} ms, "
          f"the job step {res['job_step_over_floor']:.2f}x it")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
