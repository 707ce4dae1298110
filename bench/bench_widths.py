"""Index widths side by side: a worker's codec CPU per round and the PS's lookup-and-sum per
round, for b-bit indices at granularity g (default 4 bits at g = 30 against 5 bits at g = 31),
on the example LM's tensors (examples/char_lm.py's defaults: 867,328 coordinates, each tensor
in RHT blocks of its own, as `thc_ps.connect` cuts a bucket).

A worker's round is what Worker._thc_round runs besides the transport under the library's job
without error feedback (rotation "job", p = 1/512): the rotation and block norms of the
gradient read in place (thc.Pieces), the packed encode, and the 7-bit lanes' decode into the
bucket (4 ranks: both widths' sums fit 7 bits).  "pipelines" says whether the round can go
block by block beside the wire (WorkerRound.can_pipeline): the C kernels pack within each
block.  The PS's part is one rank's packed indices added into the slot's byte lanes
(`_fastpath.lookup_accumulate`, the engine's kernel) times the ranks.  The widths alternate
round by round in one process on one codec thread, so the host's drift hits them alike; the
figures are medians of the thread's CPU time.

    .venv/bin/python bench/bench_widths.py [--widths 4:30,5:31] [--rounds 40] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `bench` is not installed: run from a checkout
from bench.bench_tensor_error import write_rows  # noqa: E402
from thc_ps.compression import thc  # noqa: E402
from thc_ps.ps_server._fastpath import lookup_accumulate  # noqa: E402

RANKS = 4


def lm_sizes() -> list[int]:
    """The example LM's tensor sizes (its defaults, as bench_tensor_error builds it), in its
    parameters' order."""
    from thc_ps.deploy import lm_experiment as lm
    return [p.numel() for p in lm.example().CharLM(64, 128, 4, heads=4).parameters()]


def parse_widths(text: str) -> list[tuple[int, int]]:
    """"4:30,5:31" -> [(4, 30), (5, 31)], each a table THC can solve (2^b - 1 <= g <= 255)."""
    out = []
    for part in text.split(","):
        b, _, g = part.partition(":")
        if not (b.isdigit() and g.isdigit() and 1 <= int(b) <= 8 and (1 << int(b)) - 1 <= int(g) <= 255):
            raise ValueError(f"a width is b:g with b in 1..8 and 2^b - 1 <= g <= 255, got {part!r}")
        out.append((int(b), int(g)))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="4:30,5:31", help="b:g pairs to compare (default 4:30,5:31)")
    ap.add_argument("--rounds", type=int, default=40, help="timed rounds per width")
    ap.add_argument("--out", metavar="FILE", default=None, help="also write the results as JSON to FILE")
    args = ap.parse_args(argv)
    try:
        widths = parse_widths(args.widths)
    except ValueError as exc:
        ap.error(str(exc))
    if args.rounds < 1:
        ap.error(f"--rounds must be positive, got {args.rounds}")
    os.environ["THC_CODEC_THREADS"] = "1"
    sizes = lm_sizes()
    rng = np.random.default_rng(0)
    tensors = [(rng.standard_normal(n) * rng.lognormal(0, 1, n)).astype(np.float32) for n in sizes]
    bucket = np.empty(sum(sizes), np.float32)
    state = {}
    for b, g in widths:
        cfg = thc.ThcConfig(bits=b, granularity=g, p=Fraction(1, 512), rotation="job")
        layout = cfg.layout(sum(sizes), sizes)
        lanes = rng.integers(0, RANKS * g + 1, layout.padded_dim).astype(np.uint8)
        state[b, g] = (cfg, layout, lanes, np.zeros(layout.padded_dim, np.uint8), list(cfg.table.values))
    times = {w: {"worker": [], "ps": []} for w in widths}
    pipelines = {}
    for r in range(args.rounds + 2):                # two untimed rounds: buffers and caches warm
        for w in widths:
            cfg, layout, lanes, acc, table = state[w]
            c = time.thread_time()
            rnd = thc.WorkerRound(cfg, thc.Pieces(tensors), None, "grad")
            norms = rnd.norms()
            packed = rnd.encode(norms, np.random.default_rng(r), r, packed=True)
            rnd.decode_lanes(lanes, RANKS, out=bucket)
            worker = time.thread_time() - c
            pipelines[w] = rnd.can_pipeline()
            c = time.thread_time()
            for k in range(RANKS):
                lookup_accumulate(acc, packed, table, cfg.bits, False, k == 0)
            ps = time.thread_time() - c
            if r >= 2:
                times[w]["worker"].append(1e3 * worker)
                times[w]["ps"].append(1e3 * ps)
    first = widths[0]
    rows = []
    print(f"example LM: {sum(sizes):,} coordinates in {len(sizes)} tensors, {RANKS} ranks, "
          f"{args.rounds} rounds a width, one codec thread")
    print(f"{'b:g':<7}{'bytes up':>10}{'pipelines':>11}{'worker ms':>11}{'PS ms':>8}{'worker x':>10}{'PS x':>7}")
    for w in widths:
        cfg, layout = state[w][:2]
        row = {"bits": w[0], "granularity": w[1], "bytes_up": thc.packed_size(layout.padded_dim, w[0]),
               "pipelines": pipelines[w], "worker_ms": float(np.median(times[w]["worker"])),
               "ps_ms": float(np.median(times[w]["ps"]))}
        rows.append(row)
    for row in rows:
        row["worker_vs_first"] = row["worker_ms"] / rows[0]["worker_ms"]
        row["ps_vs_first"] = row["ps_ms"] / rows[0]["ps_ms"]
        print(f"{row['bits']}:{row['granularity']:<5}{row['bytes_up']:>10,}{str(row['pipelines']):>11}"
              f"{row['worker_ms']:>11.2f}{row['ps_ms']:>8.3f}{row['worker_vs_first']:>10.2f}{row['ps_vs_first']:>7.2f}")
    print(f"(x: against {first[0]}:{first[1]}, in the same run)")
    write_rows(args.out, {"coordinates": sum(sizes), "tensors": len(sizes), "ranks": RANKS, "rounds": args.rounds},
               rows)
    return {"rows": rows}


if __name__ == "__main__":
    main()
