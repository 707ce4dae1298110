"""p4testgen (p4lang's p4c, P4Tools) on the THC switch programs: generation, and its tests read back.

p4testgen explores a program by symbolic execution and writes input/output tests: per test
the control-plane entries its path needs, one input packet and the expected output packet
(none: the packet is dropped).  `generate` runs it with a fixed seed, aiming at statement
coverage (greedy statement search, stopping at full coverage or `max_tests`), on

  bmv2    p4/thc.p4 (v1model)           STF tests: one file per test
  tofino  p4/tofino/thc_tna.p4 (TNA)    PTF tests: one Python file; only p4testgen's Tofino PTF
                                        back end writes register initial values and range keys
  tofino2 the same program as T2NA

and reports the coverage it reached; `read_tests` reads what it wrote into `GenTest`s, the
neutral form p4/replay.py maps onto the software PS.  The PTF file is read with `ast`, never
imported or run.

What p4testgen's models leave out, from its sources (p4c v1.2.5.16,
backends/p4tools/modules/testgen): one input packet per test, and registers written by a
test are not read by another; v1model registers start at zero and are not configurable,
while Tofino RegisterActions read a configurable initial value (PTF only); a packet with a
multicast group set is dropped (v1model: "We have not implemented multi cast yet") or, on
Tofino, leaves by its unicast port only; no recirculation on Tofino; parser value sets are
not implemented (the select cases naming one are removed).  The last would make the Tofino
program's pass 2 unreachable, so the Tofino targets compile it with `THC_TESTGEN_RECIRC_PORT`
defined: its parser then recognizes pass 2 by that constant port instead of the
`recirc_ports` value set (p4/templates/tna/parser.p4).  The define also holds a second
pass's made-up bridge header to what pass 1 writes (`testgen_assume`, ingress.p4) and leaves
out the egress's multicast-replica rewrite, whose read of `egress_rid` misplaces the bridge
header in p4testgen's Tofino egress (docs/p4.md, "Tables holding real jobs").

`--tables job` (`job_program`, `fixed_entries`) compiles a copy of the program whose THC
tables hold real jobs as `const entries`, written by the control plane's own code, so that
the tests reach those jobs' slots rather than entries no job writes.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from thc_ps.p4 import tools

HERE = Path(__file__).resolve().parent

#: Tofino 1's first recirculation port of pipe 0: the port pass 2 comes in on under p4testgen.
TESTGEN_RECIRC_PORT = 68


@dataclass(frozen=True)
class Target:
    """One p4testgen run: the program, p4testgen's target and architecture, its test back
    end and the preprocessor definitions."""

    name: str
    program: Path
    target: str
    arch: str
    backend: str
    defines: tuple = ()
    #: the input and output ports p4testgen may choose: ports a switch run can make (bmv2's
    #: drop port 511 is none) and those p4c's own Tofino PTF tests use
    ports: str = "0:15"

    @property
    def stem(self) -> str:
        return self.program.stem


TNA_DEFINES = (f"THC_TESTGEN_RECIRC_PORT={TESTGEN_RECIRC_PORT}",)
TARGETS = {t.name: t for t in (
    Target("bmv2", HERE / "thc.p4", "bmv2", "v1model", "STF"),
    Target("tofino", HERE / "tofino" / "thc_tna.p4", "tofino", "tna", "PTF", ("__TARGET_TOFINO__=1", *TNA_DEFINES),
           f"0:15,{TESTGEN_RECIRC_PORT}:{TESTGEN_RECIRC_PORT}"),
    Target("tofino2", HERE / "tofino" / "thc_tna.p4", "tofino2", "t2na", "PTF",
           ("__TARGET_TOFINO__=2", *TNA_DEFINES), f"8:15,{TESTGEN_RECIRC_PORT}:{TESTGEN_RECIRC_PORT}"),
)}

#: Per run: the path selection, the coverage tracked, when to stop, and input frames of 60 to
#: 1500 bytes (in bits: Ethernet's shortest frame without its FCS, and the MTU).
STRATEGY = ("--path-selection", "GREEDY_STATEMENT_SEARCH", "--track-coverage", "STATEMENTS",
            "--stop-metric", "MAX_NODE_COVERAGE", "--packet-size-range", "480:12000")
SUMMARY = "testgen.json"
COVERED_RE = re.compile(r"Nodes covered: ([0-9.]+) \((\d+)/(\d+)\)")


def target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"unknown p4testgen target {name!r}: one of {', '.join(TARGETS)}")
    return TARGETS[name]


def command(spec: Target, out_dir: Path, max_tests: int, seed: int, program: Path | None = None) -> list[str]:
    """The p4testgen command line of one run."""
    return [tools.require("p4testgen"), "--target", spec.target, "--arch", spec.arch, "--std", "p4-16",
            "--test-backend", spec.backend, "--seed", str(seed), "--max-tests", str(max_tests),
            "--out-dir", str(out_dir), *STRATEGY, "--port-ranges", spec.ports, *(f"-D{d}" for d in spec.defines),
            str(program or spec.program)]


def tracked_files(directory: Path) -> list[str]:
    """The files git tracks under `directory` (none when it is outside a repository)."""
    directory = Path(directory)
    probe = directory
    while not probe.is_dir():
        probe = probe.parent
    proc = subprocess.run(["git", "ls-files", "--", str(directory.resolve())], cwd=probe, capture_output=True,
                          text=True)
    return proc.stdout.split() if proc.returncode == 0 else []


def _outputs(spec: Target, directory: Path, stem: str) -> list[Path]:
    """What a run of `spec` on a program named `stem` writes into `directory` (an earlier
    run's, to be replaced)."""
    pattern = f"{stem}_*.stf" if spec.backend == "STF" else f"{stem}.py"
    return sorted(directory.glob(pattern)) + [p for p in (directory / SUMMARY,) if p.exists()]


def _compile_error(text: str, program: Path) -> str:
    """The first error p4testgen reports on the program's text ('' when none names it)."""
    for line in text.splitlines():
        if "error" in line.lower() and program.name in line:
            return line.strip()
    return ""


@dataclass
class Generation:
    """What one p4testgen run produced."""

    target: str
    program: str
    seed: int
    max_tests: int
    tests: int
    covered: int
    coverable: int
    seconds: float
    command: list = field(default_factory=list)
    tables: str = "free"
    ports: str = ""

    @property
    def coverage(self) -> float:
        return self.covered / self.coverable if self.coverable else 1.0

    def line(self) -> str:
        return (f"{self.target}: {self.tests} tests in {self.seconds:.1f} s, statement coverage "
                f"{self.covered}/{self.coverable} ({100 * self.coverage:.1f}%), seed {self.seed}"
                + (", the tables holding fixed jobs" if self.tables == "job" else ""))


def generate(name: str, out_dir: Path | str, max_tests: int = 20, seed: int = 1, program: Path | None = None,
             timeout: float = 7200, tables: str = "free", ports: str | None = None) -> Generation:
    """Run p4testgen for target `name` into out_dir (created; an earlier run's tests there are
    replaced; a directory holding committed files is refused) and write its summary,
    out_dir/testgen.json.  `tables`: "free" lets p4testgen choose every table entry; "job"
    compiles the program with the jobs of `fixed_jobs` in its tables (`job_program`).
    `ports`: p4testgen's --port-ranges instead of the target's (Tofino "0:15": first passes
    only, since the recirculation port is then no output p4testgen may choose).  A
    program p4testgen cannot compile is a ValueError naming its first error; a missing
    p4testgen a FileNotFoundError naming where it comes from."""
    spec = target(name)
    if ports is not None:
        if not re.fullmatch(r"\d+:\d+(,\d+:\d+)*", ports):
            raise ValueError(f"--port-ranges takes LOW:HIGH[,LOW:HIGH...], got {ports!r}")
        spec = replace(spec, ports=ports)
    if tables not in TABLES:
        raise ValueError(f"--tables must be one of {', '.join(TABLES)}, got {tables!r}")
    if max_tests < 1:
        raise ValueError(f"--max-tests must be at least 1, got {max_tests}")
    if not 0 <= seed < 1 << 32:
        raise ValueError(f"--seed must be in 0..{(1 << 32) - 1}, got {seed}")
    program = Path(program) if program is not None else spec.program
    if not program.is_file():
        raise ValueError(f"no P4 program at {program}")
    out = Path(out_dir)
    committed = tracked_files(out) if out.exists() else []
    if committed:
        raise ValueError(f"{out} holds committed files ({committed[0]}, ...): give another --out")
    out.mkdir(parents=True, exist_ok=True)
    for stem in {program.stem, spec.stem}:
        for old in _outputs(spec, out, stem):
            old.unlink()
    source = program
    if tables == "job":
        program = out / "program" / program.name
        program.parent.mkdir(exist_ok=True)
        program.write_text(job_program(source.read_text(), fixed_entries(name)))
    cmd = command(spec, out, max_tests, seed, program)
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - start
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        err = _compile_error(text, program)
        if err:
            raise ValueError(f"p4testgen cannot compile {program}: {err}")
        tail = " | ".join(line.strip() for line in text.strip().splitlines()[-3:])
        raise RuntimeError(f"p4testgen --target {spec.target} --arch {spec.arch} failed (status "
                           f"{proc.returncode}): {tail}")
    covered = COVERED_RE.findall(text)
    tests = len(read_tests(out, name, program.stem))
    gen = Generation(name, str(source), seed, max_tests, tests,
                     int(covered[-1][1]) if covered else 0, int(covered[-1][2]) if covered else 0,
                     round(seconds, 2), cmd, tables, spec.ports)
    (out / SUMMARY).write_text(json.dumps(asdict(gen), indent=1) + "\n")
    return gen


# --------------------------------------------------------------------------- fixed jobs

#: What p4testgen may put in the THC tables: "free", any entry (most are entries no job
#: writes: p4testgen picks action parameters freely, docs/p4.md); "job", none: the tables
#: hold the jobs of `fixed_jobs` as `const entries`, so the generated tests explore real jobs'
#: slots.  Plain L2 forwarding stays free in both.
TABLES = ("free", "job")
PS_MAC = "02:00:00:00:00:fe"
NONCE = 0x5EED


def _worker_ports(n: int, base: int) -> list:
    from thc_ps.p4.entries import WorkerPort
    return [WorkerPort(r, f"10.0.{base}.{r + 1}", 5001 + r, f"02:00:00:00:{base:02x}:{r + 1:02x}", r + 1)
            for r in range(n)]


def fixed_jobs(name: str) -> list[tuple]:
    """The jobs a `--tables job` build of target `name` holds, as (JobConfig, [WorkerPort]):
    bmv2 (8 jobs) two: n = 2 at full quorum and n = 1, whose every DATA packet completes its
    round (registers start at zero under p4testgen's v1model); Tofino (one job at a time)
    n = 3 at quorum 2 (its registers' initial values are p4testgen's to choose)."""
    from thc_ps.p4.control import switch_job
    if target(name).target == "bmv2":
        return [(switch_job(2, job_id=1, slots=4, norm_slots=2), _worker_ports(2, 1)),
                (switch_job(1, job_id=2, slots=2, norm_slots=1), _worker_ports(1, 2))]
    return [(switch_job(3, job_id=1, slots=4, norm_slots=2, quorum=2 / 3), _worker_ports(3, 1))]


def token(job_id: int, rank: int) -> int:
    """The registration token of a fixed job's rank."""
    return 0x7000_0000 | job_id << 8 | rank


def fixed_entries(name: str) -> list:
    """Every table entry the control plane writes for `fixed_jobs(name)` and their ranks
    (p4/entries.py, p4/tna_entries.py): what a `--tables job` build holds."""
    from thc_ps.p4 import entries as E
    from thc_ps.p4 import tna_entries as T
    items: list = []
    left_out: set = set()
    if target(name).target == "bmv2":
        base = 0
        for cell, (job, ports) in enumerate(fixed_jobs(name), start=1):
            items += [it for _, it in E.job_writes(job, PS_MAC, NONCE, base, cell, epoch=cell)]
            items += [E.worker_entry(w, token(job.job_id, w.worker_id), job.job_id) for w in ports]
            items += [E.replica_entry(w, cell) for w in ports]
            base += job.slots + job.norm_slots
    else:
        (job, ports), = fixed_jobs(name)
        items += [it for _, it in T.tna_job_writes(job, PS_MAC, NONCE, TESTGEN_RECIRC_PORT)]
        for w in ports:
            items += [it for _, it in T.tna_worker_writes(w, token(job.job_id, w.worker_id), ())]
        left_out = {T.REPLICA}          # the testgen build has no replica rewrite (tna/egress.p4)
    return [it for it in items if isinstance(it, E.TableEntry) and it.table not in left_out]


def _p4_key(value) -> str:
    return f"{value[0]} .. {value[1]}" if isinstance(value, tuple) else str(value)


def job_program(text: str, entries: list) -> str:
    """The program `text` with `entries` compiled into their tables as `const entries` (in
    the given order, which is a const table's priority order)."""
    by_table: dict = {}
    for e in entries:
        by_table.setdefault(e.table.rpartition(".")[2], []).append(e)
    for table, rows in by_table.items():
        m = re.search(rf"^(\s*)table {re.escape(table)} \{{", text, re.M)
        if m is None:
            raise ValueError(f"the program has no table {table}")
        depth, i = 0, m.end() - 1
        while True:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        pad = m.group(1).lstrip("\n")
        lines = [f"{pad}    const entries = {{"]
        for e in rows:
            keys = [_p4_key(v) for _, v in e.match]
            key = keys[0] if len(keys) == 1 else f"({', '.join(keys)})"
            args = ", ".join(str(v) for _, v in e.params)
            lines.append(f"{pad}        {key} : {e.action.rpartition('.')[2]}({args});")
        lines.append(f"{pad}    }}")
        j = text.rfind("\n", 0, i) + 1          # the start of the table's closing line
        text = text[:j] + "\n".join(lines) + "\n" + text[j:]
    return text


def as_generated(e) -> Entry:
    """A control plane's TableEntry as the Entry a p4testgen test would list."""
    keys = tuple(Key(name, "range", v[0], high=v[1]) if isinstance(v, tuple) else Key(name, "exact", v)
                 for name, v in e.match)
    return Entry(e.table, keys, e.action, tuple(e.params), e.priority)


# --------------------------------------------------------------------------- the tests

@dataclass(frozen=True)
class Key:
    """One key of a table entry: `value` (a range's low end, `high` its high end; a
    ternary's `mask`)."""

    field: str
    kind: str                  # exact | ternary | range
    value: int
    mask: int | None = None
    high: int | None = None

    def matches(self, v: int) -> bool:
        if self.kind == "exact":
            return v == self.value
        if self.kind == "range":
            return self.value <= v <= self.high
        return v & self.mask == self.value & self.mask


@dataclass(frozen=True)
class Entry:
    """A table entry p4testgen's test needs (`default`: the table's default action set)."""

    table: str
    keys: tuple
    action: str
    params: tuple              # ((name, value), ...)
    priority: int = 0
    default: bool = False

    def param(self, name: str) -> int:
        return dict(self.params)[name]

    def key(self, suffix: str) -> Key | None:
        return next((k for k in self.keys if k.field.endswith(suffix)), None)


@dataclass
class GenTest:
    """One generated test: entries, register initial values {(register, index): value or
    {field: value}}, the input packet on a port, and the expected output (None: dropped)
    with its care mask (a bit 1 is checked)."""

    name: str
    entries: tuple
    registers: dict
    in_port: int
    packet: bytes
    out_port: int | None
    expected: bytes | None
    care: bytes | None = None
    coverage: float | None = None
    trace: tuple = ()

    def table(self, suffix: str) -> list[Entry]:
        """The entries of the table whose name ends with `suffix` (a control's prefix aside)."""
        return [e for e in self.entries if _plain(e.table).endswith(suffix)]

    def register(self, suffix: str):
        """{index: value} of the register whose name ends with `suffix`."""
        return {i: v for (r, i), v in self.registers.items() if _plain(r).endswith(suffix)}


def _plain(name: str) -> str:
    """A control-plane name without the Tofino pipeline's prefix."""
    return name[len("pipe."):] if name.startswith("pipe.") else name


def read_tests(directory: Path | str, name: str, stem: str | None = None) -> list[GenTest]:
    """The tests a run of target `name` wrote into `directory`, in p4testgen's order (named
    after the program: `stem`, else the one its testgen.json names, else the target's)."""
    spec = target(name)
    directory = Path(directory)
    summary = json.loads((directory / SUMMARY).read_text()) if (directory / SUMMARY).exists() else {}
    stem = stem or (Path(summary["program"]).stem if "program" in summary else spec.stem)
    if spec.backend == "STF":
        files = sorted(directory.glob(f"{stem}_*.stf"), key=lambda p: int(p.stem.rpartition("_")[2]))
        tests = [parse_stf(p.read_text(), p.stem) for p in files]
    else:
        ptf = directory / f"{stem}.py"
        tests = parse_ptf(ptf.read_text()) if ptf.exists() else []
    if summary.get("tables") == "job":
        # the fixed jobs' entries are compiled in: p4testgen lists none of them
        fixed = tuple(as_generated(e) for e in fixed_entries(name))
        for t in tests:
            t.entries = fixed + t.entries
    return tests


# ---- STF (bmv2)

_STF_ADD = re.compile(r'^add\s+"(?P<table>[^"]+)"\s+(?:(?P<prio>\d+)\s+)?(?P<keys>(?:"[^"]+":\S+\s+)*)'
                      r'"(?P<action>[^"]+)"\((?P<params>[^)]*)\)\s*$')
_STF_DEFAULT = re.compile(r'^setdefault\s+"(?P<table>[^"]+)"\s+"(?P<action>[^"]+)"\((?P<params>[^)]*)\)\s*$')
_STF_PAIR = re.compile(r'"([^"]+)":([^,\s)]+)')


def _stf_key(name: str, text: str) -> Key:
    if text.startswith("0b") and "*" in text:
        bits = text[2:]
        value = int(bits.replace("*", "0"), 2)
        mask = int("".join("0" if b == "*" else "1" for b in bits), 2)
        return Key(name, "ternary", value, mask)
    return Key(name, "exact", int(text, 0))


def _hex_packet(text: str) -> tuple[bytes, bytes]:
    """An STF packet's hex digits ('*': a nibble not checked) as (bytes, care mask)."""
    digits = text.strip().rstrip("$")
    if len(digits) % 2:
        raise ValueError(f"odd number of hex digits in a packet: {digits[:40]}...")
    data = bytes.fromhex(digits.replace("*", "0"))
    care = bytes.fromhex("".join("0" if d == "*" else "f" for d in digits))
    return data, care


def parse_stf(text: str, name: str = "stf") -> GenTest:
    """One p4testgen STF test (bmv2 back end)."""
    entries, trace, coverage = [], [], None
    packet = expect = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            m = re.match(r"#\s*Current (?:node|statement) coverage:\s*([0-9.e+-]+)", line)
            if m:
                coverage = float(m.group(1))
            elif trace is not None and not line.startswith("# Table") and not line.startswith("# p4testgen") \
                    and not line.startswith("# Date") and line != "# Traces":
                trace.append(line[1:].strip())
            continue
        if line.startswith("add "):
            m = _STF_ADD.match(line)
            if not m:
                raise ValueError(f"{name}: cannot read STF entry {line!r}")
            keys = tuple(_stf_key(k, v) for k, v in _STF_PAIR.findall(m.group("keys")))
            params = tuple((p, int(v, 0)) for p, v in _STF_PAIR.findall(m.group("params")))
            entries.append(Entry(m.group("table"), keys, m.group("action"), params, int(m.group("prio") or 0)))
        elif line.startswith("setdefault "):
            m = _STF_DEFAULT.match(line)
            if not m:
                raise ValueError(f"{name}: cannot read STF default action {line!r}")
            params = tuple((p, int(v, 0)) for p, v in _STF_PAIR.findall(m.group("params")))
            entries.append(Entry(m.group("table"), (), m.group("action"), params, default=True))
        elif line.startswith("packet "):
            _, port, digits = line.split(None, 2)
            packet = (int(port), _hex_packet(digits)[0])
        elif line.startswith("expect "):
            parts = line.split(None, 2)
            if len(parts) < 3:
                raise ValueError(f"{name}: an expectation without a packet ({line!r}: clones are not read)")
            expect = (int(parts[1]), *_hex_packet(parts[2]))
        else:
            raise ValueError(f"{name}: unknown STF command {line.split()[0]!r}")
    if packet is None:
        raise ValueError(f"{name}: no input packet")
    return GenTest(name, tuple(entries), {}, packet[0], packet[1], *(expect or (None, None, None)),
                   coverage=coverage, trace=tuple(trace))


# ---- PTF (Tofino): read with ast, never run

def _literal(node):
    return ast.literal_eval(node)


def _call_name(node) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def _ptf_key(call: ast.Call) -> Key:
    name = _literal(call.args[0])
    kw = {k.arg: _literal(k.value) for k in call.keywords}
    if "low" in kw:
        return Key(name, "range", kw["low"], high=kw["high"])
    if "prefix_len" in kw:
        raise ValueError(f"LPM key {name}: no THC table has one")
    if len(call.args) == 3:
        return Key(name, "ternary", _literal(call.args[1]), _literal(call.args[2]))
    return Key(name, "exact", _literal(call.args[1]))


def _data(node) -> tuple:
    return tuple((_literal(c.args[0]), _literal(c.args[1])) for c in node.elts)


def _ptf_control(fn: ast.FunctionDef) -> tuple[list, dict]:
    entries, registers = [], {}
    for stmt in fn.body:
        if isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
            continue
        if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
            raise ValueError(f"PTF control plane statement at line {stmt.lineno} is not read (no THC test "
                             f"needs it): {ast.unparse(stmt)[:80]}")
        call, what = stmt.value, _call_name(stmt.value)
        if what == "insertTableEntry":
            table, keys, action, data = call.args
            entries.append(Entry(_literal(table), tuple(_ptf_key(k) for k in keys.elts), _literal(action),
                                 _data(data)))
        elif what == "overrideDefaultEntry":
            table, action, data = call.args
            entries.append(Entry(_literal(table), (), _literal(action), _data(data), default=True))
        elif what == "setRegisterValue":
            reg, value, index = (_literal(a) for a in call.args)
            if isinstance(value, list):
                value = {n.rpartition(".")[2]: v for n, v in value}
            registers[(reg, index)] = value
        else:
            raise ValueError(f"PTF control plane call {what!r} is not read (no THC test needs it)")
    return entries, registers


def _assigned(fn: ast.FunctionDef) -> dict:
    return {s.targets[0].id: s.value for s in fn.body
            if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Name)}


