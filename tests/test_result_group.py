"""A job's result group: the PS sends each result once, by IPv4 multicast, instead of once per
worker; a result a worker missed still reaches it alone when it retransmits."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from thc_ps.deploy import netns
from thc_ps.deploy.launch import one_host_group, run_launch
from thc_ps.deploy.procs import stop_gracefully
from thc_ps.proto import control
from thc_ps.proto import headers as H
from thc_ps.proto.job import JobConfig, parse_group
from thc_ps.ps_server.reference import ReferencePS
from thc_ps.ps_server.server import PSServer, make_engine
from tests.helpers import run_threads
from tests.test_ps_engine import ADDRS, NONCE, job_for, register_all, sequence, stable_seed
from tests.test_service import ps, transports
from thc_ps.worker.client import Worker

GROUP = "239.255.91.3:47311"
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value,message", [
    ("239.1.2.3", "must be ADDRESS:PORT"),
    ("239.1.2.3:80:1", "must be ADDRESS:PORT"),
    ("example.org:5000", "is not an IPv4 address"),
    ("10.0.0.7:5000", "is not a multicast address"),
    ("239.1.2.3:0", "port must be in 1..65535"),
    ("239.1.2.3:70000", "port must be in 1..65535"),
    ("239.1.2.3:http", "port must be in 1..65535"),
])
def test_a_bad_group_is_refused_naming_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=message):
        parse_group(value)
    with pytest.raises(ValueError, match=message):
        JobConfig(num_workers=2, result_group=value)


def test_the_group_travels_in_the_job_and_is_part_of_its_identity():
    assert parse_group("") is None and parse_group(GROUP) == ("239.255.91.3", 47311)
    job = JobConfig(num_workers=3, result_group=GROUP)
    assert JobConfig.from_msg(job.to_msg()) == job
    assert job.differences({"result_group": ""}) == [f"result_group: PS has {GROUP!r}, worker expects ''"]


def _expand(outputs: list, group: tuple, workers: list) -> list:
    """A group's datagram as the per-worker copies it stands for."""
    out = []
    for pkt, dest in outputs:
        out += [(pkt, w) for w in workers] if dest == group else [(pkt, dest)]
    return out


@pytest.mark.parametrize("codec,quorum", [("thc", 1.0), ("thc", 0.75), ("none", 1.0)])
def test_a_group_changes_only_where_fan_outs_go_and_both_engines_agree(codec, quorum):
    """The same random traffic (loss, duplicates, late and stale rounds, garbage) through the
    C engine and the reference with a group, and the reference without: the group engines
    agree byte for byte; each fan-out is one datagram to the group where the per-worker
    engine sends n; resent results, straggler and loss notices still go to their worker."""
    plain = job_for(codec, quorum)
    grouped = JobConfig(**{**plain.to_msg(), "table": (), "result_group": GROUP})
    seq = sequence(plain, seed=stable_seed("group", codec, quorum))
    ref, fast, per_worker = ReferencePS(grouped, NONCE), make_engine(grouped, "c", NONCE), ReferencePS(plain, NONCE)
    for e in (ref, fast, per_worker):
        register_all(e)
    group = parse_group(GROUP)
    out_ref = [ref.process(p, a) for p, a in seq]
    out_c = [fast.process(p, a) for p, a in seq]
    out_plain = [per_worker.process(p, a) for p, a in seq]
    assert out_c == out_ref
    assert [_expand(o, group, ADDRS) for o in out_ref] == out_plain
    s, sp = fast.stats(), per_worker.stats()
    fanned = sum(dest == group for step in out_c for _, dest in step)
    assert fanned == s["rounds_completed"] > 20 and s["results_resent"] > 0 and s["stragglers_notified"] > 0
    assert sp["packets_out"] - s["packets_out"] == fanned * (len(ADDRS) - 1)
    assert ref.stats() == s


def test_the_c_engine_refuses_a_group_that_is_not_multicast():
    from thc_ps.ps_server._fastpath import Engine
    args = dict(job_id=1, num_workers=2, slots=4, norm_slots=2, elems_per_packet=16, bits=4, lane_bits=8,
                op=H.OP_LOOKUP_SUM, quorum_count=2, table=list(range(16)), nonce=1)
    with pytest.raises(ValueError, match="multicast"):
        Engine(**args, group_ip="10.1.2.3", group_port=5000)
    with pytest.raises(ValueError, match="multicast"):
        Engine(**args, group_ip="239.1.2.3", group_port=70000)


def test_rounds_over_a_group_are_exact_with_one_datagram_per_result():
    doc = run_launch(workers=4, rounds=20, dim=1 << 16, result_group=GROUP)
    assert doc["ok"] and doc["exact_rounds"] == 20 and doc["mismatched_chunks"] == 0, doc["problems"]
    ps_ = doc["ps"]
    # one datagram per completed slot, plus whatever a busy machine made the PS resend
    assert ps_["packets_out"] == (ps_["rounds_completed"] + ps_["results_resent"] + ps_["stragglers_notified"]
                                  + ps_["notices"])


