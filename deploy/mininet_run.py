"""`thc p4 mininet`: real `thc worker`s through one bmv2 switch in Mininet, checked exactly.

The venv side of p4/harness/mininet_thc.py (the switch's program and control plane are p4/'s;
this runner, like the other launchers, is deploy/'s).  It finds the tools (p4/tools.py), builds the
program if needed, writes the switch's commands and the loss ruleset, and runs the harness
in Debian's python3 inside a network namespace *and* a PID namespace it creates:

    ip netns exec thcmn-XXXX unshare --pid --fork --kill-child --mount-proc /usr/bin/python3 harness

When the harness ends — normally, on error, on Ctrl-C or killed — the kernel kills every
process left in the PID namespace (switch, Mininet's host shells, workers); deleting the
network namespace then removes the switch-side interfaces, and the hosts' namespaces go
with their last process.  Afterwards every chunk of every round is checked against the
in-process reference (thc_ps.deploy.launch.check_rounds), and the switch's counters are shown next
to the workers' summary.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from thc_ps.p4 import tools
from thc_ps.p4.control import (EVENTS, SWITCH_LEASE_S, WorkerPort, choose_control, ensure_program, job_commands,
                               l2_commands, p4info_path, parse_events, switch_job, worker_commands)
from thc_ps.p4.spec import EVENT_CELLS, MAX_JOBS

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "p4" / "harness" / "mininet_thc.py"
PS_MAC, CTRL_MAC = "00:00:00:00:00:fe", "00:00:00:00:00:64"
PS_PORT = 9000
NETNS_PREFIX = "thcmn-"


def worker_ports(n: int) -> list:
    """Where the harness puts worker i: 10.0.0.(i+1), UDP 5000+i, switch port i+1."""
    return [WorkerPort(i, f"10.0.0.{i + 1}", 5000 + i, f"00:00:00:00:00:{i + 1:02x}", i + 1) for i in range(n)]


def static_identity(n: int) -> tuple[int, list]:
    """A random job nonce and worker tokens for a switch programmed before registration."""
    import secrets
    return secrets.randbits(32) or 1, [secrets.randbits(32) for _ in range(n)]


def switch_commands(job, mode: str, nonce: int = 0, tokens: list | None = None, jobs: int = 1) -> list[str]:
    """L2 entries for every host (`jobs` × n workers and the control host); with mode 'static'
    (one job) also the job (with its nonce) and every worker's entries (with its token); with
    'p4run', `thc p4 run --attach` programs those."""
    hosts = worker_ports(jobs * job.num_workers)
    workers = hosts[:job.num_workers]
    cmds = l2_commands({w.mac: w.switch_port for w in hosts} | {CTRL_MAC: len(hosts) + 1})
    if mode == "static":
        cmds += job_commands(job, PS_MAC, nonce)
        for handle, w in enumerate(workers):
            cmds += worker_commands(w, handle, (tokens or [0] * len(workers))[handle])
    return cmds


def loss_ruleset(loss: float, port: int = PS_PORT) -> str:
    """nftables ruleset for a worker host: drop THC datagrams to and from the switch's PS
    address with probability `loss` each way (numgen random; this kernel has no netem)."""
    per_million = int(round(loss * 1_000_000))
    rule = f"numgen random mod 1000000 < {per_million} counter drop"
    return ("table inet thcloss {\n"
            f"  chain output {{ type filter hook output priority 0; udp dport {port} {rule}; }}\n"
            f"  chain input {{ type filter hook input priority 0; udp sport {port} {rule}; }}\n"
            "}\n")


def nft_dropped(listing: str) -> int:
    """Packets dropped according to an `nft list table` output."""
    return sum(int(n) for n in re.findall(r"counter packets (\d+)", listing))


def switch_control(requested: str, mode: str) -> tuple[str, str]:
    """The switch's control plane for a run (thc_ps.p4.control.choose_control), and why: a switch
    programmed in advance (`static`) is programmed by the harness through the Thrift CLI."""
    if mode == "static":
        if requested == "p4runtime":
            raise ValueError("--switch-control p4runtime needs --control-mode p4run (`thc p4 run --attach` "
                             "programs the switch; the static mode's harness writes Thrift CLI commands)")
        return "thrift", "--control-mode static programs the switch through the Thrift CLI"
    return choose_control(requested)


def preflight(loss: float, control: str = "thrift") -> dict:
    """The tools the run needs, or a one-line error naming the missing one."""
    if os.geteuid() != 0:
        raise PermissionError("thc p4 mininet needs root (network and PID namespaces, Mininet)")
    found = {name: tools.require(name) for name in tools.BMV2_HALF}
    if control == "p4runtime":
        found["simple_switch"] = tools.require("simple_switch_grpc")
    found["python"] = tools.mininet_python()
    if found["python"] is None:
        raise FileNotFoundError(f"Mininet does not import in Debian's {tools.DEBIAN_PYTHON}: it comes from "
                                f"{tools.SOURCES['mininet']}")
    for name in ("ip", "ethtool") + (("nft",) if loss > 0 else ()):
        if tools.system_tool(name) is None:
            raise FileNotFoundError(f"{name} not found: it comes from {tools.SOURCES[name]}")
    if tools.system_tool("unshare") is None:
        raise FileNotFoundError("unshare not found: it comes from Debian package util-linux")
    return found


def netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def teardown(proc: subprocess.Popen | None, ns: str, grace: float = 30.0) -> None:
    """Stop the harness (SIGINT to it, so Mininet stops its hosts; then SIGKILL to unshare,
    which kills the PID namespace), kill whatever is left in the network namespace, delete it.
    A second Ctrl-C does not interrupt this."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _teardown(proc, ns, grace)
    finally:
        signal.signal(signal.SIGINT, previous)