def parse_ptf(text: str) -> list[GenTest]:
    """Every test class of a p4testgen PTF file (Tofino back end)."""
    tree = ast.parse(text)
    lines = text.splitlines()     # each class's source by line numbers (get_source_segment splits the file per call)
    tests = []
    for cls in tree.body:
        if not (isinstance(cls, ast.ClassDef) and re.fullmatch(r"Test\d+", cls.name)):
            continue
        fns = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
        entries, registers = _ptf_control(fns["setupCtrlPlane"])
        send = _assigned(fns["sendPacket"])
        verify = _assigned(fns["verifyPackets"])
        out_port = expected = care = None
        if "exp_pkt" in verify:
            out_port = _literal(verify["eg_port"])
            expected = next(_literal(s.value) for s in fns["verifyPackets"].body
                            if isinstance(s, ast.Assign) and getattr(s.targets[0], "id", "") == "exp_pkt"
                            and isinstance(s.value, ast.Constant))
            bits = bytearray(b"\xff" * len(expected))
            for s in fns["verifyPackets"].body:
                if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) \
                        and _call_name(s.value) == "set_do_not_care":
                    start, width = (_literal(a) for a in s.value.args)
                    for b in range(start, start + width):
                        bits[b // 8] &= ~(0x80 >> (b % 8)) & 0xFF
            care = bytes(bits)
        source = "\n".join(lines[cls.lineno - 1:cls.end_lineno])
        m = re.search(r"#\s*Current statement coverage:\s*([0-9.e+-]+)", source)
        doc = ast.get_docstring(cls) or ""
        tests.append(GenTest(cls.name, tuple(entries), registers, _literal(send["ig_port"]),
                             _literal(send["pkt"]), out_port, expected, care,
                             float(m.group(1)) if m else None,
                             tuple(line.strip() for line in doc.splitlines() if line.strip())))
    return tests
