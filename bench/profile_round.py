"""Where a THC worker round's time goes: one worker against the C PS in this process, d = 2^k,
under cProfile; the round before the fused kernels (the pieces of commit d92a8a5, rebuilt
from what _kernels.c keeps, patched in where the worker calls the fused ones) and after,
same run.

    .venv/bin/python bench/profile_round.py [--dim-log2 24] [--rounds 3]

Buckets (cumulative time inside the round, ms per round):
  encode     RHT + clamp + quantize + 4-bit packing (before: separate passes + pack_indices)
  uniforms   the worker's rng.random draws for stochastic rounding
  norms      block norms + the NORM phase
  transport  run_phase of the DATA phase (send, PS aggregation in its thread, receive)
  lanes→Y/k  the sum lanes gathered for decoding (before: per-chunk unpack_lanes / k into y_avg;
             after: joining the payloads, the division being inside decode)
  decode     RHT⁻¹ of the average (after: thc.decode_lanes, which includes lanes→Y/k)
  own decode the error-feedback term RHT⁻¹(X) (before: lookup_sum + decode)
  glue       the rest: error-feedback arithmetic, chunking, result bookkeeping
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

import sys as _sys  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))   # `bench` is not installed: run from a checkout
from bench.bench_thc import decode_before, encode_before
from thc_ps.compression import thc
from thc_ps.proto.job import JobConfig
from thc_ps.proto.packing import pack_indices
from thc_ps.ps_server.server import PSServer
from thc_ps.worker import client
from thc_ps.worker.client import Worker
from thc_ps.worker.transport import Transport


def before_patches() -> dict:
    """The previous version's pieces, put where the worker now calls the fused ones: separate
    scalar passes for encode and decode, the error-feedback term as lookup_sum + decode, and
    the per-chunk lanes loop (joined_lanes declines, so the worker takes average_lanes)."""
    stash = {}

    def _encode_packed_before(x, norms, cfg, layout, rn, u):
        stash["z"] = encode_before(x, norms, cfg, layout, rn, u)
        return pack_indices(stash["z"], cfg.bits)

    def _decode_avg_before(y, k, norms, cfg, layout, rn):
        return decode_before(y, k, norms, cfg, layout, rn)

    def _own_before(_wire, norms, cfg, layout, rn, **_kw):
        return decode_before(thc.lookup_sum([stash.pop("z")], cfg.table.values), 1, norms, cfg, layout, rn)

    return {(thc, "encode_packed"): _encode_packed_before, (thc, "decode"): _decode_avg_before,
            (thc, "decode_own"): _own_before, (client, "joined_lanes"): lambda *a, **k: None}


class _TimedRng:
    """The worker's Generator with `random` as a Python frame, so cProfile attributes it."""

    def __init__(self, gen):
        self._gen = gen

    def random(self, *args, **kwargs):
        return self._gen.random(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._gen, name)


BUCKETS = {
    "encode": ["encode_packed", "_encode_packed_before"],
    "uniforms": ["random"],
    "norms": ["block_norms", "_exchange_norms"],
    "transport": ["run_phase"],
    "decode": ["decode", "decode_lanes", "_decode_avg_before"],
    "own decode": ["decode_own", "_own_before"],
    "lanes→Y/k": ["average_lanes", "joined_lanes"],
}


def profile(before: bool, dim: int, rounds: int):
    server = PSServer(JobConfig(num_workers=1), ("127.0.0.1", 0), control_port=0).start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port)
    patches = before_patches() if before else {}
    saved = {key: getattr(*key) for key in patches}
    try:
        for (mod, name), fn in patches.items():
            setattr(mod, name, fn)
        w = Worker(t)
        w.rng = _TimedRng(w.rng)
        x = np.random.default_rng(0).standard_normal(dim).astype(np.float32)
        w.allreduce(x)                                   # warm: sockets, workspaces, pages
        prof = cProfile.Profile()
        start = time.perf_counter()
        prof.enable()
        for _ in range(rounds):
            w.allreduce(x)
        prof.disable()
        wall = (time.perf_counter() - start) / rounds * 1e3
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)
        t.close()
        server.stop()
    stats = pstats.Stats(prof).stats
    cum = {}
    for (fname, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.items():
        key = func
        cum[key] = cum.get(key, 0.0) + ct
    round_ms = cum.get("_thc_round", 0) / rounds * 1e3
    out = {"round (profiled)": round_ms}
    for bucket, names in BUCKETS.items():
        v = 0.0
        for nm in names:
            if nm == "decode":     # thc.decode proper, not decode_own (which calls it in fallbacks)
                v += sum(st[3] for (f, _l, fn), st in stats.items() if fn == "decode" and f.endswith("thc.py"))
            else:
                v += cum.get(nm, 0.0)
        out[bucket] = v / rounds * 1e3
    out["glue"] = round_ms - sum(v for k, v in out.items() if k != "round (profiled)")
    out["allreduce wall (profiled)"] = wall
    if TOP:
        pstats.Stats(prof).sort_stats("tottime").print_stats(TOP)
    return out


TOP = 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim-log2", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=0, help="also print the top N functions by own time")
    args = ap.parse_args()
    global TOP
    TOP = args.top
    dim = 1 << args.dim_log2
    res = {"before": profile(True, dim, args.rounds), "after": profile(False, dim, args.rounds)}
    print(f"d = 2^{args.dim_log2}, one worker + C PS in this process, {args.rounds} rounds under cProfile, ms per round")
    print(f"{'bucket':>26} {'before':>9} {'after':>9} {'before/after':>12}")
    for key in res["before"]:
        b, a = res["before"][key], res["after"][key]
        print(f"{key:>26} {b:9.1f} {a:9.1f} {b / a if a > 0 else float('nan'):12.2f}")


if __name__ == "__main__":
    main()
