"""Bodies of the `thc` subcommands; argument parsing stays in cli.py."""
from __future__ import annotations

import sys


def nmse_codecs():
    from compression.nmse import CODECS
    return CODECS


def cmd_table(args) -> dict:
    from proto.tables import solve_table
    return solve_table(args.bits, args.granularity, args.p).to_json()


def cmd_nmse(args) -> dict:
    from compression import nmse
    params = {}
    if args.codec in ("thc", "uhc"):
        params["bits"] = args.bits
    if args.codec == "thc":
        params.update(granularity=args.granularity, p=args.p)
    if args.codec == "topk":
        params["topk"] = args.topk
    return nmse.run(args.codec, workers=args.workers, dim=args.dim, dist=args.dist,
                    copies=args.copies, trials=args.trials, seed=args.seed, **params)


def cmd_demo_nmse(args) -> None:
    from compression import nmse
    print(f"NMSE of one round, lognormal gradient copied to {args.workers} workers, d={args.dim}",
          flush=True)
    print(f"{'codec':<10}{'NMSE':>12}{'bits up':>10}{'bits down':>11}")
    for codec in nmse.CODECS:
        r = nmse.run(codec, workers=args.workers, dim=args.dim, trials=args.trials)
        print(f"{codec:<10}{r['nmse']:>12.4g}{r['bits_up']:>10.2f}{r['bits_down']:>11.2f}", flush=True)
    sys.stdout.flush()
