"""Control plane for the THC switch program: jobs → writes on the switch, through either of
two backends, and the switch's ZeroMQ control plane for workers.  The tools are found by
p4/tools.py.

What a job needs (tables, multicast groups, counters, by their P4Info names) is
p4/entries.py's; how it gets there is a backend's: `ThriftControl` (text piped into
`simple_switch_CLI`, bmv2 only) or thc_ps.p4.p4runtime.P4RuntimeControl (P4Runtime, for
`simple_switch_grpc` and any P4Runtime server).  `SwitchEngine` and `SwitchJob` work over
either; a batch the switch rejects is taken back before the error reaches the caller, so no
job is ever left half programmed.  The event counters are p4/spec.py's EVENTS, the list the
generator writes into the programs.
"""
from __future__ import annotations

import itertools
import logging
import os
import re
import socket
import subprocess
import time
from pathlib import Path

from thc_ps.p4.entries import (COUNTERS, EVENTS_COUNTER, REGISTERS, THC_TABLES, CounterCells, McGroup, TableEntry,
                        WorkerPort, check_shape, describe, job_writes, l2_entries, replica_entry,
                        rid, undo, worker_entry)
from thc_ps.p4.spec import (DROPS, EVENT_CELLS, EVENTS, LANES, MAX_JOBS, MAX_RANKS, PORT,  # noqa: F401
                     SLOTS)
from thc_ps.p4.tools import cli_problem, require
from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.engine import wait

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
CONTROLS = ("p4runtime", "thrift")

#: The lease of a rank in a switch job run through bmv2 (seconds).  bmv2 carries the control
#: plane's TCP in the queues THC's datagrams fill, and drops from them when they are full: with
#: 8 workers a rank went 5 s without an answered heartbeat ("rank 4 lost its lease (no heartbeat
#: for 5.0 s)"), and in a run where every rank did, the job ended at round 2 (docs/bench.md,
#: "Loss recovery").  A PS's own default (5 s) is for a network that does not drop its control
#: traffic.
SWITCH_LEASE_S = 30.0


def switch_job(num_workers: int, *, bits: int = 4, granularity: int = 30, p="1/32", quorum: float = 1.0,
               seed: int = 0, slots: int = 64, norm_slots: int = 8, job_id: int = 1) -> JobConfig:
    """A job shaped for the switch: LANES 4-bit indices per packet, 8-bit lanes."""
    if bits != 4:
        raise ValueError("the switch program carries 4-bit indices")
    if slots + norm_slots > SLOTS:
        raise ValueError(f"slots + norm_slots must be at most {SLOTS} (the program's register size)")
    return JobConfig(num_workers=num_workers, job_id=job_id, codec="thc", bits=bits, granularity=granularity,
                     p=p, lane_bits=8, seed=seed, slots=slots, norm_slots=norm_slots,
                     elems_per_packet=LANES, quorum=quorum)


# --------------------------------------------------------------------------- Thrift (simple_switch_CLI)

def _values(pairs: tuple) -> str:
    return " ".join(str(v) for _, v in pairs)


def table_add(e: TableEntry) -> str:
    return f"table_add {e.table} {e.action} {_values(e.match)} => {_values(e.params)}"


def job_commands(job: JobConfig, ps_mac: str, nonce: int = 0, base: int = 0, cell: int = 1,
                 epoch: int = 1) -> list[str]:
    """A job's writes (thc_ps.p4.entries.job_writes) as simple_switch_CLI commands, for a switch
    programmed in advance."""
    return [c for op, item in job_writes(job, ps_mac, nonce, base, cell, epoch)
            for c in ThriftControl.commands(op, item)]


def worker_commands(w: WorkerPort, node_handle: int, token: int = 0, job_id: int = 1, cell: int = 1) -> list[str]:
    """A rank's entries on a switch programmed in one batch: its registration, its multicast
    node (which bmv2 numbers `node_handle`: nodes are numbered from 0 in creation order) in
    the job's group, and its replica's rewrite."""
    return [table_add(worker_entry(w, token, job_id)),
            f"mc_node_create {rid(cell, w.worker_id)} {w.switch_port}",
            f"mc_node_associate {cell} {node_handle}",
            table_add(replica_entry(w, cell))]


