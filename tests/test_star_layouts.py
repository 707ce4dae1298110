"""THC-PS's layouts across a bridge of host namespaces (thc_ps.deploy.netns.star), as the capped peers
experiment runs them: a PS shard on every worker host (`thc launch --serve-shard`), and one PS
whose results cross the bridge once, by multicast, to every worker host."""
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
NETNS = netns.unavailable()
GROUP = "239.255.79.7:47123"
pytestmark = pytest.mark.skipif(NETNS is not None, reason=NETNS or "")


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _launch(net, host: int, ps: str, *extra) -> subprocess.Popen:
    """`thc launch --json` for rank `host` of a 2-worker job, in that host's namespace."""
    return subprocess.Popen(net.prefix(host) + [
        sys.executable, "-m", "thc_ps.deploy.cli", "launch", "--ps", ps, "--workers", "2", "--local-workers", "1",
        "--node-rank", str(host), "--rounds", "6", "--dim", str(1 << 15), "--json", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)


def _results(procs) -> list:
    docs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        docs.append(json.loads(out.strip().splitlines()[-1]))
    return docs


def test_colocated_shards_one_per_host_are_exact_and_both_carry_chunks():
    """Each host serves its own shard and uses both: every round exact on both hosts, and each
    shard completed rounds (the chunks were spread over the hosts, not sent to one)."""
    with netns.star(2) as net:
        shards = ",".join(f"{ip}:9000" for ip in net.ips)
        procs = [_launch(net, h, shards, "--serve-shard", f"{net.ips[h]}:9000") for h in range(2)]
        docs = _results(procs)
    for doc in docs:
        assert doc["ok"] and doc["exact_rounds"] == 6 and doc["mismatched_chunks"] == 0, doc["problems"]
        assert doc["lost_chunks"] == 0


def test_a_serve_shard_not_in_the_ps_list_is_refused_naming_both():
    run = subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", "launch", "--ps", "127.0.0.1:9000,127.0.0.1:9010",
                          "--serve-shard", "127.0.0.1:9020", "--workers", "2", "--local-workers", "1"],
                         capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    assert run.returncode != 0
    assert "--serve-shard 127.0.0.1:9020 is not one of the --ps shards (127.0.0.1:9000, 127.0.0.1:9010)" in \
        run.stderr + run.stdout


def test_a_result_group_crosses_the_bridge_once_per_result():
    """One PS on a host of its own, two worker hosts: the PS sends each result once to the
    group (its datagrams out = rounds completed + resends + straggler notices), the bridge
    delivers it to both hosts, and every round is exact on both."""
    with netns.star(3) as net:
        ps = subprocess.Popen(net.prefix(2) + [sys.executable, "-m", "thc_ps.deploy.cli", "ps", "--bind",
                                               f"{net.ips[2]}:9000", "--stats-every", "0", "--workers", "2",
                                               "--result-group", GROUP],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT)
        try:
            time.sleep(1.5)
            tx0 = netns.link_bytes(net)[2][0]
            docs = _results([_launch(net, h, f"{net.ips[2]}:9000", "--result-group", GROUP) for h in range(2)])
            tx = netns.link_bytes(net)[2][0] - tx0
        finally:
            out = stop_gracefully(ps)
    for doc in docs:
        assert doc["ok"] and doc["exact_rounds"] == 6 and doc["mismatched_chunks"] == 0, doc["problems"]
        assert doc["result_group"] == GROUP
    final = next(line for line in out.splitlines() if line.startswith("final stats shard 0: "))
    st = json.loads(final.split(": ", 1)[1])
    assert st["packets_out"] == st["rounds_completed"] + st["results_resent"] + st["stragglers_notified"]
    # the PS's own link carried each round's results about once, not once per worker host
    per_worker = docs[0]["bytes_down_per_round"] * 6
    assert per_worker < tx < 1.6 * per_worker, (tx, per_worker)