def _teardown(proc: subprocess.Popen | None, ns: str, grace: float) -> None:
    if proc is not None and proc.poll() is None:
        for child in _children(proc.pid):           # the harness: PID 1 of the new namespace
            try:
                os.kill(child, signal.SIGINT)
            except ProcessLookupError:
                pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()                              # --kill-child: the namespace goes with it
            proc.wait(10)
    if ns in netns_list():
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run(*, workers: int = 4, rounds: int = 20, dim: int = 4096, loss: float = 0.0,
        straggler_delay_ms: float = 0.0, straggler_rank: int | None = None, quorum: float = 1.0,
        granularity: int = 30, p: str = "1/32", policy: str = "retransmit", control: str = "static",
        timeout_ms: float = 200.0, fixed_timeout: bool = False, build_dir: str | Path = "build/p4",
        worker_timeout_s: float = 900.0, jobs: int = 1, switch: str = "auto", lease_s: float = SWITCH_LEASE_S,
        log=None) -> dict:
    """One Mininet run of `jobs` jobs of `workers` workers each at once; returns the summary
    (check per job and in all, workers' counters, switch counters)."""
    from thc_ps.deploy.launch import check_rounds
    job = switch_job(workers, quorum=quorum, granularity=granularity, p=p)   # refuses n*g > 255
    if straggler_rank is not None and not 0 <= straggler_rank < workers:
        raise ValueError(f"--straggler-rank must be in 0..{workers - 1}")
    if not 1 <= jobs <= MAX_JOBS:
        raise ValueError(f"--jobs must be in 1..{MAX_JOBS} (the jobs the switch holds at once)")
    if jobs > 1 and control != "p4run":
        raise ValueError("--jobs above 1 needs --control-mode p4run: a switch programmed in advance "
                         "holds one job")
    log = log or (lambda m: None)
    switch, why = switch_control(switch, control)
    log(f"switch control plane: {switch} ({why})")
    found = preflight(loss, switch)
    json_path = ensure_program(build_dir)
    ns = f"{NETNS_PREFIX}{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="thc-mininet-") as tmp:
        tmpd = Path(tmp)
        os.chmod(tmpd, 0o755)
        nonce, tokens = static_identity(workers)
        (tmpd / "cmds.txt").write_text("\n".join(switch_commands(job, control, nonce, tokens, jobs)) + "\n")
        cmd = [found["python"], str(HARNESS), "--json", str(Path(json_path).resolve()),
               "--commands", str(tmpd / "cmds.txt"), "--simple-switch", found["simple_switch"],
               "--simple-switch-cli", found["simple_switch_CLI"], "--python", sys.executable,
               "--repo", str(ROOT), "--out", str(tmpd), "--workers", str(workers), "--rounds", str(rounds),
               "--dim", str(dim), "--quorum", str(quorum), "--granularity", str(granularity), "--p", str(p),
               "--loss-policy", policy,
               "--straggler-delay-ms", str(straggler_delay_ms),
               "--straggler-rank", str(-1 if straggler_rank is None else straggler_rank),
               "--timeout-ms", str(timeout_ms), "--worker-timeout-s", str(worker_timeout_s),
               "--lease-s", str(lease_s),
               *(["--fixed-timeout"] if fixed_timeout else []),
               "--control-mode", control, "--nonce", str(nonce),
               "--tokens", ",".join(map(str, tokens)), "--events", str(len(EVENTS)),
               "--event-cells", str(EVENT_CELLS), "--jobs", str(jobs), "--switch-control", switch,
               "--p4info", str(p4info_path(json_path).resolve())]
        if loss > 0:
            (tmpd / "loss.nft").write_text(loss_ruleset(loss))
            cmd += ["--loss-rules", str(tmpd / "loss.nft")]
        proc = None
        t0 = time.monotonic()
        try:
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
            subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
            log(f"mininet: {jobs * workers} hosts + bmv2 switch in namespace {ns}; {jobs} job(s) of "
                f"{workers} workers, {rounds} rounds of d={dim}")
            with open(tmpd / "harness.out", "w") as out, open(tmpd / "harness.err", "w") as err:
                proc = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--pid", "--fork",
                                         "--kill-child", "--mount-proc"] + cmd,
                                        stdout=out, stderr=err, cwd=ROOT, start_new_session=True)
                proc.wait(worker_timeout_s + 120)
        except KeyboardInterrupt:
            raise RuntimeError(f"interrupted; Mininet, the switch and the workers are stopped and "
                               f"namespace {ns} is removed") from None
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the Mininet run did not finish within {worker_timeout_s + 120:.0f} s; "
                               f"stopped and removed") from None
        finally:
            teardown(proc, ns)
        seconds = time.monotonic() - t0
        stdout = (tmpd / "harness.out").read_text()
        stderr = (tmpd / "harness.err").read_text()
        if proc.returncode != 0 or not stdout.strip():
            raise RuntimeError(f"the Mininet harness failed (status {proc.returncode}): "
                               f"{_last_lines(stderr or stdout)}")
        doc = json.loads(stdout.strip().splitlines()[-1])
        bad = [w for w in doc["workers"] if w["rc"] != 0]
        if bad:                         # every failed worker: the first to fail may be any of them
            raise RuntimeError("; ".join(_worker_failure(w, jobs, worker_timeout_s) for w in bad)
                               + f" | control plane: {_last_lines(doc['control'], 8)}")
        reports = {k: json.loads((tmpd / f"worker{k}.json").read_text()) for k in range(jobs * workers)}
    per_job = [check_rounds(job, 0, dim, {i: reports[j * workers + i]["rounds"] for i in range(workers)})
               for j in range(jobs)]
    check = {key: sum(c[key] for c in per_job) for key in per_job[0]}
    total = lambda key: int(sum(r["transport"][key] for r in reports.values()))
    round_s = [r["seconds"] for rep in reports.values() for r in rep["rounds"]]
    busy = max(sum(r["seconds"] for r in rep["rounds"]) for rep in reports.values())
    return {**check, "jobs": jobs, "per_job": per_job, "workers": workers, "dim": dim, "quorum": quorum,
            "loss": loss, "policy": policy,
            "straggler_delay_ms": straggler_delay_ms, "straggler_rank": straggler_rank, "control": control,
            "switch_control": switch,
            "chunks_per_round": len(reports[0]["rounds"][0]["digest"]) + 1,   # DATA chunks + one NORM
            "seconds": seconds, "mean_round_ms": 1e3 * sum(round_s) / len(round_s),
            "packets_sent": total("packets_sent"),
            "packets_per_s": total("packets_sent") / busy if busy else None,
            "retransmissions": total("retransmissions"), "timeouts": total("timeouts"),
            "fast_losses": total("fast_losses"), "fixed_timeout": fixed_timeout,
            "rto_ms": max(r["transport"].get("rto_ms", 0.0) for r in reports.values()),
            "straggler_notices": total("straggler_notices"), "lost_chunks_reported": total("lost_chunks"),
            "kernel_drops": sum(nft_dropped(t) for t in doc["nft"]),
            "switch": parse_events(doc["counters"], jobs + 1), "netns_left": ns in netns_list(),
            "control_output": doc["control"]}