def l2_commands(hosts: dict) -> list[str]:
    """Plain forwarding of non-THC traffic: {mac: switch port}."""
    return [table_add(e) for e in l2_entries(hosts)]


def reset_commands() -> list[str]:
    """Every register and counter of the switch to zero (all jobs)."""
    return [f"register_reset {r}" for r in REGISTERS] + [f"counter_reset {c}" for c in COUNTERS]


class SwitchCLI:
    """Runs simple_switch_CLI batches against one switch."""

    def __init__(self, thrift_port: int = 9090, netns: str | None = None):
        self.thrift_port = thrift_port
        self.netns = netns
        self.cli = require("simple_switch_CLI")

    def run(self, commands: list[str], check: bool = True) -> str:
        log.debug("switch CLI (Thrift port %d): %d commands, first %r", self.thrift_port, len(commands),
                  commands[0] if commands else None)
        cmd = [self.cli, "--thrift-port", str(self.thrift_port)]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns] + cmd
        out = subprocess.run(cmd, input="\n".join(commands) + "\n", capture_output=True, text=True,
                             timeout=120)
        if check and (out.returncode != 0 or _failed(out.stdout)):
            bad = [line for line in out.stdout.splitlines() if _failed(line)]
            raise RuntimeError(f"simple_switch_CLI failed: {bad[:5] or out.stderr[-500:]}")
        return out.stdout


def _failed(text: str) -> bool:
    return "Error" in text or "Invalid" in text


#: simple_switch_CLI's prompt, printed before each command it reads
PROMPT = "RuntimeCmd:"


class ThriftError(RuntimeError):
    """A CLI batch with failed commands: `rejected` [(op, item, message)], `applied` [(op, item)]."""

    def __init__(self, message: str, rejected: list, applied: list):
        super().__init__(message)
        self.rejected, self.applied = rejected, applied


