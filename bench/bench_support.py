"""The clamp's bias against the rounding noise, by support fraction p, on the example language
model's gradients (docs/design.md, "The support without error feedback").

    .venv/bin/python bench/bench_support.py [--steps 50] [--draws 32] [--p 1/32,1/128,1/512,1/4096]
                                            [--tables 4:30,5:31] [--out FILE.json]

THC clamps each rotated block to [−t_p·ℓ/√d, t_p·ℓ/√d] (§5.3, "bounding the support"); the
rounding after it is unbiased, the clamp is not.  With error feedback the clamp's error is
carried into the next step; without it, it is a bias, and under one rotation per job it falls
the same way in every round of a steady gradient, while the rounding noise of successive
rounds is independent and an optimizer's momentum averages it.  For each p this takes the
four ranks' gradients of bench_tensor_error.py (each tensor in blocks of its own, one rotation,
no error feedback) through `--draws` rounds that differ only in their uniforms, and prints,
in units of ‖x̄‖² (x̄ the exact average):
  - noise: the mean squared error of one round (its NMSE);
  - bias²: ‖E[x̂] − x̄‖², the mean of the draws against x̄ less the draws' own variance / draws;
  - in momentum: bias² + noise·(1 − β₁)/(1 + β₁), the error left in an exponential average
    with Adam's β₁ = 0.9 if the rounds' noise is independent and the gradient steady.
`--tables` takes b:g pairs (b-bit indices at granularity g; default 4:30, JobConfig's), each
with every p.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `bench` is not installed: run from a checkout
from bench.bench_tensor_error import lm_gradients, one_round, write_rows  # noqa: E402
from bench.bench_widths import parse_widths  # noqa: E402

#: Adam's default first-moment decay, for the "in momentum" column.
BETA1 = 0.9


def support_row(p: str, vectors: list, sizes: list, draws: int, bits: int = 4, granularity: int = 30) -> dict:
    """noise, bias² and what stays in momentum for support fraction `p` and a table of
    `bits`-bit indices at `granularity` (module docstring)."""
    from thc_ps.compression import thc
    cfg = thc.ThcConfig(p=p, bits=bits, granularity=granularity)
    mean = np.mean(vectors, axis=0)
    scale = float(np.sum(mean.astype(np.float64) ** 2))
    ests = np.array([one_round(cfg, vectors, sizes, k + 1) for k in range(draws)], np.float64)
    avg = ests.mean(axis=0)
    noise = float(np.mean(np.sum((ests - mean) ** 2, axis=1))) / scale
    spread = float(np.sum((ests - avg) ** 2)) / (draws - 1) / scale       # one draw's variance
    bias2 = float(np.sum((avg - mean) ** 2)) / scale - spread / draws
    return {"bits": bits, "granularity": granularity, "p": p, "noise": noise, "bias2": bias2, "in_momentum": bias2 + noise * (1 - BETA1) / (1 + BETA1),
            "scale": float(np.dot(avg, mean)) / scale}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50, help="training steps before the gradients are taken")
    ap.add_argument("--draws", type=int, default=32, help="rounds per p, differing only in their uniforms")
    ap.add_argument("--p", default="1/32,1/128,1/512,1/4096", help="comma list of support fractions")
    ap.add_argument("--tables", default="4:30", help="comma list of b:g tables (default 4:30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the table as JSON here")
    args = ap.parse_args(argv)
    try:
        tables = parse_widths(args.tables)
    except ValueError as exc:
        ap.error(f"--tables: {exc}")
    if args.steps < 0 or args.draws < 2:
        ap.error("--steps must be 0 or more and --draws 2 or more")
    from thc_ps.proto.tables import parse_p
    ps = [s.strip() for s in args.p.split(",") if s.strip()]
    for p in ps:
        try:
            parse_p(p)
        except ValueError as exc:
            ap.error(f"--p {p!r}: {exc}")
    _, grads = lm_gradients(args.steps, 4, args.seed)
    vectors = [np.concatenate(g) for g in grads]
    sizes = [g.size for g in grads[0]]
    rows = []
    print(f"{'b:g':>6s} {'p':>8s} {'noise':>9s} {'bias²':>9s} {'in momentum':>12s} {'E[x̂]·x̄/‖x̄‖²':>14s}")
    for b, g in tables:
        for p in ps:
            row = support_row(p, vectors, sizes, args.draws, b, g)
            rows.append(row)
            print(f"{f'{b}:{g}':>6s} {p:>8s} {row['noise']:9.5f} {row['bias2']:9.5f} {row['in_momentum']:12.5f} "
                  f"{row['scale']:14.4f}", flush=True)
    write_rows(args.out, {"steps": args.steps, "draws": args.draws, "seed": args.seed}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
