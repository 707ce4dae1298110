"""Stragglers of any length: one worker process paused (SIGSTOP … SIGCONT) or cut off from
the network (a partition of its namespace), for longer or shorter than its lease, with a real
`thc ps` and real `thc worker` processes.  Every case must end exact, or end non-zero with
the missing rank named, within a bound.  Prints a markdown table (docs/reliability.md holds a
run); tests/test_stragglers.py runs the same cases.

    .venv/bin/python bench/pauses.py                # CASES: pauses 3, 10, 40 s; quorum 1 and 0.66
    .venv/bin/python bench/pauses.py --partition    # PARTITION_CASES (root, ip, nft)
    .venv/bin/python bench/pauses.py --keep DIR     # also keep each case's logs and reports in DIR
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thc_ps.deploy.launch import check_rounds  # noqa: E402
from thc_ps.proto import control  # noqa: E402
from thc_ps.proto.job import JobConfig  # noqa: E402

THC = [sys.executable, "-m", "thc_ps.deploy.cli"]
#: (pause s, quorum, rounds, compute ms per round) of the standard run and of
#: tests/test_stragglers.py: a quorum job outlasts its pause, so the paused rank can come back
#: into it; a quorum-1 job waits for it (lease 5 s, rejoin grace 30 s, d = 4096).  A quorum
#: job outlasts it on its pacing alone (the rounds after the stop × the compute ms, whatever
#: the rounds themselves take): the pause, and past the lease the lease and a second more.  On
#: a fast host 4000 rounds of 2 ms did not: the survivors of the 10 s partition ran them in
#: 2.6 ms each and ended the job before the victim was back (docs/reliability.md).
CASES = [(3, 1.0, 600, 2.0), (10, 1.0, 600, 2.0), (40, 1.0, 600, 2.0),
         (3, 0.66, 3000, 2.0), (10, 0.66, 4500, 4.0), (40, 0.66, 4000, 12.0)]
PARTITION_CASES = [(10, 1.0, 600, 2.0), (10, 0.66, 4500, 4.0)]
DIM = 4096
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class PauseResult:
    """One case: what was done to the victim and how every process ended."""

    how: str                      # "sigstop" or "partition"
    pause_s: float
    quorum: float
    lease_s: float
    grace_s: float
    victim: int
    exit: dict = field(default_factory=dict)       # rank -> exit status
    seconds: float = 0.0                            # from the pause to the last exit
    rounds: int = 0
    exact_rounds: int = 0
    mismatched_chunks: int = 0
    lost_chunks: int = 0
    victim_rounds: int = 0                          # rounds the victim reported
    lease_rejoins: int = 0
    catch_up_missed: int = 0
    messages: dict = field(default_factory=dict)    # rank -> last stderr line
    ps_stats: dict = field(default_factory=dict)
    kept: str = ""                                  # where the case's logs and reports were kept

    @property
    def ok(self) -> bool:
        """Exact, or non-zero exits whose messages name the victim."""
        if self.mismatched_chunks or self.lost_chunks:
            return False
        failed = [r for r, rc in self.exit.items() if rc != 0]
        return all(f"rank {self.victim}" in self.messages.get(r, "") for r in failed)

    def outcome(self) -> str:
        failed = sorted(r for r, rc in self.exit.items() if rc != 0)
        if not failed:
            return (f"all exit 0; victim rejoined {self.lease_rejoins}× and reported "
                    f"{self.victim_rounds} rounds")
        return "; ".join(f"rank {r} exit {self.exit[r]}: {self.messages.get(r, '')[:160]}" for r in failed)


def free_port_pair() -> int:
    """A port P with UDP P and TCP P+1 free on 127.0.0.1."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.bind(("127.0.0.1", 0))
            port = u.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as t:
                t.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair on 127.0.0.1")