def test_a_cluster_on_one_host_picks_its_own_group_unless_told_otherwise(monkeypatch):
    """`auto` (launch's and train's default): a fresh organization-local group when the run
    starts its own PS, none when it joins a running one, none when loopback has no multicast
    route; a named group or "" is kept as given."""
    picked = {one_host_group("auto", own_ps=True) for _ in range(20)}
    assert len(picked) > 1                                  # random: side-by-side clusters differ
    for value in picked:
        addr, port = parse_group(value)
        assert addr.startswith("239.255.") and 1 <= port <= 65535
    assert one_host_group("auto", own_ps=False) == ""
    assert one_host_group(GROUP, own_ps=True) == GROUP and one_host_group("", own_ps=True) == ""
    monkeypatch.setattr("thc_ps.proto.sockets.multicast_unreachable", lambda src, group: "Network is unreachable")
    assert one_host_group("auto", own_ps=True) == ""


def test_a_launch_sends_results_to_a_group_by_default_and_joins_a_running_ps_as_it_is():
    doc = run_launch(workers=3, rounds=6, dim=5000)
    assert doc["ok"] and doc["exact_rounds"] == 6, doc["problems"]
    assert parse_group(doc["result_group"])[0].startswith("239.255.")
    ps_ = doc["ps"]
    assert ps_["packets_out"] == (ps_["rounds_completed"] + ps_["results_resent"] + ps_["stragglers_notified"]
                                  + ps_["notices"])
    # a launch that joins a running PS takes that PS's fan-out, with or without a group
    for group in ("", GROUP):
        server = PSServer(JobConfig(num_workers=2, result_group=group), ("127.0.0.1", 0), control_port=0).start()
        try:
            doc = run_launch(workers=2, rounds=3, dim=3000, ps=f"127.0.0.1:{server.data_addr[1]}",
                             ps_control_port=server.control_port)
        finally:
            server.stop()
        assert doc["ok"] and doc["exact_rounds"] == 3 and doc["result_group"] == group, doc["problems"]


def test_lost_group_datagrams_come_back_to_their_worker_alone():
    doc = run_launch(workers=4, rounds=20, dim=1 << 16, result_group=GROUP, loss=0.05)
    assert doc["ok"] and doc["exact_rounds"] == 20 and doc["mismatched_chunks"] == 0, doc["problems"]
    assert doc["injected"]["injected_drops_in"] > 50 and doc["ps"]["results_resent"] > 0


@pytest.mark.parametrize("codec", ["none", "topk"])
def test_other_codecs_use_the_group_too(codec):
    doc = run_launch(workers=3, rounds=8, dim=5000, codec=codec, result_group=GROUP)
    assert doc["ok"] and doc["exact_rounds"] == 8, doc["problems"]
    assert doc["ps"]["packets_out"] < doc["ps"]["packets_in"]      # not one per worker