class ThriftControl:
    """The Thrift backend of SwitchEngine: p4/entries.py's writes as simple_switch_CLI commands,
    one CLI run per batch (two when multicast nodes are made: bmv2 numbers them).  The CLI
    names entries by handle, so this keeps each entry's handle and each group's nodes."""

    name = "thrift"

    def __init__(self, cli: SwitchCLI):
        self.cli = cli
        self.handles: dict = {}         # TableEntry.key -> entry handle
        self.nodes: dict = {}           # group -> {(port, rid): node handle}

    @staticmethod
    def commands(op: str, item) -> list[str]:
        """The commands of a write that need no handle (inserts, counter writes, new groups)."""
        if isinstance(item, TableEntry) and op == "insert":
            return [table_add(item)]
        if isinstance(item, CounterCells):
            return [f"counter_write {item.counter} {i} 0 0" for i in range(item.first, item.first + item.count)]
        if isinstance(item, McGroup) and op == "insert" and not item.replicas:
            return [f"mc_mgrp_create {item.group}"]
        raise ValueError(f"{op} {describe(item)} needs the switch's handles (ThriftControl.write)")

    def take_over(self, max_jobs: int) -> None:
        """Clear what a previous control plane left in the THC tables, registers, counters and
        multicast groups 1..max_jobs; L2 entries (non-THC forwarding) stay."""
        self.cli.run([f"table_clear {t}" for t in THC_TABLES] + reset_commands())
        # groups of an earlier run on an attached switch (absent ones just fail)
        self.cli.run([f"mc_mgrp_destroy {c}" for c in range(1, max_jobs + 1)], check=False)

    def _group_commands(self, op: str, g: McGroup) -> tuple[list, list, list]:
        """(commands, the nodes [(group, port, rid)] they make, in the order of their
        `mc_node_create`, and the members [(port, rid)] they take out).  Nothing is recorded
        here: `write` records what the CLI reports done."""
        have = self.nodes.get(g.group, {})
        want = set(g.replicas) if op != "delete" else set()
        cmds = [f"mc_mgrp_create {g.group}"] if op == "insert" else []
        gone = sorted(set(have) - want)
        for key in gone:
            cmds += [f"mc_node_dissociate {g.group} {have[key]}", f"mc_node_destroy {have[key]}"]
        new = [(g.group, port, r) for port, r in sorted(want - set(have))]
        cmds += [f"mc_node_create {r} {port}" for _, port, r in new]
        if op == "delete":
            cmds.append(f"mc_mgrp_destroy {g.group}")
        return cmds, new, gone

    def _commands(self, op: str, item) -> tuple[list, list, list]:
        if isinstance(item, TableEntry) and op != "insert":
            handle = self.handles.get(item.key)
            if handle is None:
                raise ValueError(f"{op}: no handle for {describe(item)} (not written by this control plane)")
            if op == "delete":
                return [f"table_delete {item.table} {handle}"], [], []
            return [f"table_modify {item.table} {item.action} {handle} => {_values(item.params)}"], [], []
        if isinstance(item, McGroup):
            return self._group_commands(op, item)
        return self.commands(op, item), [], []

    def write(self, writes: list, restoring: bool = False) -> None:
        """One CLI run of every write (and one more to put new multicast nodes in their
        groups); ThriftError naming each failed one.  A multicast group write is several
        commands: when any of them fails, the group is put back to the members it had (a
        failed group write is rejected whole, as a P4Runtime update is)."""
        if not writes:
            return
        before = {item.group: (item.group in self.nodes, dict(self.nodes.get(item.group, {})))
                  for _, item in writes if isinstance(item, McGroup)}
        batch, owner, made, taken = [], [], [], []
        for k, (op, item) in enumerate(writes):
            cmds, new, gone = self._commands(op, item)
            creates = [len(batch) + i for i, c in enumerate(cmds) if c.startswith("mc_node_create")]
            made += [(k, *n, i) for n, i in zip(new, creates)]
            taken += [(k, item.group, key, len(batch) + i)
                      for key, i in zip(gone, (j for j, c in enumerate(cmds) if c.startswith("mc_node_dissociate")))]
            batch += cmds
            owner += [k] * len(cmds)
        outputs = self.run_each(batch)
        bad: dict = {}
        for k, cmd, out in zip(owner, batch, outputs):
            if _failed(out):        # the CLI's last line says why (e.g. `Invalid table operation (TABLE_FULL)`)
                bad.setdefault(k, out.strip().splitlines()[-1][-200:])
            elif cmd.startswith("table_add"):
                op, item = writes[k]
                self.handles[item.key] = _handle(out)
            elif cmd.startswith("table_delete"):
                self.handles.pop(writes[k][1].key, None)
            elif cmd.startswith("mc_mgrp_create"):
                self.nodes.setdefault(int(cmd.split()[1]), {})
            elif cmd.startswith("mc_mgrp_destroy"):
                self.nodes.pop(int(cmd.split()[1]), None)
        for _, group, key, i in taken:           # a member is out once its dissociation is done
            if not _failed(outputs[i]) and group in self.nodes:
                self.nodes[group].pop(key, None)
        assoc, joins, stray = [], [], []
        for k, group, port, r, i in made:
            if _failed(outputs[i]):
                continue
            node = _handle(outputs[i], "created with handle")
            if k not in bad and group not in self.nodes:
                bad[k] = f"multicast group {group} does not exist"
            if k in bad:
                stray.append(node)              # made for a write that failed: not put in a group
            else:
                assoc.append(f"mc_node_associate {group} {node}")
                joins.append((k, group, (port, r), node))
        for (k, group, key, node), out in zip(joins, self.run_each(assoc) if assoc else []):
            if _failed(out):
                bad.setdefault(k, out.strip().splitlines()[-1][-200:])
                stray.append(node)
            else:
                self.nodes[group][key] = node
        if stray:
            self.run_each([f"mc_node_destroy {n}" for n in stray])
        if bad:
            note = "" if restoring else self._restore_groups(
                {writes[k][1].group: before[writes[k][1].group] for k in bad if isinstance(writes[k][1], McGroup)})
            rejected = [(op, item, bad[k]) for k, (op, item) in enumerate(writes) if k in bad]
            applied = [(op, item) for k, (op, item) in enumerate(writes) if k not in bad]
            raise ThriftError(f"simple_switch_CLI (Thrift port {self.cli.thrift_port}) failed {len(rejected)} of "
                              f"{len(writes)} writes; first: {rejected[0][0]} {describe(rejected[0][1])}: "
                              f"{rejected[0][2]}{note}", rejected, applied)

    def _restore_groups(self, groups: dict) -> str:
        """Put each group of a failed write back as it was ({group: (existed, {member: node})});
        '' when done, else a note for the error."""
        for group, (existed, members) in groups.items():
            now = self.nodes.get(group)
            if now is None and not existed:
                continue
            if now is not None and now.keys() == members.keys():
                continue
            op = ("insert" if now is None else "modify") if existed else "delete"
            try:
                self.write([(op, McGroup(group, tuple(sorted(members))))], restoring=True)
            except ThriftError as exc:
                return f" (multicast group {group} could not be put back as it was: {exc})"
        return ""

    def run_each(self, commands: list[str]) -> list[str]:
        """One CLI run; each command's output (the CLI prints its prompt before each)."""
        text = self.cli.run(commands, check=False)
        parts = text.split(PROMPT)[1:]
        if len(parts) < len(commands):
            raise RuntimeError(f"simple_switch_CLI answered {len(parts)} of {len(commands)} commands: {text[-500:]}")
        return parts[:len(commands)]

    def read_counters(self, counter: str, first: int, count: int) -> list[int]:
        text = self.cli.run([f"counter_read {counter} {i}" for i in range(first, first + count)], check=False)
        counts = packet_counts(text)
        if len(counts) != count:
            raise RuntimeError(f"could not read {count} cells of {counter} from the switch CLI:\n{text[-500:]}")
        return counts

    def close(self) -> None:
        """Nothing is held between CLI runs."""