def _worker_failure(w: dict, jobs: int, timeout_s: float) -> str:
    which = f" of job {w['job'] + 1}" if jobs > 1 else ""
    how = f"did not finish within {timeout_s:g} s" if w.get("timed_out") else f"exited with status {w['rc']}"
    return f"worker {w['rank']}{which} {how}: {_last_lines(w['stderr'] or w['stdout'])}"


def _last_lines(text: str, n: int = 3) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:]) or "(no output)"


def failed(doc: dict) -> str | None:
    """Why a run is not a success, or None: any chunk not exact, or lost under retransmit."""
    if doc["mismatched_chunks"]:
        return f"{doc['mismatched_chunks']} chunks differ from the reference"
    if doc["policy"] == "retransmit" and doc["lost_chunks"]:
        return f"{doc['lost_chunks']} chunks lost under retransmit"
    if doc["exact_rounds"] != doc["rounds"] and doc["policy"] == "retransmit":
        return f"only {doc['exact_rounds']} of {doc['rounds']} rounds exact"
    return None


def summary_text(doc: dict) -> str:
    """The workers' summary beside the switch's counters."""
    sw = doc["switch"]
    drops = {k: sw[k] for k in EVENTS[:9] if sw[k]}
    left = [
        f"rounds {doc['rounds']}, exact {doc['exact_rounds']} "
        f"({doc['rounds'] * doc['chunks_per_round']} chunk rounds)",
        f"mismatched chunks {doc['mismatched_chunks']}",
        f"lost chunks {doc['lost_chunks']}",
        f"retransmissions {doc['retransmissions']}",
        f"timeouts {doc['timeouts']}",
        f"retransmission timeout {doc.get('rto_ms', 0):.0f} ms" + (" (fixed)" if doc.get("fixed_timeout") else ""),
        f"straggler notices {doc['straggler_notices']}",
        f"packets sent {doc['packets_sent']}",
        f"kernel (nft) drops {doc['kernel_drops']}",
        f"mean round {doc['mean_round_ms']:.1f} ms",
    ]
    right = [
        f"rounds_completed {sw['rounds_completed']}",
        f"partial_rounds {sw['partial_rounds']}",
        f"results_resent {sw['results_resent']}",
        f"late {sw['late']}",
        f"duplicate {sw['duplicate']}",
        f"stale (notified) {sw['stale']}",
        f"drops {drops or 'none'}",
        f"~{doc['packets_per_s']:.0f} packets/s sent" if doc["packets_per_s"] else "",
        "",
    ]
    who = "all workers" if doc["straggler_rank"] is None else f"rank {doc['straggler_rank']}"
    jobs = doc.get("jobs", 1)
    if jobs > 1:
        left.append("; ".join(f"job{j + 1}: {c['exact_rounds']}/{c['rounds']} exact"
                              for j, c in enumerate(doc["per_job"])))
        right.append("")
    size = f"{jobs} jobs of {doc['workers']} workers" if jobs > 1 else f"{doc['workers']} workers"
    head = (f"{size} through bmv2 in Mininet ({doc.get('switch_control', 'thrift')} control plane), "
            f"d={doc['dim']}, loss {doc['loss']} "
            f"(nftables on the host links), policy {doc['policy']}, quorum {doc['quorum']}, "
            f"straggler delay {doc['straggler_delay_ms']} ms "
            f"({who})")
    rows = [f"{'workers':<40}| switch counters"] + [f"{a:<40}| {b}" for a, b in zip(left, right)]
    return "\n".join([head] + rows + [f"torn down: namespace removed={not doc['netns_left']}, "
                                      f"{doc['seconds']:.1f} s"])
