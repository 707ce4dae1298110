"""Loss recovery: the round at loss P against the lossless round, side by side in one run.

For each repetition and checkout (`--trees`: this one by default; another checkout, e.g. the
commit before, runs the same command from its own directory, for before/after pairs) the
same job runs without loss and at every loss rate in turn, lossless runs between them
(0, P1, 0, P2, 0): each loss's ratio is taken against the mean of the lossless runs just
before and after it, so that a host whose load drifts over minutes moves both.  The
checkouts alternate their order from one repetition to the next.

    thc launch --workers 4 --rounds 30 --dim 1048576 --loss P

Paths:
  transport  loss injected in the workers' transport (`--loss P`: each datagram a worker sends
             or receives is dropped with probability P), the PS and the workers in a network
             namespace of their own (loopback only, `thc_ps.deploy.netns.one_host`)
  kernel     the PS in one namespace, the workers in another, an nftables rule in the
             workers' dropping P of the datagrams each way (`thc_ps.deploy.netns.two_hosts`;
             THC_UDP_OFFLOAD=0, since nftables sees a UDP GSO batch as one packet)

Either way the namespaces' own kernel counters say what the kernel dropped besides (full
socket buffers on a busy host: `host drops`), and every lost datagram counts: injected or
nft drops plus host drops.  Reported per run: mean round, its ratio to the lossless round of
the same checkout and repetition, packets sent, datagrams lost, timeouts, losses found
without a timer (`fast_losses`: by the PS's notice or the order of results), notices,
resends, and per lost datagram: timeouts and resends; resends beyond the lost datagrams per
100 packets sent (an upper bound of the needless ones: a lost notice needs no resend); and
what the PS saw: resends it dropped as `duplicate` (needless for certain: it held that
contribution and had no result yet) and results it resent.

    .venv/bin/python bench/bench_loss.py --out /tmp/loss                       # both paths, 3 reps
    .venv/bin/python bench/bench_loss.py --paths transport --trees /tmp/base . --reps 5 --out /tmp/loss
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_results  # noqa: E402
from thc_ps.deploy import netns  # noqa: E402

PATHS = ("transport", "kernel")
PORT = 9000


#: the `thc` command's module in a checkout: `thc_ps.deploy.cli` since the project is imported as
#: thc_ps, `deploy.cli` in a checkout from before
CLI_MODULES = ("thc_ps.deploy.cli", "deploy.cli")
_PROBE = "import importlib.util, sys; print(importlib.util.find_spec(sys.argv[1]).origin)"


def cli_module(tree: Path) -> str:
    """The module that runs `thc` from `tree`'s own files.  A checkout without thc_ps/ would
    otherwise import thc_ps from wherever the environment has it installed (an editable
    install of another checkout), and measure that checkout's code under `tree`'s name."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    found = []
    for mod in CLI_MODULES:
        proc = subprocess.run([sys.executable, "-c", _PROBE, mod], capture_output=True, text=True, env=env,
                              cwd=tree, timeout=60)
        origin = proc.stdout.strip()
        if proc.returncode == 0 and origin:
            if Path(origin).resolve().is_relative_to(tree):
                return mod
            found.append(f"{mod} from {origin}")
    raise SystemExit(f"bench_loss: {tree} has no `thc` module of its own to run"
                     + (f" (PYTHONPATH={tree} finds {', '.join(found)})" if found else ""))


def _launch(tree: Path, args, extra: list) -> list:
    return [sys.executable, "-m", args.cli[tree], "launch", "--workers", str(args.workers), "--rounds",
            str(args.rounds), "--dim", str(args.dim), "--seed", str(args.seed), "--json", *extra]


def _doc(proc: subprocess.CompletedProcess) -> dict:
    lines = proc.stdout.strip().splitlines()
    if proc.returncode not in (0, 1) or not lines:
        raise RuntimeError(f"thc launch failed ({proc.returncode}): {proc.stderr.strip()[-600:]}")
    return json.loads(lines[-1])