def events(control, cell: int = 0) -> dict:
    """A counter block's events by name (p4/spec.py EVENTS): block 0 is what no job owns."""
    counts = control.read_counters(EVENTS_COUNTER, cell * EVENT_CELLS, len(EVENTS))
    return dict(zip(EVENTS, counts))


def packet_counts(text: str) -> list[int]:
    """The packet counts in `counter_read` output: bmv2's CLI prints either `packets=N`
    (older) or `(B bytes, N packets)` (newer)."""
    return [int(a or b) for a, b in re.findall(r"packets=(\d+)|(\d+) packets", text)]


def parse_events(text: str, blocks: int = 1) -> dict:
    """`counter_read` output of `blocks` event counter blocks read one after the other, as
    {event: packets} summed over the blocks; a missing line is an error."""
    counts = packet_counts(text)
    if len(counts) != blocks * len(EVENTS):
        raise RuntimeError(f"could not read {blocks} x {len(EVENTS)} event counters from the switch CLI:\n"
                           f"{text[-500:]}")
    return {e: sum(counts[b * len(EVENTS) + i] for b in range(blocks)) for i, e in enumerate(EVENTS)}


def apply(control, writes: list, before: dict | None = None) -> None:
    """Write a batch; when the switch rejects any of it, take back what it applied (inverse
    writes, newest first; `before` holds a modified group's previous members) and raise
    one error naming what was rejected."""
    try:
        control.write(writes)
    except (ThriftError, _p4runtime_error()) as exc:
        back = [u for op, item in reversed(exc.applied)
                if (u := undo(op, item, (before or {}).get(getattr(item, "group", None)))) is not None]
        note = "everything else of the batch was taken back"
        try:
            control.write(back)
        except (ThriftError, _p4runtime_error()) as again:
            note = f"taking the rest back failed too: {again}"
        raise SwitchRejected(f"{exc}; {note}", exc.rejected) from exc


