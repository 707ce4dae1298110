"""Loss and stragglers through the bmv2 switch beside the software PS, same configurations.

    PATH=/opt/p4tools/bin:$PATH .venv/bin/python -m thc_ps.deploy.switch_experiment    (root)

Each configuration runs twice:
  switch    `thc p4 mininet`: one bmv2 switch in Mininet, N hosts with real `thc worker`s,
            loss = nftables drops on every host link;
  software  `thc ps` in one network namespace, `thc launch --ps` (N workers) in another,
            loss = the same nftables rule on the workers' side (deploy/netns.py).
Both check every chunk of every round against the in-process reference.  Writes switch.md
and switch.json to --out (default ./thc-results/switch; `--out docs/experiments` regenerates
the committed results).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from thc_ps.deploy import mininet_run, netns
from thc_ps.deploy.procs import stop_gracefully
from thc_ps.p4.control import choose_control, engine_stats

ROOT = Path(__file__).resolve().parents[1]

# (label, loss, straggler delay ms, straggler rank, quorum, policy)
CONFIGS = (
    ("baseline", 0.0, 0.0, None, 1.0, "retransmit"),
    ("1% loss", 0.01, 0.0, None, 1.0, "retransmit"),
    ("5% loss", 0.05, 0.0, None, 1.0, "retransmit"),
    ("straggler 30 ms", 0.0, 30.0, 3, 1.0, "retransmit"),
    ("straggler 60 ms, quorum 3/4", 0.0, 60.0, 3, 0.75, "retransmit"),
    ("1% loss + straggler 30 ms", 0.01, 30.0, 3, 1.0, "retransmit"),
    ("1% loss, zero policy", 0.01, 0.0, None, 1.0, "zero"),
)


def software(workers, rounds, dim, loss, delay, rank, quorum, policy) -> dict:
    """`thc ps` and `thc launch --ps` in two namespaces, nftables loss on the workers' side."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    py = [sys.executable, "-m", "thc_ps.deploy.cli"]
    with netns.two_hosts(loss=loss) as net:
        ps = subprocess.Popen(net.prefix(net.ps_ns) + py + [
            "ps", "--bind", f"{net.ps_ip}:9000", "--workers", str(workers), "--quorum", str(quorum),
            "--stats-every", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        try:
            time.sleep(1.5)
            cmd = ["launch", "--ps", f"{net.ps_ip}:9000", "--workers", str(workers), "--rounds", str(rounds),
                   "--dim", str(dim), "--quorum", str(quorum), "--loss-policy", policy, "--json"]
            if delay:
                cmd += ["--straggler-delay-ms", str(delay)] + (["--straggler-rank", str(rank)] if rank is not None else [])
            t0 = time.monotonic()
            run = subprocess.run(net.prefix(net.worker_ns) + py + cmd, capture_output=True, text=True, env=env,
                                 cwd=ROOT, timeout=900)
            seconds = time.monotonic() - t0
            drops = net.nft_drops() if loss else 0
        finally:
            ps_out = stop_gracefully(ps)
    if run.returncode != 0:
        raise RuntimeError(f"thc launch failed: {run.stderr[-1000:]}")
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    m = re.search(r"final stats shard 0: (\{.*\})", ps_out)
    doc["ps"] = json.loads(m.group(1)) if m else None
    doc["kernel_drops"], doc["wall_seconds"] = drops, seconds
    return doc


def _row(label, kind, d, ctr) -> str:
    drops = ctr.get("drops") or {}
    return (f"| {label} | {kind} | {d['exact_rounds']}/{d['rounds']} | {d['mismatched_chunks']} | "
            f"{d['lost_chunks']} | {d['kernel_drops']} | {d['retransmissions']} | {d['mean_round_ms']:.0f} | "
            f"{ctr.get('rounds_completed')} | {ctr.get('partial_rounds')} | {ctr.get('results_resent')} | "
            f"{ctr.get('stragglers_notified', ctr.get('stale'))} | {sum(drops.values()) if drops else 0} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--out", default=str(Path.cwd() / "thc-results" / "switch"),
                    help="where switch.md and switch.json go (default: ./thc-results/switch; "
                         "`--out docs/experiments` regenerates the committed results)")
    ap.add_argument("--switch-control", choices=("auto", "p4runtime", "thrift"), default="auto",
                    help="how the switch is programmed (thc_ps.p4.control.choose_control): P4Runtime runs the "
                         "control plane as `thc p4 run --attach` (mininet's p4run mode), Thrift preprograms it")
    args = ap.parse_args(argv)
    out = Path(args.out).expanduser()
    try:                        # before any run: a run's results are not lost to a bad --out
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--out {args.out}: {exc.strerror}")
    switch, why = choose_control(args.switch_control)
    print(f"switch control plane: {switch} ({why})", flush=True)
    mode = "p4run" if switch == "p4runtime" else "static"
    results = []
    for label, loss, delay, rank, quorum, policy in CONFIGS:
        print(f"== {label}", flush=True)
        sw = mininet_run.run(workers=args.workers, rounds=args.rounds, dim=args.dim, loss=loss,
                             straggler_delay_ms=delay, straggler_rank=rank, quorum=quorum, policy=policy,
                             control=mode, switch=switch)
        sw.pop("control_output", None)
        print(mininet_run.summary_text(sw), flush=True)
        soft = software(args.workers, args.rounds, args.dim, loss, delay, rank, quorum, policy)
        print(f"software PS: exact {soft['exact_rounds']}/{soft['rounds']}, mismatched "
              f"{soft['mismatched_chunks']}, lost {soft['lost_chunks']}, PS {soft['ps']}", flush=True)
        results.append({"label": label, "loss": loss, "straggler_delay_ms": delay, "straggler_rank": rank,
                        "quorum": quorum, "policy": policy, "switch": sw, "software": soft})
    (out / "switch.json").write_text(json.dumps(results, indent=1) + "\n")
    rate = [r["switch"]["packets_per_s"] for r in results if r["switch"]["packets_per_s"]]
    lines = [
        "# Loss and stragglers through the bmv2 switch, beside the software PS",
        "",
        f"Command (root, p4lang's tools found by `thc p4 doctor`): "
        f"`PATH=/opt/p4tools/bin:$PATH .venv/bin/python -m thc_ps.deploy.switch_experiment --workers {args.workers} "
        f"--rounds {args.rounds} --dim {args.dim} --switch-control {switch}`",
        "",
        f"{args.workers} workers, {args.rounds} rounds of d={args.dim} (THC b=4, g=30, p=1/32). "
        "**switch**: `thc p4 mininet` — one bmv2 `simple_switch` running `p4/thc.p4` in Mininet, "
        "each worker a real `thc worker` on its own Mininet host, 32 indices per packet. **software**: "
        "`thc ps` in one network namespace and `thc launch --ps` in another (MTU-sized packets, so "
        "more coordinates per chunk). Loss: an nftables `numgen random` drop rule on the workers' "
        "links, each way (THC datagrams to and from port 9000). Straggler: the worker of that rank "
        "sleeps the delay before each round. Every chunk of every round is checked against the "
        "in-process reference; `exact` counts rounds in which every worker's every chunk matched the "
        "reference sum for the contributors its bitmap names.",
        "",
        f"bmv2 processed about {min(rate):.0f}–{max(rate):.0f} worker packets per second in these runs "
        "(the pipeline's rate on this 2-core machine; `docs/p4.md` has the throughput measurement), "
        "which is why the rounds are few and small.",
        "",
        "| config | PS | exact rounds | mismatched chunks | lost chunks | nft drops | retransmissions | "
        "mean round ms | rounds_completed | partial_rounds | results_resent | stragglers notified | "
        "drops (PS/switch) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        sw, soft = r["switch"], r["software"]
        lines.append(_row(r["label"], "switch", sw, engine_stats(sw["switch"])))
        lines.append(_row(r["label"], "software", soft, soft["ps"] or {}))
    lines += ["", "Chunk rounds per round: switch "
              f"{results[0]['switch']['chunks_per_round']} (d/32 DATA + 1 NORM)."]
    (out / "switch.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'switch.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