def ps_status(host: str, port: int, timeout_s: float = 1.0) -> dict | None:
    """The PS's `status` reply, or None when it does not answer within timeout_s."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port + 1}")
        sock.send(control.encode({"type": "status"}))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return control.decode(sock.recv())
    finally:
        sock.close(0)


def _wait_for(pred, bound_s: float, what: str):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {bound_s:g} s waiting for {what}")


def run_pause(pause_s: float, quorum: float, *, how: str = "sigstop", workers: int = 3,
              rounds: int = 4000, dim: int = DIM, lease_s: float = 5.0, grace_s: float = 30.0,
              victim: int = 2, stop_at_round: int = 50, bound_s: float | None = None,
              compute_ms: float = 2.0, log=None, keep: str | Path | None = None) -> PauseResult:
    """Run one case and return its result.  `how`: "sigstop" pauses the victim's process;
    "partition" runs the victim in a network namespace of its own and drops every packet
    in and out of it for `pause_s` (root, ip, nft).  `bound_s` (default: pause + lease +
    grace + 120 s) is how long the processes may take after the pause before they are
    killed and the case counts as hung.  `compute_ms` paces every worker's rounds (the
    time a real step computes its gradient), so that a quorum job outlasts the pause.
    `keep`: a directory to copy every worker's stderr and round report and the PS's output
    into (a rare failure can then be read afterwards; `kept` in the result names it)."""
    job = JobConfig(num_workers=workers, quorum=quorum)
    bound_s = bound_s if bound_s is not None else pause_s + lease_s + grace_s + 120
    res = PauseResult(how, pause_s, quorum, lease_s, grace_s, victim)
    with tempfile.TemporaryDirectory(prefix="thc-pause-") as tmp, _hosts(how) as net:
        host = net.ps_ip if net else "127.0.0.1"
        port = free_port_pair() if net is None else 9300
        env = dict(os.environ, PYTHONPATH=str(ROOT), THC_UDP_OFFLOAD="0" if net else
                   os.environ.get("THC_UDP_OFFLOAD", "1"))
        ps_cmd = THC + ["ps", "--bind", f"{host}:{port}", "--workers", str(workers), "--quorum", str(quorum),
                        "--lease-s", str(lease_s), "--stats-every", "0"]
        if grace_s != 30.0:                      # the PS's default
            ps_cmd += ["--rejoin-grace-s", str(grace_s)]
        ps = subprocess.Popen((net.prefix(net.ps_ns) if net else []) + ps_cmd, env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs = {}
        try:
            _wait_for(lambda: _status(net, host, port), 30, "the PS to answer")
            for r in range(workers):
                prefix = net.prefix(net.worker_ns if r == victim else net.ps_ns) if net else []
                cmd = THC + ["worker", "--ps", f"{host}:{port}", "--rank", str(r), "--workers", str(workers),
                             "--quorum", str(quorum), "--rounds", str(rounds), "--dim", str(dim),
                             "--straggler-delay-ms", str(compute_ms), "--report", f"{tmp}/rank{r}.json"]
                procs[r] = subprocess.Popen(prefix + cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                            stderr=open(f"{tmp}/rank{r}.err", "w"))
            _wait_for(lambda: ((_status(net, host, port) or {}).get("progress", {}).get(str(victim), -1)
                               >= stop_at_round), 60, f"rank {victim} to reach round {stop_at_round}")
            if log:
                log(f"{how} rank {victim} for {pause_s:g} s (quorum {quorum}, lease {lease_s:g} s, "
                    f"grace {grace_s:g} s)")
            t0 = time.monotonic()
            _cut(how, net, procs[victim], True)
            time.sleep(pause_s)
            _cut(how, net, procs[victim], False)
            deadline = t0 + pause_s + bound_s
            for r, p in procs.items():
                try:
                    res.exit[r] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                    res.exit[r] = "hung"
            res.seconds = time.monotonic() - t0
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
            ps.send_signal(signal.SIGINT)
            try:
                out, _ = ps.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                ps.kill()
                out, _ = ps.communicate()
        finals = [line for line in out.splitlines() if line.startswith("final stats")]
        if finals:
            res.ps_stats = json.loads(finals[-1].split(": ", 1)[1])
        per_worker = {}
        for r in range(workers):
            lines = [ln for ln in Path(f"{tmp}/rank{r}.err").read_text().splitlines() if ln.strip()]
            res.messages[r] = next((ln for ln in reversed(lines) if ": error:" in ln or "thc worker:" in ln),
                                   lines[-1] if lines else "")
            report = Path(f"{tmp}/rank{r}.json")
            if report.exists():
                doc = json.loads(report.read_text())
                per_worker[r] = doc["rounds"]
                res.lease_rejoins += doc["transport"].get("lease_rejoins", 0)
                res.catch_up_missed += doc["transport"].get("catch_up_missed_rounds", 0)
        res.victim_rounds = len(per_worker.get(victim, []))
        if per_worker:
            chk = check_rounds(job, 0, dim, per_worker)
            res.rounds, res.exact_rounds = chk["rounds"], chk["exact_rounds"]
            res.mismatched_chunks, res.lost_chunks = chk["mismatched_chunks"], chk["lost_chunks"]
        if keep is not None:
            res.kept = str(_keep(Path(tmp), Path(keep), out))
    return res


def _keep(tmp: Path, dest: Path, ps_out: str) -> Path:
    """Copy a case's worker stderr and reports (rank*.err, rank*.json) and the PS's output
    (ps.log) from its temporary directory to `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(tmp.glob("rank*.err")) + sorted(tmp.glob("rank*.json")):
        shutil.copyfile(f, dest / f.name)
    (dest / "ps.log").write_text(ps_out)
    return dest


def _status(net, host, port):
    if net is None:
        return ps_status(host, port)
    out = subprocess.run(net.prefix(net.ps_ns) + [sys.executable, "-c",
                         "import json,sys; sys.path.insert(0, sys.argv[3]); from bench.pauses import ps_status; "
                         "print(json.dumps(ps_status(sys.argv[1], int(sys.argv[2]))))", host, str(port), str(ROOT)],
                         capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout or "null")


@contextlib.contextmanager
def _hosts(how: str):
    if how != "partition":
        yield None
        return
    from thc_ps.deploy import netns
    netns.check_available(need_nft=True)
    with netns.two_hosts(ps_ports=(9300, 9301)) as net:
        yield net


def _cut(how: str, net, proc, on: bool) -> None:
    if how == "sigstop":
        os.kill(proc.pid, signal.SIGSTOP if on else signal.SIGCONT)
    else:
        from thc_ps.deploy import netns
        (netns.partition if on else netns.heal)(net.worker_ns)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--partition", action="store_true", help="cut the victim's namespace off instead of "
                    "SIGSTOP (root, ip, nft): PARTITION_CASES")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON here")
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep each case's worker logs and reports "
                    "and the PS's output under DIR/<how>-<pause>s-q<quorum>")
    args = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)
    results = []
    for pause, q, rounds, compute in PARTITION_CASES if args.partition else CASES:
        how = "partition" if args.partition else "sigstop"
        keep = Path(args.keep) / f"{how}-{pause:g}s-q{q:g}" if args.keep else None
        results.append(run_pause(pause, q, how=how, rounds=rounds, compute_ms=compute, log=log, keep=keep))
        log(f"  -> {results[-1].outcome()} ({results[-1].seconds:.1f} s)")
    print("| how | pause | quorum | lease / grace | exact rounds | lost | victim rounds | "
          "catch-up missed | seconds | outcome | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.how} | {r.pause_s:g} s | {r.quorum:g} | {r.lease_s:g} / {r.grace_s:g} s | "
              f"{r.exact_rounds}/{r.rounds} | {r.lost_chunks} | {r.victim_rounds} | {r.catch_up_missed} | "
              f"{r.seconds:.1f} | {r.outcome()} | {'yes' if r.ok else 'NO'} |")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) | {"ok": r.ok} for r in results], indent=1))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