def _p4runtime_error():
    from thc_ps.p4.p4runtime import P4RuntimeError
    return P4RuntimeError


class SwitchRejected(RuntimeError):
    """The switch refused a batch (the rest of it was taken back): `rejected` [(op, item, why)]."""

    def __init__(self, message: str, rejected: list):
        super().__init__(message)
        self.rejected = rejected


def compile_program(out_dir: Path | str = "build/p4") -> Path:
    """p4c-bm2-ss p4/thc.p4 → out_dir/thc.json and its P4Info, out_dir/thc.p4info.txtpb."""
    p4c = require("p4c-bm2-ss")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "thc.json"
    proc = subprocess.run([p4c, "--std", "p4-16", "-o", str(target), "--p4runtime-files", str(p4info_path(target)),
                           str(HERE / "thc.p4")], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"p4c-bm2-ss failed:\n{proc.stderr[-3000:]}")
    return target


def p4info_path(json_path: Path | str) -> Path:
    """The P4Info compile_program writes beside a program's JSON."""
    return Path(json_path).with_name(Path(json_path).stem + ".p4info.txtpb")


#: p4c-barefoot's --target and --arch per Tofino generation
TOFINO_TARGETS = {"tofino": "tna", "tofino2": "t2na"}


#: the Tofino program's P4Info, beside its build (compile_tofino)
TNA_P4INFO = "thc_tna.p4info.bin"


def compile_tofino(target: str = "tofino", out_dir: Path | str = "build/tofino",
                   extra: tuple = ()) -> subprocess.CompletedProcess:
    """p4c-barefoot p4/tofino/thc_tna.p4 for Tofino 1 (`tofino`, TNA) or 2 (`tofino2`, T2NA) into
    out_dir/<target>; the completed process (its output holds the compiler's messages).  `-g`
    makes it write its resource report (pipe/logs/resources.json, phv.json:
    thc_ps.p4.tofino_resources.summarize).  The P4Info goes to out_dir/<target>/thc_tna.p4info.bin,
    with standard externs: what a P4Runtime server on a Tofino (Stratum) loads and
    p4/tna_entries.py names (binary, as it keeps an extern text cannot describe)."""
    if target not in TOFINO_TARGETS:
        raise ValueError(f"unknown Tofino target {target!r}: one of {', '.join(TOFINO_TARGETS)}")
    p4c = require("p4c-barefoot")
    out = Path(out_dir) / target
    out.mkdir(parents=True, exist_ok=True)
    cmd = [p4c, "--target", target, "--arch", TOFINO_TARGETS[target], "-g", "-o", str(out),
           "--p4runtime-force-std-externs", "--p4runtime-files", str(out / TNA_P4INFO), *extra,
           str(HERE / "tofino" / "thc_tna.p4")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=3600)


def assemble_tofino(bfa: Path | str, target: str = "tofino") -> subprocess.CompletedProcess:
    """bfas on p4c-barefoot's assembly (the step that makes the binary the driver loads)."""
    bfas = require("bfas")
    bfa = Path(bfa)
    return subprocess.run([bfas, "--target", target, "-o", str(bfa.parent / "bfas"), str(bfa)],
                          capture_output=True, text=True, timeout=1800)


def ensure_program(out_dir: Path | str = "build/p4") -> Path:
    """out_dir/thc.json (and its P4Info), compiled only when either is missing or older than
    p4/thc.p4."""
    target = Path(out_dir) / "thc.json"
    source = (HERE / "thc.p4").stat().st_mtime
    if all(f.exists() and f.stat().st_mtime >= source for f in (target, p4info_path(target))):
        return target
    return compile_program(out_dir)


