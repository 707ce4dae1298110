"""Finding and checking the P4 tools: the one place that knows where they live.

p4lang's bmv2 (`simple_switch`, `simple_switch_CLI`; optionally `simple_switch_grpc`, bmv2
built with p4lang's PI, for the P4Runtime control plane) and p4c (`p4c-bm2-ss`; optionally
`p4c-barefoot` and `bfas`, its Tofino back end and assembler; `p4testgen`, P4Tools' test
generator) are not shipped by any registry
here; users build and install them as p4lang documents.  They are looked up on PATH, then in
/opt/p4tools/bin, then in the directory named by $THC_P4_TOOLS.  The Mininet harness also needs Debian's `mininet` (in
Debian's /usr/bin/python3, not the venv) and `ethtool`; kernel loss needs `nft`.

`doctor()` reports, per tool, its path and version, whether that is the version the tests
ran with, and where a missing one comes from (`thc p4 doctor`).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

SYSTEM_DIR = "/opt/p4tools/bin"
ENV_VAR = "THC_P4_TOOLS"
DEBIAN_PYTHON = "/usr/bin/python3"

BMV2 = ("simple_switch", "simple_switch_CLI")
P4C = ("p4c-bm2-ss",)
BMV2_HALF = BMV2 + P4C           # what the switch tests need

BMV2_README = "p4lang's behavioral-model (build and install as https://github.com/p4lang/behavioral-model#readme says)"
GRPC_README = ("p4lang's behavioral-model configured --with-pi (build p4lang's PI, then bmv2, as "
               "https://github.com/p4lang/behavioral-model/tree/main/targets/simple_switch_grpc#readme says)")
P4C_README = "p4lang's p4c (build and install as https://github.com/p4lang/p4c#readme says)"
TOFINO_README = ("p4lang's p4c with its open-source Tofino back end (backends/tofino; build and install "
                 "as https://github.com/p4lang/p4c#readme says)")
TESTGEN_README = ("p4lang's p4c with P4Tools' P4Testgen and its bmv2 and Tofino targets (backends/p4tools; "
                  "build and install as https://github.com/p4lang/p4c/tree/main/backends/p4tools#readme says)")

# Versions the tests ran with (docs/p4.md says when and why).
TESTED = {
    "simple_switch": "1.15.5",
    "simple_switch_CLI": "1.15.5",
    "simple_switch_grpc": "1.15.5",
    "p4c-bm2-ss": "1.2.5.16",
    "p4c-barefoot": "9.13.4",    # p4c v1.2.5.16
    "bfas": "9.13.4",            # the assembler of the same build (reported as p4c-barefoot's version)
    "p4testgen": "1.2.5.16",     # p4c v1.2.5.16's P4Tools
    "mininet": "2.3.0",
    "nft": "1.0.6",
    "ethtool": "6.1",
    "ip": "6.1.0",
}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    source: str              # where a missing one comes from
    optional: bool = False
    needed_for: str = ""


SPECS = (
    ToolSpec("simple_switch", BMV2_README, needed_for="bmv2 switch"),
    ToolSpec("simple_switch_CLI", BMV2_README, needed_for="bmv2 switch (table programming)"),
    ToolSpec("p4c-bm2-ss", P4C_README, needed_for="compiling p4/thc.p4"),
    ToolSpec("p4c-barefoot", TOFINO_README, optional=True, needed_for="compiling p4/tofino/thc_tna.p4"),
    ToolSpec("bfas", TOFINO_README, optional=True, needed_for="assembling the Tofino program"),
    ToolSpec("simple_switch_grpc", GRPC_README, optional=True, needed_for="the P4Runtime control plane"),
    ToolSpec("p4testgen", TESTGEN_README, optional=True, needed_for="generated input/output tests (thc p4 testgen)"),
    ToolSpec("mininet", "Debian package mininet (apt-get install --no-install-recommends mininet)",
             needed_for="thc p4 mininet, the Mininet test"),
    ToolSpec("nft", "Debian package nftables", needed_for="kernel packet loss"),
    ToolSpec("ethtool", "Debian package ethtool", needed_for="checksum offload off on Mininet links"),
    ToolSpec("ip", "Debian package iproute2", needed_for="namespaces and veths"),
)
SOURCES = {s.name: s.source for s in SPECS}
SYSTEM_SBIN = ("/usr/sbin", "/sbin")     # Debian's nft/ethtool/ip when PATH lacks sbin


_DEFAULT = object()


def search_dirs(path: str | None = None, system_dir=_DEFAULT, env: dict | None = None) -> list[str]:
    """Directories searched, in order: PATH, /opt/p4tools/bin, $THC_P4_TOOLS (arguments
    replace each part: `path` for $PATH, `system_dir` (None: none), `env` for os.environ)."""
    env = os.environ if env is None else env
    path = env.get("PATH", os.defpath) if path is None else path
    system_dir = SYSTEM_DIR if system_dir is _DEFAULT else system_dir
    dirs = [d for d in path.split(os.pathsep) if d]
    if system_dir:
        dirs.append(system_dir)
    if env.get(ENV_VAR):
        dirs.append(env[ENV_VAR])
    return dirs


def find_tool(name: str, **where) -> str | None:
    """Full path of `name` in search_dirs(**where), else None."""
    for d in search_dirs(**where):
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def missing_tools(*names: str, **where) -> list[str]:
    return [n for n in names if find_tool(n, **where) is None]


def where_text() -> str:
    return f"PATH, {SYSTEM_DIR} or ${ENV_VAR}"


def require(name: str, **where) -> str:
    """Path of a P4 tool, or FileNotFoundError naming where it comes from."""
    found = find_tool(name, **where)
    if found is None:
        raise FileNotFoundError(f"{name} not found on {where_text()}: it comes from {SOURCES[name]}")
    return found


def system_tool(name: str) -> str | None:
    """A Debian system tool (nft, ethtool, ip): PATH, then /usr/sbin and /sbin."""
    return shutil.which(name) or next((str(Path(d) / name) for d in SYSTEM_SBIN
                                       if os.access(Path(d) / name, os.X_OK)), None)


def mininet_python(python: str = DEBIAN_PYTHON) -> str | None:
    """Debian's python3 when it imports mininet, else None."""
    if not os.access(python, os.X_OK):
        return None
    try:
        ok = subprocess.run([python, "-c", "import mininet.net"], capture_output=True,
                            timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return python if ok else None


# --------------------------------------------------------------------------- doctor

VERSION_RE = re.compile(r"(\d+\.\d+(?:\.\d+)*)")


def _run(cmd: list, timeout: float = 30) -> tuple[int, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _version(text: str) -> str | None:
    m = VERSION_RE.search(text)
    return m.group(1) if m else None


@dataclass
class ToolStatus:
    name: str
    status: str              # ok | untested-version | missing | broken
    path: str | None
    version: str | None
    tested_version: str
    optional: bool
    needed_for: str
    detail: str              # source when missing, the error when broken, "" otherwise

    @property
    def usable(self) -> bool:
        return self.status in ("ok", "untested-version")

    def line(self) -> str:
        head = f"{self.name:<18} {self.status:<16}"
        if self.status == "missing":
            opt = f" (optional: {self.needed_for})" if self.optional else ""
            return f"{head} not found{opt}; from {self.detail}"
        tested = ("tests ran with this version" if self.status == "ok"
                  else f"tests ran with {self.tested_version}" if self.tested_version
                  else "no test has run it yet")
        if self.status == "broken":
            return f"{head} {self.path}: {self.detail}"
        return f"{head} {self.path} {self.version or '?'} ({tested})"


def _status(spec: ToolSpec, path: str | None, version: str | None, error: str = "") -> ToolStatus:
    tested = TESTED.get(spec.name, "")
    if path is None:
        return ToolStatus(spec.name, "missing", None, None, tested, spec.optional, spec.needed_for,
                          spec.source)
    if error:
        return ToolStatus(spec.name, "broken", path, version, tested, spec.optional, spec.needed_for, error)
    status = "ok" if version == tested else "untested-version"
    return ToolStatus(spec.name, status, path, version, tested, spec.optional, spec.needed_for, "")


def _interpreter(path: str) -> str:
    """The Python interpreter a script's #! line names, resolved on PATH as the kernel would run
    it: '/usr/bin/env python3' → 'python3 (/venv/bin/python3 on PATH)'; '' for anything else."""
    try:
        with open(path, "rb") as f:
            first = f.readline(256).decode(errors="replace").strip()
    except OSError:
        return ""
    if not first.startswith("#!"):
        return ""
    words = first[2:].split()
    if len(words) >= 2 and Path(words[0]).name == "env" and "python" in words[1]:
        found = shutil.which(words[1])
        return f"{words[1]} ({found or 'not found'} on PATH)"
    return words[0] if words and "python" in Path(words[0]).name else ""


def cli_problem(path: str) -> str:
    """'' when simple_switch_CLI starts (its Python modules import), else what is wrong: the
    last error line and the interpreter its #! line picks (an activated venv's python3, say,
    that lacks the thrift modules bmv2 installed for the system's)."""
    rc, out = _run([path, "--help"])
    if rc == 0 and "thrift" in out.lower():
        return ""
    last = [line for line in out.splitlines() if line.strip()]
    python = _interpreter(path)
    return ("its Python modules do not import" + (f" in {python}" if python else "") + ": "
            + (last[-1] if last else f"exit status {rc}")
            + ("; put the python3 bmv2 installed them for first on PATH (e.g. PATH=/usr/bin:$PATH) or "
               "install bmv2's Python modules into that interpreter" if python else ""))


def check(spec: ToolSpec, *, python: str = DEBIAN_PYTHON, **where) -> ToolStatus:
    if spec.name == "mininet":
        if not os.access(python, os.X_OK):
            return _status(spec, None, None)
        rc, out = _run([python, "-c", "import mininet.net as n, os; print(n.VERSION, os.path.dirname(n.__file__))"])
        if rc != 0:
            return _status(spec, None, None)
        version, _, where_mod = out.splitlines()[-1].partition(" ")
        return _status(spec, f"{python} ({where_mod})", version)
    if spec.name in ("nft", "ethtool", "ip"):
        path = system_tool(spec.name)
        if path is None:
            return _status(spec, None, None)
        rc, out = _run([path, "-V" if spec.name == "ip" else "--version"])
        return _status(spec, path, _version(out.split("iproute2-")[-1]) if rc == 0 else None,
                       "" if rc == 0 else f"--version failed: {out[-200:]}")
    path = find_tool(spec.name, **where)
    if path is None:
        return _status(spec, None, None)
    if spec.name == "simple_switch_CLI":
        ss = find_tool("simple_switch", **where)      # the CLI has no version of its own
        version = _version(_run([ss, "--version"])[1]) if ss else None
        return _status(spec, path, version, cli_problem(path))
    if spec.name == "bfas":
        # the assembler has no version of its own: it is the version of the p4c-barefoot
        # beside it (one build); without an input it prints its usage line
        rc, out = _run([path])
        if "usage:" not in out:
            return _status(spec, path, None, f"no usage line from {path}: {out[-200:]}")
        cc = find_tool("p4c-barefoot", **where)
        return _status(spec, path, _version(_run([cc, "--version"])[1]) if cc else None)
    if spec.name == "p4testgen":
        return _testgen_status(spec, path, where)
    rc, out = _run([path, "--version"])
    if rc != 0:
        return _status(spec, path, None, f"--version failed (status {rc}): {out[-200:]}")
    return _status(spec, path, _version(out))


def _testgen_status(spec: ToolSpec, path: str, where: dict) -> ToolStatus:
    """p4testgen asks for a target even to print its version, and a p4c build from a source
    tree without git tags prints "Version <null>": then its version is that of the
    p4c-bm2-ss of the same build (the build tree holding both, or one install directory)."""
    rc, out = _run([path, "--target", "bmv2", "--arch", "v1model", "--version"])
    if rc != 0:
        return _status(spec, path, None, f"--version failed (status {rc}): {out[-200:]}")
    version = _version(out)
    if version is None:
        cc = find_tool("p4c-bm2-ss", **where)
        if cc and os.path.realpath(cc).startswith(_build_root(path) + os.sep):
            version = _version(_run([cc, "--version"])[1])
    return _status(spec, path, version)


def _build_root(path: str) -> str:
    """The p4c build tree a binary is in (the nearest directory up with CMakeCache.txt), or
    its own directory for an installed one."""
    real = os.path.realpath(path)
    d = os.path.dirname(real)
    while d != os.path.dirname(d):
        if os.path.exists(os.path.join(d, "CMakeCache.txt")):
            return d
        d = os.path.dirname(d)
    return os.path.dirname(real)


def doctor(*, python: str = DEBIAN_PYTHON, **where) -> dict:
    """Every tool's status; bmv2_complete when the switch tests can run; p4runtime: '' when
    the P4Runtime control plane can run (simple_switch_grpc and the client library), else why
    not."""
    from thc_ps.p4.p4runtime import client_problem
    tools = [check(s, python=python, **where) for s in SPECS]
    complete = all(t.usable for t in tools if t.name in BMV2_HALF)
    grpc = next(t for t in tools if t.name == "simple_switch_grpc")
    p4runtime = "; ".join(filter(None, ["" if grpc.usable else "simple_switch_grpc is " + grpc.status,
                                        client_problem()]))
    return {"tools": tools, "bmv2_complete": complete, "p4runtime": p4runtime}


def doctor_json(report: dict) -> dict:
    return {"bmv2_complete": report["bmv2_complete"], "p4runtime_ready": not report["p4runtime"],
            "p4runtime_problem": report["p4runtime"],
            "tools": [dict(asdict(t), usable=t.usable) for t in report["tools"]]}


def doctor_text(report: dict) -> str:
    lines = [t.line() for t in report["tools"]]
    if report["bmv2_complete"]:
        lines.append("bmv2 half complete: the switch tests and `thc p4` can run")
    else:
        missing = [t.name for t in report["tools"] if t.name in BMV2_HALF and not t.usable]
        lines.append(f"bmv2 half incomplete ({', '.join(missing)}): the switch tests skip")
    lines.append("P4Runtime control plane: " + (f"unavailable ({report['p4runtime']}); `thc p4` uses Thrift"
                                                if report["p4runtime"] else "ready (the default of `thc p4`)"))
    return "\n".join(lines)
