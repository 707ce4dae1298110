"""The retransmission timer, fixed against adaptive, side by side in one run.

For each path and loss rate the same `thc launch` job runs twice, once with the workers'
fixed first timeout (`--fixed-timeout`, the rule before the adaptive timer) and once with
the timeout that follows the measured round trip (worker/rto.py, RetransmitTimer).
Reported per run: rounds exact, mean round, timeouts, losses found without a timer (by the
PS's notice or the order of results, docs/design.md "Loss recovery"), resends, packets sent,
resends beyond the datagrams the path dropped per 100 packets sent, and the timeout the
workers ended with.  On a clean path every resend is spurious.

Paths:
  loopback   a PS and the workers on 127.0.0.1; loss injected in the workers' transport
  slow-link  the PS in a network namespace behind a veth rate-limited with tc tbf
             (`--rate-mbit`, default 100): the queue in front of the link makes a round
             trip longer than the first timeout, as a slow aggregator does; loss by nftables
             (root, iproute2, nftables)
  bmv2       `thc p4 mininet` (root, Mininet, simple_switch and p4c; skipped naming what is
             missing), loss by nftables on every host link.  bmv2's own input-queue drops
             are not counted as path drops; the switch's counters say what its pipeline saw
             of the resends: a `duplicate` is a resent contribution the switch already had
             (the resend was spurious), a result resent answers a resend of a completed
             round (the result was lost, or still on its way)

    .venv/bin/python bench/bench_rto.py --out /tmp/rto            # all paths, losses 0 and 5%
    .venv/bin/python bench/bench_rto.py --paths loopback --rounds 10 --out /tmp/rto
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_results  # noqa: E402

PATHS = ("loopback", "slow-link", "bmv2")
KEYS = ("exact_rounds", "rounds", "mean_round_ms", "timeouts", "retransmissions", "packets_sent", "rto_ms")


def _row(path: str, loss: float, fixed: bool, doc: dict, path_drops: int) -> dict:
    """One run's figures.  Every resend beyond the packets the path dropped is spurious (a
    drop costs one resend of the rank that lost it; a rank waiting for another's loss
    recovery may resend as well, so this bounds the spurious ones from above).  A checkout
    before the loss notices resent on timeouts only (its retransmissions are its timeouts)."""
    row = {"path": path, "loss": loss, "timer": "fixed" if fixed else "adaptive",
           **{k: doc.get(k) for k in KEYS}, "fast_losses": doc.get("fast_losses", 0), "path_drops": path_drops}
    sent = row["packets_sent"] or 0
    row["spurious"] = max(0, row["retransmissions"] - path_drops)
    row["spurious_per_100"] = 100 * row["spurious"] / sent if sent else None
    sw = doc.get("switch")
    if sw:
        row["switch_duplicates"], row["switch_results_resent"] = sw["duplicate"], sw["results_resent"]
    return row


def run(path: str, args, loss: float, fixed: bool) -> dict:
    doc, drops = RUNNERS[path](args, loss, fixed)
    return _row(path, loss, fixed, doc, drops)


def run_loopback(args, loss: float, fixed: bool):
    from thc_ps.deploy.launch import run_launch
    doc = run_launch(workers=args.workers, rounds=args.rounds, dim=args.dim, loss=loss, seed=args.seed,
                     fixed_timeout=fixed, check=True)
    return doc, doc["injected"]["injected_drops_out"] + doc["injected"]["injected_drops_in"]


def run_slow_link(args, loss: float, fixed: bool):
    from thc_ps.deploy import netns
    from thc_ps.deploy.experiments import ps_in_namespace
    from thc_ps.proto.job import JobConfig
    job = JobConfig(num_workers=args.workers)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "THC_UDP_OFFLOAD": "0"}   # nft drops per datagram
    with netns.two_hosts(rate_mbit=args.rate_mbit, loss=loss) as net:
        ps = ps_in_namespace(net, job, 9000, env)
        try:
            cmd = net.prefix(net.worker_ns) + [
                sys.executable, "-m", "thc_ps.deploy.cli", "launch", "--ps", f"{net.ps_ip}:9000",
                "--workers", str(args.workers), "--rounds", str(args.rounds), "--dim", str(args.dim),
                "--seed", str(args.seed), "--json"] + (["--fixed-timeout"] if fixed else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
            drops = (netns.qdisc_drops(net.ps_ns) + netns.qdisc_drops(net.worker_ns)
                     + net.nft_drops())
        finally:
            ps.terminate()
            ps.wait(10)
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise RuntimeError(f"thc launch failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), drops


def run_bmv2(args, loss: float, fixed: bool):
    from thc_ps.deploy import mininet_run
    doc = mininet_run.run(workers=args.workers, rounds=args.rounds, dim=args.bmv2_dim, loss=loss,
                          fixed_timeout=fixed, build_dir=args.out / "p4")
    return doc, doc["kernel_drops"]


RUNNERS = {"loopback": run_loopback, "slow-link": run_slow_link, "bmv2": run_bmv2}


def why_not(path: str) -> str | None:
    """Why `path` cannot run here (a one-line reason), or None."""
    if path == "slow-link":
        from thc_ps.deploy import netns
        return netns.unavailable(need_nft=True, need_tc=True)
    if path == "bmv2":
        from thc_ps.deploy import mininet_run
        try:
            mininet_run.preflight(0.05)
        except Exception as exc:        # noqa: BLE001 - its message names what is missing
            return str(exc).splitlines()[0]
    return None


def table(rows: list) -> str:
    out = ["| path | loss | timer | exact | mean round | packets sent | dropped on the path | timeouts | "
           "found without a timer | resends | spurious / 100 sent | timeout at the window |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per = "-" if r["spurious_per_100"] is None else f"{r['spurious_per_100']:.2f}"
        out.append(f"| {r['path']} | {r['loss']:.0%} | {r['timer']} | {r['exact_rounds']}/{r['rounds']} | "
                   f"{r['mean_round_ms']:.1f} ms | {r['packets_sent']} | {r['path_drops']} | {r['timeouts']} | "
                   f"{r['fast_losses']} | {r['retransmissions']} | {per} | {r['rto_ms']:.0f} ms |")
    switch = [r for r in rows if "switch_duplicates" in r]
    if switch:
        out += ["", "| path | loss | timer | switch: duplicates (spurious resends) | switch: results resent |",
                "|---|---|---|---|---|"]
        out += [f"| {r['path']} | {r['loss']:.0%} | {r['timer']} | {r['switch_duplicates']} | "
                f"{r['switch_results_resent']} |" for r in switch]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="paths to run")
    ap.add_argument("--losses", type=float, nargs="+", default=[0.0, 0.05], help="loss rates each way")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dim", type=int, default=1 << 20, help="coordinates per round (loopback, slow-link)")
    ap.add_argument("--bmv2-dim", type=int, default=4096, help="coordinates per round through bmv2")
    ap.add_argument("--rate-mbit", type=float, default=100.0, help="the slow link's rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="directory for rto.json and rto.md")
    args = ap.parse_args(argv)
    if not all(0 <= x < 1 for x in args.losses):
        ap.error("--losses must be probabilities in [0, 1)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows, skipped, failed = [], {}, []
    for path in args.paths:
        reason = why_not(path)
        if reason:
            skipped[path] = reason
            print(f"{path}: skipped: {reason}", flush=True)
            continue
        for loss in args.losses:
            for fixed in (True, False):        # the pair side by side, fixed first
                t0 = time.monotonic()
                row = run(path, args, loss, fixed)
                rows.append(row)
                if row["exact_rounds"] != row["rounds"]:
                    failed.append(f"{path} loss {loss} {row['timer']}: {row['exact_rounds']}/{row['rounds']} exact")
                print(f"{path} loss {loss:.0%} {row['timer']:>8}: {row['exact_rounds']}/{row['rounds']} exact, "
                      f"round {row['mean_round_ms']:.1f} ms, {row['timeouts']} timeouts, {row['fast_losses']} "
                      f"found without a timer, {row['retransmissions']} resends / "
                      f"{row['packets_sent']} packets, {row['path_drops']} dropped on the path, "
                      f"timeout at the window {row['rto_ms']:.0f} ms "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
    doc = {"command": " ".join(["bench/bench_rto.py"] + (argv if argv is not None else sys.argv[1:])),
           "workers": args.workers, "rounds": args.rounds, "dim": args.dim, "bmv2_dim": args.bmv2_dim,
           "rate_mbit": args.rate_mbit, "rows": rows, "skipped": skipped, "load": os.getloadavg()}
    md = table(rows) + "".join(f"\n\n{p}: skipped: {r}" for p, r in skipped.items())
    return write_results(args.out, "rto", doc, md, failed)


if __name__ == "__main__":
    raise SystemExit(main())