def start_switch(json_path: Path, ports: dict, thrift_port: int = 9090, netns: str | None = None,
                 log: str | None = None) -> subprocess.Popen:
    """simple_switch with {port number: interface}; waits until its Thrift port answers."""
    ss = require("simple_switch")
    # a notifications socket of its own: bmv2's default /tmp/bmv2-0-notifications.ipc is shared
    # by every switch on the machine, so a second one (another run, another namespace) fails
    cmd = [ss, "--thrift-port", str(thrift_port), "--device-id", "0",
           "--notifications-addr", f"ipc:///tmp/bmv2-thc-{os.getpid()}-{thrift_port}-notifications.ipc"]
    for port, iface in sorted(ports.items()):
        cmd += ["-i", f"{port}@{iface}"]
    if log:
        cmd += ["--log-file", log, "--log-flush"]
    cmd.append(str(json_path))
    if netns:
        cmd = ["ip", "netns", "exec", netns] + cmd
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cli = SwitchCLI(thrift_port, netns)
    for attempt in range(100):
        if proc.poll() is not None:
            raise RuntimeError(f"simple_switch exited: {proc.stderr.read()[-2000:]}")
        try:
            if "thc_config" in cli.run(["show_tables"], check=False):
                return proc
        except subprocess.TimeoutExpired:
            pass
        # the switch may be up and its CLI unable to run (`thc p4 doctor` says the same)
        problem = cli_problem(cli.cli) if attempt == 0 else ""
        if problem:
            proc.kill()
            raise RuntimeError(f"simple_switch started, but {cli.cli} cannot talk to it: {problem}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("simple_switch did not start (Thrift port never answered)")


def free_port() -> int:
    """A TCP port nothing listens on now (other switches on this machine may hold 9090/9559)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_switch_grpc(ports: dict, grpc_port: int | None = None, netns: str | None = None,
                      log: str | None = None) -> tuple[subprocess.Popen, str]:
    """simple_switch_grpc with {port number: interface} and no program (the P4Runtime control
    plane loads it: P4RuntimeControl.take_over); its P4Runtime server on 127.0.0.1:grpc_port (a
    free port by default).  Returns (process, server address) once the server answers."""
    ss = require("simple_switch_grpc")
    grpc_port = grpc_port or free_port()
    address = f"127.0.0.1:{grpc_port}"
    cmd = [ss, "--device-id", "0", "--no-p4"]
    usage = subprocess.run([ss, "--help"], capture_output=True, text=True, timeout=30).stdout
    if "--notifications-addr" in usage:           # built with nanomsg: see start_switch
        cmd += ["--notifications-addr", f"ipc:///tmp/bmv2-thc-{os.getpid()}-{grpc_port}-notifications.ipc"]
    if "--thrift-port" in usage:                  # built with Thrift too: not on 9090, which others may hold
        cmd += ["--thrift-port", str(free_port())]
    for port, iface in sorted(ports.items()):
        cmd += ["-i", f"{port}@{iface}"]
    if log:
        cmd += ["--log-file", log, "--log-flush"]
    cmd += ["--", "--grpc-server-addr", address]
    if netns:
        cmd = ["ip", "netns", "exec", netns] + cmd
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for _ in range(150):
        if proc.poll() is not None:
            raise RuntimeError(f"simple_switch_grpc exited: {proc.stderr.read()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", grpc_port)) == 0:
                return proc, address
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"simple_switch_grpc did not start (its P4Runtime server never answered on {address})")


def choose_control(requested: str = "auto") -> tuple[str, str]:
    """(backend, why): `p4runtime` where simple_switch_grpc and the client library are there,
    else `thrift`; a backend asked for by name is that one, or an error naming what it lacks."""
    from thc_ps.p4 import tools
    from thc_ps.p4.p4runtime import client_problem
    lacks = [f"simple_switch_grpc ({tools.where_text()})"] if tools.find_tool("simple_switch_grpc") is None else []
    problem = client_problem()
    if problem:
        lacks.append(problem)
    if requested == "thrift":
        return "thrift", "asked for"
    if requested == "p4runtime":
        if lacks:
            raise FileNotFoundError(f"the P4Runtime control plane needs {'; '.join(lacks)}")
        return "p4runtime", "asked for"
    if not lacks:
        return "p4runtime", "simple_switch_grpc and the P4Runtime client are there"
    return "thrift", f"no P4Runtime: {'; '.join(lacks)}"


def _handles(cli_output: str, what: str = "added with handle") -> list[int]:
    """The entry (or node) handles a CLI batch reported, in command order."""
    return [int(h) for h in re.findall(what + r" (\d+)", cli_output)]


def _handle(cli_output: str, what: str = "added with handle") -> int:
    found = _handles(cli_output, what)
    if not found:
        raise RuntimeError(f"simple_switch_CLI did not report a handle: {cli_output[-300:]}")
    return found[-1]


class SwitchEngine:
    """The switch as PSServer sees it: it holds up to `max_jobs` jobs at once, each in a job
    cell (its multicast group and event counter block) and a region of the slot registers that
    the PS's admission gives it (ps_server/admission.py).  `start_job` programs a job and
    returns its engine (SwitchJob), which programs registrations and removes everything of the
    job when it ends.  Block 0 of the counters (what no job owns) is this object's stats.

    `control` is a backend (ThriftControl, or thc_ps.p4.p4runtime.P4RuntimeControl; a SwitchCLI is
    taken as ThriftControl over it).  On start it takes the switch over (`take_over`: Thrift
    clears what a previous control plane left in the THC tables, registers, counters and
    multicast groups and leaves L2 entries alone; P4Runtime loads the program, so everything
    starts empty) and writes the `l2` entries ({mac: port}) it is given.  Each job gets an epoch
    never used before on the switch, so its region needs no clearing."""

    fixed_nonce = None          # the PS draws each job's nonce and the ranks' tokens
    fixed_tokens: dict = {}

    def __init__(self, control, topology: dict, ps_mac: str = "00:00:00:00:00:fe",
                 slots: int = SLOTS, max_jobs: int = MAX_JOBS, l2: dict | None = None):
        self.control = ThriftControl(control) if isinstance(control, SwitchCLI) else control
        self.topology, self.ps_mac = topology, ps_mac
        self.slot_space, self.max_jobs = slots, max_jobs
        self.cells: dict = {}                 # cell -> SwitchJob
        self.epochs = itertools.count(1)      # the registers are zero after take_over
        self.control.take_over(max_jobs)
        apply(self.control, [("insert", e) for e in l2_entries(l2 or {})])

    def start_job(self, job: JobConfig, nonce: int, base: int = 0) -> SwitchJob:
        check_shape(job)
        if base + job.slots + job.norm_slots > self.slot_space:
            raise ValueError(f"region {base}..{base + job.slots + job.norm_slots - 1} is past the switch's "
                             f"{self.slot_space} slots")
        free = [c for c in range(1, self.max_jobs + 1) if c not in self.cells]
        if not free:
            raise ValueError(f"the switch holds {self.max_jobs} jobs at once (its job table)")
        engine = SwitchJob(self, job, nonce, base, free[0], next(self.epochs))
        self.cells[engine.cell] = engine
        log.info("switch: job id %d (n=%d, quorum %d) in cell %d, slots %d..%d", job.job_id, job.num_workers,
                 job.quorum_count, engine.cell, base, base + job.slots + job.norm_slots - 1)
        return engine

    def process(self, datagram: bytes, addr: tuple) -> list:
        return []               # the switch aggregates; nothing is answered from here

    def serve(self, fd: int, duration_ms: int, gro: bool = True, gso: bool = True) -> int:
        return wait(duration_ms)

    def stats(self) -> dict:
        """What no job owns: malformed headers and unknown job ids (counter block 0)."""
        ev = events(self.control, 0)
        return {"drops": {k: ev[k] for k in DROPS}}


class SwitchJob:
    """One job on the switch (the PS's engine for it): its config entry, lookup tables,
    multicast group and counter block are programmed at start, in one batch; each
    registration adds a workers entry keyed by (job id, address, port, token), replaced when
    the rank registers again, and the rank's multicast replica and egress rewrite once;
    `close` removes all of it.  A batch the switch rejects is taken back whole (`apply`), so
    a job that fails to start leaves nothing on the switch."""

    def __init__(self, switch: SwitchEngine, job: JobConfig, nonce: int, base: int, cell: int, epoch: int = 1):
        self.switch, self.job, self.nonce, self.base, self.cell = switch, job, nonce, base, cell
        self.epoch = epoch
        self.control = switch.control
        self._writes = job_writes(job, switch.ps_mac, nonce, base, cell, epoch)
        apply(self.control, self._writes)
        self._entries: dict = {}         # rank -> its workers entry
        self._placed: dict = {}          # rank -> ((ip, port), replica (port, rid), replica_dest entry)
        self.closed = False

    def _group(self, without: int | None = None, extra: tuple = ()) -> McGroup:
        return McGroup(self.cell, tuple(sorted([r for k, (_, r, _) in self._placed.items() if k != without]
                                               + list(extra))))

    def register(self, rank: int, ip: str, port: int, token: int = 0) -> None:
        if ip not in self.switch.topology:
            raise ValueError(f"worker address {ip} is not attached to the switch")
        switch_port, mac = self.switch.topology[ip]
        w = WorkerPort(rank, ip, port, mac, switch_port)
        self.unregister(rank)
        placed = self._placed.get(rank)
        if placed is not None and placed[0] != (ip, port):      # the rank came back elsewhere
            self._unplace(rank)
            placed = None
        writes = [("insert", worker_entry(w, token, self.job.job_id))]
        before = self._group()
        if placed is None:
            replica = (switch_port, rid(self.cell, rank))
            dest = replica_entry(w, self.cell)
            writes += [("modify", self._group(extra=(replica,))), ("insert", dest)]
        apply(self.control, writes, {self.cell: before})   # one batch: the PS's control plane waits for it
        self._entries[rank] = writes[0][1]
        if placed is None:
            self._placed[rank] = ((ip, port), replica, dest)

    def _unplace(self, rank: int) -> None:
        group = self._group(without=rank)
        _, _, dest = self._placed.pop(rank)
        apply(self.control, [("modify", group), ("delete", dest)])

    def unregister(self, rank: int) -> None:
        entry = self._entries.pop(rank, None)
        if entry is not None:
            apply(self.control, [("delete", entry)])

    def region(self) -> tuple:
        return self.base, self.job.slots + self.job.norm_slots

    def close(self) -> None:
        """The job ended: its entries, multicast group and replicas go.  Its region needs no
        clearing (the next job there has another epoch); its counters stay readable until the
        next job in its cell starts (with them at 0)."""
        if self.closed:
            return
        self.closed = True
        writes = [("delete", e) for e in self._entries.values()]
        writes += [("delete", dest) for _, _, dest in self._placed.values()]
        writes += [("delete", McGroup(self.cell))]
        writes += [("delete", item) for op, item in self._writes if op == "insert" and isinstance(item, TableEntry)]
        self._entries.clear()
        self._placed.clear()
        apply(self.control, writes)
        self.switch.cells.pop(self.cell, None)

    def process(self, datagram: bytes, addr: tuple) -> list:
        return []

    def serve(self, fd: int, duration_ms: int, gro: bool = True, gso: bool = True) -> int:
        return wait(duration_ms)

    def stats(self) -> dict:
        return engine_stats(events(self.control, self.cell))


def engine_stats(ev: dict) -> dict:
    """The switch's event counters in the shape of the software PS's stats."""
    return {"rounds_completed": ev["rounds_completed"], "partial_rounds": ev["partial_rounds"],
            "results_resent": ev["results_resent"], "stragglers_notified": ev["stale"],
            "notices": 0,                       # a switch sends no loss notices (docs/protocol.md §3)
            "drops": {k: ev[k] for k in DROPS}, "engine": "bmv2"}