def test_a_worker_deaf_to_the_group_still_gets_every_result_in_the_c_phase():
    """Rank 1's group socket never joined the group (a switch port that drops multicast, a
    missing IGMP membership): every one of its results comes back as a unicast resend after
    its retransmission, through the C phase loop, and both ranks decode the same average."""
    server = ps(JobConfig(num_workers=2, result_group=GROUP, slots=8))
    ts = transports(server, 2, timeout_ms=20.0)
    try:
        deaf = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        deaf.bind(("127.0.0.1", 0))
        deaf.setblocking(False)
        ts[1].gsock.close()
        ts[1].gsock = deaf
        assert all(t.phases._c_phase() for t in ts)
        grads = [np.random.default_rng(r).standard_normal(6000).astype(np.float32) for r in range(2)]
        workers = [Worker(t, error_feedback=False, seed=0) for t in ts]
        out: dict = {}

        def one(r):
            out[r] = workers[r].allreduce(grads[r])
        assert run_threads(one, 2) == []
        np.testing.assert_array_equal(out[0], out[1])
        # it hears a result only as the answer to a resend: at least one per chunk (the NORM
        # chunk and the DATA chunks of the 8192 padded coordinates)
        chunks = 1 + -(-8192 // ts[1].job.elems_per_packet)
        assert ts[1].stats.counters["retransmissions"] >= chunks
        assert server.engine.stats()["results_resent"] >= chunks
    finally:
        for t in ts:
            t.close()
        server.stop()


def test_a_second_job_on_the_same_group_is_refused_naming_the_first():
    server = ps()
    first = None
    try:
        first = transports(server, 1, propose=JobConfig(num_workers=2, result_group=GROUP), job_name="a")[0]
        with pytest.raises(ValueError, match=f"PS refused register: result_group {GROUP} is in use by job 1 .'a'."):
            transports(server, 1, propose=JobConfig(num_workers=2, result_group=GROUP), job_name="b")
        other = transports(server, 1, propose=JobConfig(num_workers=2, result_group="239.255.91.3:47312"),
                           job_name="c")[0]
        other.close()
    finally:
        if first is not None:
            first.close()
        server.stop()


def test_a_ps_driving_a_switch_refuses_a_group():
    switch = SimpleNamespace(slot_space=1024, max_jobs=4, fixed_nonce=None, fixed_tokens={})
    with pytest.raises(ValueError, match="a switch multicasts results itself"):
        PSServer(JobConfig(num_workers=2, result_group=GROUP), ("127.0.0.1", 0), control_port=0, engine=switch)
    server = PSServer(None, ("127.0.0.1", 0), control_port=0, engine=switch)     # not started
    try:
        with pytest.raises(control.ControlError, match="multicasts results itself; drop result_group"):
            server._check_group(JobConfig(num_workers=2, result_group=GROUP))
        server._check_group(JobConfig(num_workers=2))
    finally:
        server.sock.close()
        server.ctl.close(0)


def test_the_worker_names_the_group_it_cannot_join(monkeypatch):
    import thc_ps.worker.datagrams as T

    def refuse(*_a, **_k):
        raise OSError(19, "No such device")
    server = ps(JobConfig(num_workers=1, result_group=GROUP))
    try:
        with monkeypatch.context() as m:
            m.setattr(T, "group_socket", refuse)
            with pytest.raises(RuntimeError, match=f"worker 0: cannot join the job's result group {GROUP} "
                                                   f"on 127.0.0.1: .*No such device"):
                transports(server, 1)
        transports(server, 1)[0].close()        # it left: the rank is free at once
    finally:
        server.stop()


NETNS = netns.unavailable(need_nft=True)


def _thc_ps(net, bind: str, *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "THC_UDP_OFFLOAD": "0"}
    proc = subprocess.Popen(net.prefix(net.ps_ns) + [sys.executable, "-m", "thc_ps.deploy.cli", "ps", "--bind", bind,
                                                     "--stats-every", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    time.sleep(1.5)
    return proc, env


@pytest.mark.skipif(NETNS is not None, reason=NETNS or "")
def test_a_group_between_two_hosts_with_kernel_loss_is_exact():
    """PS and workers in two namespaces on a veth pair: the results cross as multicast, 5% of
    the datagrams each way (the group's included) dropped by nftables, and every round exact."""
    with netns.two_hosts(loss=0.05) as net:
        ps_proc, env = _thc_ps(net, f"{net.ps_ip}:9000", "--workers", "2", "--result-group", GROUP)
        try:
            run = subprocess.run(net.prefix(net.worker_ns) + [
                sys.executable, "-m", "thc_ps.deploy.cli", "launch", "--ps", f"{net.ps_ip}:9000", "--workers", "2",
                "--rounds", "10", "--dim", str(1 << 14), "--result-group", GROUP, "--json"],
                capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
            drops = net.nft_drops()
        finally:
            ps_out = stop_gracefully(ps_proc)
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    assert doc["exact_rounds"] == 10 and doc["mismatched_chunks"] == 0 and doc["lost_chunks"] == 0
    assert drops > 0 and doc["retransmissions"] > 0
    final = next(line for line in ps_out.splitlines() if line.startswith("final stats shard 0: "))
    ps_stats = json.loads(final.split(": ", 1)[1])
    # each result crossed once (not once per worker), plus the resends and notices the loss asked for
    assert ps_stats["packets_out"] == (ps_stats["rounds_completed"] + ps_stats["results_resent"]
                                       + ps_stats["stragglers_notified"] + ps_stats["notices"])
    assert ps_stats["results_resent"] > 0


@pytest.mark.skipif(NETNS is not None, reason=NETNS or "")
def test_a_ps_with_no_route_to_the_group_refuses_the_job_saying_so():
    """A PS bound to every interface of a host with no route for the group: the job is refused
    at registration, naming the group and the cause, instead of losing every result."""
    with netns.two_hosts() as net:
        ps_proc, env = _thc_ps(net, "0.0.0.0:9000")
        try:
            run = subprocess.run(net.prefix(net.worker_ns) + [
                sys.executable, "-m", "thc_ps.deploy.cli", "launch", "--ps", f"{net.ps_ip}:9000", "--workers", "1",
                "--rounds", "1", "--result-group", GROUP], capture_output=True, text=True, env=env, cwd=ROOT,
                timeout=120)
        finally:
            stop_gracefully(ps_proc)
    assert run.returncode != 0
    assert f"result_group {GROUP}: this PS cannot send to it (Network is unreachable)" in run.stderr + run.stdout
