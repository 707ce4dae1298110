"""PS and workers in separate network namespaces (two "hosts" on a veth pair) with real
kernel loss from an nftables random-drop rule: rounds stay exact under `retransmit`, and
the namespaces are gone afterwards."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from thc_ps.deploy import netns
from thc_ps.deploy.procs import stop_gracefully

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(netns.unavailable(need_nft=True) is not None,
                    reason=netns.unavailable(need_nft=True) or "")
def test_kernel_loss_between_namespaces_is_repaired_exactly():
    # Offload off: nftables sees a GSO batch as one packet, so with offload on one
    # "drop" removes a whole batch and a short run may see none.  Per-datagram loss is
    # what this test (and `thc experiment loss`) injects.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "THC_UDP_OFFLOAD": "0"}
    py = [sys.executable, "-m", "thc_ps.deploy.cli"]
    with netns.two_hosts(loss=0.05) as net:
        names = (net.ps_ns, net.worker_ns)
        ps = subprocess.Popen(net.prefix(net.ps_ns) + py + ["ps", "--bind", f"{net.ps_ip}:9000", "--workers", "2",
                                                            "--stats-every", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        try:
            time.sleep(1.5)
            run = subprocess.run(net.prefix(net.worker_ns) + py + [
                "launch", "--ps", f"{net.ps_ip}:9000", "--workers", "2", "--rounds", "10",
                "--dim", str(1 << 14), "--json"], capture_output=True, text=True, env=env, cwd=ROOT,
                timeout=300)
            drops = net.nft_drops()
        finally:
            stop_gracefully(ps)
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    assert doc["exact_rounds"] == 10 and doc["mismatched_chunks"] == 0 and doc["lost_chunks"] == 0
    assert drops > 0 and doc["retransmissions"] > 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
