"""`thc p4 mininet` tears everything down on failure and on Ctrl-C: no namespace, interface or
process is left.  Runs with fake bmv2/p4c tools (a "switch" that forwards nothing), so it
needs only root, Debian's mininet and util-linux's unshare — not p4lang's tools."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from thc_ps.p4 import tools
from tests.p4.test_tools import fake_tools

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(tools.mininet_python() is None,
                       reason="Mininet not installed in Debian's python3 (apt-get install mininet)"),
    pytest.mark.skipif(tools.system_tool("unshare") is None, reason="unshare (util-linux) not installed"),
]


def fake_switch_tools(d: Path, answers: bool) -> Path:
    """simple_switch that runs (forwarding nothing) until killed; a CLI that either never sees
    the program (`answers` False) or accepts every command."""
    fake_tools(d)
    (d / "simple_switch").write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 1.15.5 && exit 0\n"
                                     "while true; do sleep 1; done\n")
    (d / "simple_switch_CLI").write_text("#!/bin/sh\ncat >/dev/null\n"
                                         + ("echo ThcIngress.thc_config\n" if answers else "") + "exit 0\n")
    (d / "p4c-bm2-ss").write_text("#!/bin/sh\nwhile [ $# -gt 0 ]; do [ \"$1\" = -o ] && echo '{}' > \"$2\"; "
                                  "shift; done\n")
    return d


def processes_mentioning(marker: str) -> list:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append(f"{pid}: {cmd[:160]}")
    return found


def mininet_links() -> list:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return re.findall(r"^\d+: ((?:s1|h\d+)-eth\d+)", out, re.M)


def start(tmp_path, answers: bool) -> subprocess.Popen:
    d = fake_switch_tools(tmp_path / "bin", answers)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PATH": f"{d}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(tmp_path / "tmp"),
           "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "thc_ps.deploy.cli", "p4", "mininet", "--workers", "2",
                             "--rounds", "2", "--out", str(tmp_path / "build")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def assert_nothing_left(tmp_path, stdout: str, links_before: list):
    ns = re.search(r"namespace (thcmn-[0-9a-f]+)", stdout)
    assert ns, stdout
    assert ns.group(1) not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert processes_mentioning(str(tmp_path)) == []
    assert mininet_links() == links_before


def test_failure_tears_everything_down(tmp_path):
    links = mininet_links()
    proc = start(tmp_path, answers=False)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err   # a run that failed (2 is for bad arguments)
    assert "did not answer on Thrift port" in err and len(err.strip().splitlines()) == 1
    assert_nothing_left(tmp_path, out, links)


def test_ctrl_c_tears_everything_down(tmp_path):
    links = mininet_links()
    proc = start(tmp_path, answers=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            # the workers (report paths under our TMPDIR) are running inside the Mininet hosts
            if sum("thc_ps.deploy.cli worker" in p for p in processes_mentioning(str(tmp_path))) == 2:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the workers never started: {proc.communicate(timeout=30)}")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "interrupted" in err, err
    assert_nothing_left(tmp_path, out, links)
