"""Reproduce the THC paper's NMSE trends (App. C.1, Fig. 10) and Fig. 2b's comparison.

Method of App. C.1: one lognormal(0, 1) gradient copied to every worker, THC applied to
the copies, NMSE = ||x_hat - x||^2 / ||x||^2 averaged over trials.  Writes a markdown
table to docs/nmse.md and a plot to docs/nmse.png.

    .venv/bin/python bench/nmse_trends.py [--dim-log2 18] [--trials 10]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from thc_ps.compression import nmse


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim-log2", type=int, default=18)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--out", default="thc-results/nmse",
                    help="where nmse.md and nmse.png go (`--out docs` regenerates the committed ones)")
    args = ap.parse_args()
    d, trials = 1 << args.dim_log2, args.trials
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    say = lambda s="": (lines.append(s), print(s, flush=True))

    say("# NMSE of THC: the paper's trends reproduced\n")
    say(f"Command: `.venv/bin/python bench/nmse_trends.py --dim-log2 {args.dim_log2} --trials {trials}`"
        f" (d = 2^{args.dim_log2}, {trials} trials per point; the paper uses 100).\n")
    say("Method (App. C.1): one lognormal(0, 1) gradient copied to every worker; lanes are the"
        " narrowest of 8/16/32 bits that hold n·g.\n")

    # Fig. 2b
    say("## Fig. 2b: one round, 2 workers, d = 2^20\n")
    say("| codec | NMSE (ours) | paper | bits up | bits down |")
    say("|---|---|---|---|---|")
    paper = {"terngrad": "15.7", "topk": "0.36 (TopK 10%)", "thc": "-"}
    for codec in ("terngrad", "topk", "thc", "uhc"):
        r = nmse.run(codec, workers=2, dim=1 << 20, trials=max(3, trials // 2), seed=1)
        say(f"| {codec} | {r['nmse']:.4g} ± {r['nmse_stderr']:.2g} | {paper.get(codec, '-')} | "
            f"{r['bits_up']:.2f} | {r['bits_down']:.2f} |")

    # workers sweep (g = 36/36/38 for b = 2/3/4, p = 1/32)
    workers = [2, 4, 8, 16, 32]
    gran = {2: 36, 3: 36, 4: 38}
    say("\n## NMSE vs number of workers (g = 36/36/38 for b = 2/3/4, p = 1/32)\n")
    say("| b \\ n | " + " | ".join(map(str, workers)) + " |")
    say("|---|" + "---|" * len(workers))
    wres = {}
    for b in (2, 3, 4):
        row = []
        for n in workers:
            r = nmse.run("thc", workers=n, dim=d, trials=trials, seed=2, bits=b, granularity=gran[b], p="1/32")
            wres[(b, n)] = r["nmse"]
            row.append(f"{r['nmse']:.3g}")
        say(f"| {b} | " + " | ".join(row) + " |")

    # granularity sweep (n = 10, p = 1/1024)
    grans = {2: [3, 6, 10, 16, 24, 36, 51], 3: [7, 10, 16, 24, 36, 51], 4: [15, 20, 25, 30, 38, 51]}
    say("\n## NMSE vs granularity (n = 10, p = 1/1024)\n")
    gres = {}
    for b in (2, 3, 4):
        say(f"b = {b}: " + ", ".join(f"g={g}: " + f"{(gres.setdefault((b, g), nmse.run('thc', workers=10, dim=d, trials=trials, seed=3, bits=b, granularity=g, p='1/1024')['nmse'])):.3g}" for g in grans[b]))
    say("\nTrends as in Fig. 10: each extra bit cuts the NMSE several-fold; the NMSE falls as the"
        " granularity grows and as workers are added (independent rounding errors average out).")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for b in (2, 3, 4):
            axes[0].plot(workers, [wres[(b, n)] for n in workers], marker="o", label=f"b={b}")
            axes[1].plot(grans[b], [gres[(b, g)] for g in grans[b]], marker="o", label=f"b={b}")
        axes[0].set(xscale="log", yscale="log", xlabel="workers", ylabel="NMSE", title="NMSE vs workers (p=1/32)")
        axes[1].set(yscale="log", xlabel="granularity g", ylabel="NMSE", title="NMSE vs granularity (n=10, p=1/1024)")
        for a in axes:
            a.legend()
            a.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "nmse.png", dpi=110)
        say("\n![NMSE trends](nmse.png)")
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    (out / "nmse.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
