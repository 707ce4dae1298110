"""Mininet through `thc p4 mininet`'s code path (deploy/mininet_run.py): one bmv2 switch, N hosts
each running a real `thc worker`, every chunk exact against the in-process reference; the
switch's counters agree with what the workers did.  Also with real kernel loss on the host
links (nftables) and a delayed worker, with and without partial aggregation, and two jobs
sharing the switch."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from thc_ps.deploy import mininet_run
from thc_ps.p4 import tools

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.bmv2,
    pytest.mark.skipif(tools.mininet_python() is None,
                       reason="Mininet not installed in Debian's python3 (apt-get install mininet)"),
]


def run(tmp_path, **kw):
    return mininet_run.run(build_dir=tmp_path / "build", **kw)


@pytest.mark.parametrize("mode", ["static", "p4run"])
def test_four_workers_through_the_switch(tmp_path, mode):
    """static: the job is preprogrammed; p4run: `thc p4 run --attach` programs the job and
    each worker's entries when the worker registers."""
    doc = run(tmp_path, workers=4, rounds=20, dim=4096, control=mode)
    assert doc["rounds"] == 20 and doc["exact_rounds"] == 20
    assert doc["mismatched_chunks"] == 0 and doc["lost_chunks"] == 0
    assert doc["chunks_per_round"] == 4096 // 32 + 1
    # the switch completed every chunk's round exactly once: DIM/32 DATA + 1 NORM per round
    assert doc["switch"]["rounds_completed"] == 20 * doc["chunks_per_round"]
    assert doc["switch"]["partial_rounds"] == 0 and not doc["netns_left"]
    if mode == "p4run":
        registered = sorted(l.split("registered rank ")[1][0] for l in doc["control_output"].splitlines()
                            if "registered rank " in l)
        assert registered == ["0", "1", "2", "3"], doc["control_output"]
    assert mininet_run.failed(doc) is None


def test_kernel_loss_and_a_straggler_are_repaired_exactly(tmp_path):
    """2% nftables drops each way on every host link and worker 2 delayed 30 ms per round:
    retransmission makes every chunk exact; the switch resent results the drops cost."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", "p4", "mininet", "--workers", "3",
                           "--rounds", "8", "--dim", "2048", "--loss", "0.02", "--straggler-delay-ms", "30",
                           "--straggler-rank", "2", "--out", str(tmp_path / "build"), "--json"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["exact_rounds"] == 8 and doc["mismatched_chunks"] == 0 and doc["lost_chunks"] == 0
    assert doc["kernel_drops"] > 0 and doc["retransmissions"] > 0
    assert doc["switch"]["rounds_completed"] == 8 * doc["chunks_per_round"]
    assert doc["switch"]["results_resent"] > 0


def test_partial_aggregation_with_a_straggler(tmp_path):
    """Quorum 3 of 4 and worker 3 delayed: the switch completes rounds without it (partial
    rounds); every worker's chunks are exact for the contributors their bitmap names."""
    doc = run(tmp_path, workers=4, rounds=8, dim=2048, quorum=0.75, straggler_delay_ms=60, straggler_rank=3)
    assert doc["mismatched_chunks"] == 0 and doc["lost_chunks"] == 0 and doc["exact_rounds"] == 8
    assert doc["switch"]["partial_rounds"] > 0
    assert doc["switch"]["rounds_completed"] == 8 * doc["chunks_per_round"]


def test_two_jobs_share_the_switch(tmp_path, control):
    """Two jobs of 3 workers each at once through `thc p4 run --attach` (the user's path),
    once per switch control plane: each job gets its own region, cell and lookup tables, and
    each is exact on its own."""
    doc = run(tmp_path, workers=3, rounds=10, dim=2048, control="p4run", jobs=2, switch=control)
    assert doc["switch_control"] == control
    assert [c["exact_rounds"] for c in doc["per_job"]] == [10, 10]
    assert doc["mismatched_chunks"] == 0 and doc["lost_chunks"] == 0
    assert doc["switch"]["rounds_completed"] == 2 * 10 * doc["chunks_per_round"]
    started = [l for l in doc["control_output"].splitlines() if " started: " in l]
    assert len(started) == 2 and len({l.split("slots ")[1] for l in started}) == 2, doc["control_output"]
    assert mininet_run.failed(doc) is None and not doc["netns_left"]
