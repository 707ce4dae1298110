"""The `thc` command: one entry point, one subcommand per job."""
from __future__ import annotations

import argparse
import json
import sys

from deploy import commands


def _p_arg(value: str):
    from proto.tables import parse_p
    try:
        return parse_p(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="thc", description="THC-PS: Tensor Homomorphic Compression parameter server.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    t = sub.add_parser("table", help="solve the optimal lookup table for (b, g, p) and print JSON",
                       description="Exact App. B optimum over all strictly increasing tables.")
    t.add_argument("--bits", type=_positive, default=4, help="bit budget b per index (1-8, default 4)")
    t.add_argument("--granularity", type=_positive, default=30, help="granularity g (default 30)")
    t.add_argument("--p", type=_p_arg, default="1/32", help="support fraction p, e.g. 1/32 (default)")
    t.set_defaults(func=commands.cmd_table)

    n = sub.add_parser("nmse", help="NMSE of one aggregation round of a codec, as JSON",
                       description="NMSE = ||x_hat - x_mean||^2 / ||x_mean||^2 averaged over trials "
                                   "(THC paper App. C.1 method with --copies).")
    n.add_argument("--codec", default="thc", choices=commands.nmse_codecs(), help="codec (default thc)")
    n.add_argument("--workers", type=_positive, default=2, help="number of workers n (default 2)")
    n.add_argument("--dim", type=_positive, default=1 << 20, help="gradient dimension d (default 2^20)")
    n.add_argument("--dist", default="lognormal", choices=("lognormal", "normal", "laplace"),
                   help="gradient distribution (default lognormal)")
    mode = n.add_mutually_exclusive_group()
    mode.add_argument("--copies", dest="copies", action="store_true", default=True,
                      help="one gradient copied to every worker (default, App. C.1)")
    mode.add_argument("--independent", dest="copies", action="store_false",
                      help="an independent gradient per worker")
    n.add_argument("--bits", type=_positive, default=4, help="bits per index b (default 4)")
    n.add_argument("--granularity", type=_positive, default=30, help="granularity g (default 30)")
    n.add_argument("--p", type=_p_arg, default="1/32", help="support fraction p (default 1/32)")
    n.add_argument("--topk", type=float, default=0.1, help="TopK kept fraction (default 0.1)")
    n.add_argument("--trials", type=_positive, default=10, help="rounds averaged (default 10)")
    n.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    n.set_defaults(func=commands.cmd_nmse)

    d = sub.add_parser("demo-nmse", help="print the NMSE comparison of all codecs (quick look)")
    d.add_argument("--workers", type=_positive, default=4)
    d.add_argument("--dim", type=_positive, default=1 << 18)
    d.add_argument("--trials", type=_positive, default=3)
    d.set_defaults(func=commands.cmd_demo_nmse)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except (ValueError, OSError) as exc:
        print(f"thc {args.command}: error: {exc}", file=sys.stderr)
        return 2
    if isinstance(result, dict):
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