def run_transport(tree: Path, args, loss: float) -> tuple[dict, int, int]:
    """(launch JSON, datagrams dropped on purpose, datagrams the kernel dropped)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with netns.one_host() as ns:
        before = netns.udp_errors(ns)
        proc = subprocess.run(["ip", "netns", "exec", ns] + _launch(tree, args, ["--loss", str(loss)]),
                              capture_output=True, text=True, env=env, cwd=tree, timeout=3600)
        host = netns.udp_errors(ns) - before
    doc = _doc(proc)
    inj = doc.get("injected", {})
    return doc, inj.get("injected_drops_out", 0) + inj.get("injected_drops_in", 0), host


def run_kernel(tree: Path, args, loss: float) -> tuple[dict, int, int]:
    env = {**os.environ, "PYTHONPATH": str(tree), "THC_UDP_OFFLOAD": "0"}     # nft drops per datagram
    with netns.two_hosts(loss=loss) as net:
        ps = subprocess.Popen(net.prefix(net.ps_ns) + [
            sys.executable, "-m", args.cli[tree], "ps", "--bind", f"{net.ps_ip}:{PORT}", "--workers",
            str(args.workers), "--stats-every", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=env, cwd=tree)
        try:
            time.sleep(2.0)
            before = netns.udp_errors(net.ps_ns) + netns.udp_errors(net.worker_ns)
            proc = subprocess.run(net.prefix(net.worker_ns) + _launch(tree, args, ["--ps", f"{net.ps_ip}:{PORT}"]),
                                  capture_output=True, text=True, env=env, cwd=tree, timeout=3600)
            host = netns.udp_errors(net.ps_ns) + netns.udp_errors(net.worker_ns) - before
            dropped = net.nft_drops() if loss else 0
        finally:
            ps.terminate()
            ps.wait(10)
    return _doc(proc), dropped, host


RUNNERS = {"transport": run_transport, "kernel": run_kernel}


def row(path: str, tree: str, rep: int, loss: float, doc: dict, dropped: int, host: int) -> dict:
    """One run's figures (keys a checkout before the loss notices lacks count as 0)."""
    ps = doc.get("ps_job") or doc.get("ps") or {}
    lost = dropped + host
    r = {"path": path, "tree": tree, "rep": rep, "loss": loss, "exact": doc["exact_rounds"], "rounds": doc["rounds"],
         "ok": doc["ok"], "mean_round_ms": doc["mean_round_ms"], "packets_sent": doc["packets_sent"],
         "dropped": dropped, "host_drops": host, "timeouts": doc["timeouts"],
         "fast_losses": doc.get("fast_losses", 0), "notices": doc.get("notices", 0),
         "retransmissions": doc["retransmissions"], "ps_notices": ps.get("notices", 0),
         "ps_duplicates": (ps.get("drops") or {}).get("duplicate", 0), "ps_results_resent": ps.get("results_resent", 0)}
    r["timeouts_per_loss"] = r["timeouts"] / lost if lost else None
    r["resends_per_loss"] = r["retransmissions"] / lost if lost else None
    r["beyond_per_100"] = 100 * max(0, r["retransmissions"] - lost) / r["packets_sent"] if r["packets_sent"] else None
    return r


