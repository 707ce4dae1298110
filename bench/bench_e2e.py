"""End-to-end round time on loopback: THC vs float32 through the same PS and transport.

4 worker processes and the PS on this host (2 cores), R rounds of d coordinates each,
mean allreduce time per round as the workers measure it (norm exchange, encode, send,
receive, decode).  Each codec runs twice in the same run: workers batching their datagrams
(sendmmsg/recvmmsg, the default) and with one system call per datagram.

    .venv/bin/python bench/bench_e2e.py [--dims 20 24] [--rounds 3] [--workers 4]
"""
from __future__ import annotations

import argparse

from thc_ps.deploy.launch import run_launch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[20, 24], help="log2 of the dimensions")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()
    print(f"{'d':>6}{'codec':>7}{'worker I/O':>14}{'round ms':>10}{'up MB':>8}{'down MB':>9}"
          f"{'vs none':>9}{'vs per-dgram':>14}")
    for k in args.dims:
        res = {}
        for codec in ("none", "thc"):
            for batched in (True, False):
                doc = run_launch(workers=args.workers, rounds=args.rounds, dim=1 << k, codec=codec,
                                 check=False, timeout_ms=2000, batched=batched)
                res[codec, batched] = doc["mean_round_ms"]
                vs_none = res["none", batched] / doc["mean_round_ms"]
                vs_single = (res[codec, False] / res[codec, True]) if not batched else float("nan")
                print(f"{k:>6}{codec:>7}{'sendmmsg' if batched else 'per-datagram':>14}"
                      f"{doc['mean_round_ms']:10.1f}{doc['bytes_up_per_round'] / 1e6:8.2f}"
                      f"{doc['bytes_down_per_round'] / 1e6:9.2f}{vs_none:9.2f}{vs_single:14.2f}", flush=True)


if __name__ == "__main__":
    main()
