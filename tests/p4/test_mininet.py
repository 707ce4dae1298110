"""Mininet: one bmv2 switch, 4 hosts each running a real `thc worker`, 20 THC rounds through
the switch, every chunk exact against the in-process reference."""
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from deploy.launch import check_rounds
from p4.control import WorkerPort, job_commands, l2_commands, switch_job, worker_commands

ROOT = Path(__file__).resolve().parents[2]
DEBIAN_PY = "/usr/bin/python3"
N, ROUNDS, DIM = 4, 20, 4096


def _has_mininet():
    return subprocess.run([DEBIAN_PY, "-c", "import mininet.net"], capture_output=True).returncode == 0


@pytest.mark.skipif(not os.path.exists(DEBIAN_PY) or not _has_mininet(),
                    reason="Mininet not installed in Debian's python3 (apt-get install mininet)")
@pytest.mark.parametrize("mode", ["static", "p4run"])
def test_mininet_four_workers_through_the_switch(thc_json, tmp_path, mode):
    """static: the harness programs the job up front; p4run: `thc p4 run --attach` programs
    the job and each worker's entries when the worker registers."""
    job = switch_job(N)
    workers = [WorkerPort(i, f"10.0.0.{i + 1}", 5000 + i, f"00:00:00:00:00:{i + 1:02x}", i + 1) for i in range(N)]
    cmds = l2_commands({w.mac: w.switch_port for w in workers} | {"00:00:00:00:00:64": N + 1})
    if mode == "static":
        cmds += job_commands(job, "00:00:00:00:00:fe")
        for handle, w in enumerate(workers):
            cmds += worker_commands(w, handle)
    (tmp_path / "cmds.txt").write_text("\n".join(cmds) + "\n")
    ns = f"thcmn{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        proc = subprocess.run(["ip", "netns", "exec", ns, DEBIAN_PY, str(ROOT / "p4/harness/mininet_thc.py"),
                               "--json", str(thc_json), "--commands", str(tmp_path / "cmds.txt"),
                               "--python", sys.executable, "--repo", str(ROOT), "--out", str(tmp_path),
                               "--workers", str(N), "--rounds", str(ROUNDS), "--dim", str(DIM),
                               "--control-mode", mode],
                              capture_output=True, text=True, timeout=900)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(w["rc"] == 0 for w in doc["workers"]), doc["workers"]
    per_worker = {i: json.loads((tmp_path / f"worker{i}.json").read_text())["rounds"] for i in range(N)}
    check = check_rounds(job, 0, DIM, per_worker)
    print(json.dumps(check), doc["counters"], doc["control"])
    assert check["rounds"] == ROUNDS and check["exact_rounds"] == ROUNDS and check["mismatched_chunks"] == 0
    if mode == "p4run":
        # the switch counted every chunk's round: DIM/32 DATA chunks + 1 NORM chunk per round
        m = re.search(r"'rounds_completed': (\d+)", doc["control"])
        assert m and int(m.group(1)) == ROUNDS * (DIM // 32 + 1), doc["control"]
        assert sorted(re.findall(r"registered worker (\d)", doc["control"])) == [str(i) for i in range(N)]