def _med(rows: list, key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def table(rows: list) -> str:
    """Medians over the repetitions, per path, checkout and loss."""
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    out = ["| path | checkout | loss | runs exact | mean round | × lossless | timeouts / lost | resends / lost | "
           "beyond lost / 100 sent | lost (host) | found without a timer | PS: notices / duplicates |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["path"], r["tree"], r["loss"]) for r in rows}, key=lambda k: (PATHS.index(k[0]), k[1], k[2]))
    for path, tree, loss in keys:
        rs = [r for r in rows if (r["path"], r["tree"], r["loss"]) == (path, tree, loss)]
        out.append(
            f"| {path} | {tree} | {loss:g} | {sum(r['exact'] == r['rounds'] for r in rs)}/{len(rs)} | "
            f"{_med(rs, 'mean_round_ms'):.1f} ms | {f(_med(rs, 'ratio'), '.2f')} | {f(_med(rs, 'timeouts_per_loss'), '.2f')} | "
            f"{f(_med(rs, 'resends_per_loss'), '.2f')} | {f(_med(rs, 'beyond_per_100'), '.3f')} | "
            f"{_med(rs, 'dropped') + _med(rs, 'host_drops'):.0f} ({_med(rs, 'host_drops'):.0f}) | "
            f"{_med(rs, 'fast_losses'):.0f} | {_med(rs, 'ps_notices'):.0f} / {_med(rs, 'ps_duplicates'):.0f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--losses", type=float, nargs="+", default=[0.001, 0.01],
                    help="loss rates each way (lossless runs come before, between and after them)")
    ap.add_argument("--trees", type=Path, nargs="+", default=[ROOT],
                    help="checkouts to run the command from (each with its C extensions built)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--dim", type=int, default=1 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="directory for loss.json and loss.md")
    args = ap.parse_args(argv)
    if not all(0 < x < 1 for x in args.losses):
        ap.error("--losses must be probabilities in (0, 1)")
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    trees = [t.resolve() for t in args.trees]
    if missing := [str(t) for t in trees if not (t / "deploy" / "cli.py").is_file()]:
        ap.error(f"not a THC-PS checkout: {', '.join(missing)}")
    args.cli = {t: cli_module(t) for t in trees}
    reason = netns.unavailable(need_nft="kernel" in args.paths)
    if reason:
        print(f"bench_loss: {reason}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    names = [t.name if t != ROOT else "this" for t in trees]
    rows, failed = [], []
    for rep in range(args.reps):
        order = list(zip(names, trees))
        for path in args.paths:
            for name, tree in (order if rep % 2 == 0 else order[::-1]):
                group = []
                for loss in [0.0] + [x for p in args.losses for x in (p, 0.0)]:
                    t0 = time.monotonic()
                    r = row(path, name, rep, loss, *RUNNERS[path](tree, args, loss))
                    group.append(r)
                    if r["exact"] != r["rounds"] or not r["ok"]:
                        failed.append(f"{path} {name} loss {loss} rep {rep}: {r['exact']}/{r['rounds']} exact")
                    print(f"{path} {name} rep {rep} loss {loss:g}: round {r['mean_round_ms']:.1f} ms, "
                          f"{r['exact']}/{r['rounds']} exact, lost {r['dropped']} + "
                          f"{r['host_drops']} host, timeouts {r['timeouts']}, found without a timer "
                          f"{r['fast_losses']}, resends {r['retransmissions']}, PS notices {r['ps_notices']} "
                          f"duplicates {r['ps_duplicates']} ({time.monotonic() - t0:.0f} s)", flush=True)
                lossless = [r["mean_round_ms"] for r in group if r["loss"] == 0]
                for i, r in enumerate(group):       # against the lossless runs beside it (or all of them)
                    ref = (group[i - 1]["mean_round_ms"] + group[i + 1]["mean_round_ms"]) / 2 if r["loss"] \
                        else statistics.mean(lossless)
                    r["ratio"] = r["mean_round_ms"] / ref
                    if r["loss"]:
                        print(f"{path} {name} rep {rep} loss {r['loss']:g}: x{r['ratio']:.2f} the lossless "
                              f"rounds beside it", flush=True)
                rows += group
    doc = {"command": " ".join(["bench/bench_loss.py"] + (argv if argv is not None else sys.argv[1:])),
           "workers": args.workers, "rounds": args.rounds, "dim": args.dim, "trees": dict(zip(names, map(str, trees))),
           "rows": rows, "load": os.getloadavg()}
    return write_results(args.out, "loss", doc, table(rows), failed)


if __name__ == "__main__":
    raise SystemExit(main())
