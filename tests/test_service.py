"""A PS you can leave running: jobs that cannot leak into each other, membership that survives
crashes, an authenticated and validated control plane (the reproductions of the service issue)."""
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from thc_ps.deploy.launch import run_launch
from thc_ps.proto import control
from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.server import PSServer
from thc_ps.worker.client import Worker
from thc_ps.worker.transport import JobStalled, Transport

DIM = 1 << 12


def ps(job=None, **kw):
    return PSServer(job, ("127.0.0.1", 0), control_port=0, **kw).start()


def at(server) -> dict:
    """run_launch arguments for a PS started here (its control port is not data port + 1)."""
    return {"ps": f"127.0.0.1:{server.data_addr[1]}", "ps_control_port": server.control_port}


def transports(server, n, **kw) -> list:
    """Ranks 0..n-1 registered with `server`."""
    return [Transport("127.0.0.1", server.data_addr[1], r, control_port=server.control_port, **kw)
            for r in range(n)]


def req_socket(server, curve=None):
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = curve
    sock.connect(f"tcp://127.0.0.1:{server.control_port}")
    return sock


def ask(sock, msg, timeout_ms=5000):
    sock.send(msg if isinstance(msg, bytes) else control.encode(msg))
    if not sock.poll(timeout_ms):
        return None
    return control.decode(sock.recv())


def test_consecutive_jobs_of_different_shapes_start_clean():
    """Reproduction: the second job on a running PS lost 2376/2400 chunks and exited 0."""
    server = ps(lease_s=1.0)
    try:
        a = run_launch(workers=4, rounds=20, dim=DIM, **at(server))
        b = run_launch(workers=4, rounds=20, dim=DIM, **at(server))
        c = run_launch(workers=2, rounds=10, dim=3000, codec="none", **at(server))
        for doc, rounds in ((a, 20), (b, 20), (c, 10)):
            assert doc["ok"], doc["problems"]
            assert doc["exact_rounds"] == rounds and doc["lost_chunks"] == 0
        st = server.stats()
        assert st["jobs_started"] == 3 and st["jobs_ended"] == 3 and server.job is None
    finally:
        server.stop()


def test_worker_states_the_job_it_expects():
    """Reproduction: a float32 job's workers ran against a THC PS without complaint."""
    server = ps(JobConfig(num_workers=2))
    try:
        with pytest.raises(ValueError, match=r"codec: PS has 'thc', worker expects 'none'"):
            Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port,
                      expect={"codec": "none", "num_workers": 2}, heartbeat=False)
        with pytest.raises(ValueError, match=r"num_workers: PS has 2, worker expects 4"):
            Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port,
                      expect={"num_workers": 4}, heartbeat=False)
        assert server.stats()["registrations_refused"] == 2 and server.job is None
    finally:
        server.stop()


def test_a_live_rank_cannot_be_claimed_twice():
    """Reproduction: job B's workers, pointed at job A's PS, were aggregated into A."""
    server = ps(JobConfig(num_workers=2))
    try:
        t0 = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port)
        with pytest.raises(ValueError, match="rank 0 is held by a live worker"):
            Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port,
                      control_timeout_s=1.0, heartbeat=False)
        t0.close()
    finally:
        server.stop()


def test_a_worker_may_register_again_with_its_own_session():
    """After a PS restart a worker's heartbeat and its phase can both ask it to register again;
    the second registration must not find the rank 'held' by the first (itself)."""
    server = ps(JobConfig(num_workers=1))
    try:
        (t,) = transports(server, 1, heartbeat=False)
        first = t.sessions[0]
        t.session.register(0)
        assert t.sessions[0]["token"] != first["token"] and not t.sessions[0]["rejoin"]
        assert server.stats()["rejoins"] == 0
        sock = req_socket(server)                                     # the old session is void
        reply = ask(sock, {"type": "heartbeat", "worker_id": 0, "session": first["session"]})
        assert reply["type"] == "error" and "unknown session" in reply["message"]
        sock.close(0)
        t.close()
    finally:
        server.stop()


def test_barrier_counts_distinct_live_ranks():
    """Reproduction: three `end` requests from one client released a barrier of 4."""
    server = ps(JobConfig(num_workers=3))
    try:
        ts = transports(server, 3)
        socks = []
        for rank in (0, 0, 0, 1):                  # rank 0 three times, from three connections
            sock = req_socket(server)
            socks.append(sock)
            msg = {"type": "barrier", "name": "x", "worker_id": rank, "session": ts[rank].sessions[0]["session"]}
            assert ask(sock, msg, 300) is None     # not released: rank 2 has not arrived
        stranger = req_socket(server)
        reply = ask(stranger, {"type": "barrier", "name": "x", "worker_id": 2, "session": b"\0" * 16})
        assert reply["type"] == "error" and "unknown session" in reply["message"]
        ts[2].barrier("x")                         # the third distinct rank releases it
        assert socks[-1].poll(2000) and control.decode(socks[-1].recv())["type"] == "ok"
        assert socks[-2].poll(2000) and control.decode(socks[-2].recv())["type"] == "ok"
        for sock in socks + [stranger]:
            sock.close(0)
        for t in ts:
            t.close()
    finally:
        server.stop()


def test_control_plane_survives_bad_messages():
    """Reproduction: one register with a huge worker id killed the control thread for good."""
    server = ps(JobConfig(num_workers=2), max_message=1 << 16)
    try:
        sock = req_socket(server)
        bad = [b"\xc1", control.encode([1]), control.encode({"type": 7}),
               control.encode({"type": "register", "worker_id": 1 << 63, "data_addr": ["127.0.0.1", 5]}),
               control.encode({"type": "register", "worker_id": 0, "data_addr": ["127.0.0.1", 1 << 40]}),
               control.encode({"type": "register", "worker_id": 0, "data_addr": ["not-an-ip", 5]}),
               control.encode({"type": "register", "worker_id": 0, "data_addr": ["1.2.3.4", 5],
                               "expect": {"codec": ["x"]}}),
               control.encode({"type": "register", "worker_id": 0, "data_addr": ["1.2.3.4", 5], "x": 1}),
               control.encode({"type": "sync_put", "round": -1, "worker_id": 0, "session": b"", "blob": b""}),
               control.encode({"type": "heartbeat", "worker_id": 0, "session": "text"}),
               control.encode({"type": "shutdown", "now": True})]
        for raw in bad:
            reply = ask(sock, raw)
            assert reply is not None and reply["type"] == "error", raw
        # an oversized message is dropped by ZeroMQ (the connection is reset), nothing stored
        big = req_socket(server)
        assert ask(big, {"type": "stats", "pad": b"x" * (1 << 17)}, 1000) is None
        big.close(0)
        assert ask(sock, {"type": "stats"})["type"] == "stats"
        assert server.stats()["control_errors"] == len(bad) and server.job is None
        sock.close(0)
        # and a job still runs exactly afterwards
        doc = run_launch(workers=2, rounds=5, dim=DIM, **at(server))
        assert doc["ok"] and doc["exact_rounds"] == 5
    finally:
        server.stop()


def test_model_sync_source_is_the_lowest_live_rank():
    """Reproduction: a stranger overwrote model-sync state."""
    server = ps(JobConfig(num_workers=2))
    try:
        ts = transports(server, 2)
        with pytest.raises(ValueError, match="not the model-sync source"):
            ts[1].call({"type": "sync_put", "round": 0, "blob": b"evil"})
        ts[0].call({"type": "sync_put", "round": 0, "blob": b"good"})
        assert ts[1].call({"type": "sync_get", "round": 0}, wait=True)["blob"] == b"good"
        for t in ts:
            t.close()
    finally:
        server.stop()


def test_curve_keys_keep_strangers_out(tmp_path):
    from thc_ps.proto.keys import client_keys, create_keys
    keys = create_keys(tmp_path / "keys")
    server = ps(JobConfig(num_workers=2), keys=keys)
    try:
        plain = req_socket(server)                    # no keys: the handshake never completes
        assert ask(plain, {"type": "shutdown"}, 1000) is None
        plain.close(0)
        other = create_keys(tmp_path / "other")
        wrong = req_socket(server, client_keys(other))   # keys the PS did not authorize
        assert ask(wrong, {"type": "stats"}, 1000) is None
        wrong.close(0)
        doc = run_launch(workers=2, rounds=5, dim=DIM, **at(server), keys=str(keys))
        assert doc["ok"] and doc["exact_rounds"] == 5
        assert not server.wait(0.1)                    # nobody stopped it
    finally:
        server.stop()


def test_killed_worker_is_named_when_the_job_needs_it():
    """Reproduction: survivors blamed 'no reply from PS' after 58 s; the PS knew who was missing."""
    server = ps(JobConfig(num_workers=3), lease_s=0.5, rejoin_grace_s=1.0)
    try:
        ts = transports(server, 3, timeout_ms=20, max_timeout_ms=100, max_retries=40)
        ws = [Worker(t, error_feedback=False) for t in ts]
        ts[2].close(leave=False)                       # rank 2 dies without a word
        errors = []

        def survivor(w):
            try:
                w.allreduce(np.ones(DIM, np.float32))
            except Exception as exc:
                errors.append(exc)
        th = [threading.Thread(target=survivor, args=(w,)) for w in ws[:2]]
        for t in th:
            t.start()
        for t in th:
            t.join(60)
        assert len(errors) == 2 and all(isinstance(e, JobStalled) for e in errors), errors
        assert all("rank 2 (2: no heartbeat for" in str(e) for e in errors), errors
        for t in ts[:2]:
            t.close()
    finally:
        server.stop()


def test_quorum_job_survives_a_dead_worker_and_every_survivor_reports():
    doc = run_launch(workers=4, rounds=12, dim=DIM, quorum=0.75, kill=(3, 4), lease_s=0.5)
    assert doc["ranks"] == [0, 1, 2] and doc["mismatched_chunks"] == 0
    assert doc["problems"] == ["worker 3: killed at round 4 (fault injection)"]
    assert doc["ps"]["leases_expired"] == 1 and doc["ps"]["partial_rounds"] > 0


@pytest.mark.parametrize("quorum", [1.0, 0.75])
def test_restarted_rank_rejoins_the_running_job(quorum):
    doc = run_launch(workers=3, rounds=14, dim=DIM, quorum=quorum, kill=(1, 5), restart=True,
                     lease_s=0.5)
    assert doc["ok"], doc["problems"]
    assert doc["restarted_workers"] == 1 and doc["ps"]["rejoins"] == 1
    assert doc["mismatched_chunks"] == 0 and doc["exact_rounds"] == 14


def test_two_hosts_launch_their_share_of_ranks():
    """Reproduction: two launches of 2 workers against an n = 4 PS both failed."""
    server = ps(lease_s=1.0)
    try:
        docs = {}
        th = [threading.Thread(target=lambda b=b: docs.__setitem__(b, run_launch(
            workers=4, rounds=8, dim=DIM, **at(server), rank_base=b, local_workers=2)))
              for b in (0, 2)]
        for t in th:
            t.start()
        for t in th:
            t.join(120)
        assert docs[0]["ranks"] == [0, 1] and docs[2]["ranks"] == [2, 3]
        assert all(d["ok"] and d["exact_rounds"] == 8 for d in docs.values())
    finally:
        server.stop()


def _free_port():
    for _ in range(100):
        port = int(np.random.default_rng().integers(20000, 40000)) & ~1
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u, \
                    socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
                u.bind(("127.0.0.1", port))
                t.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port")


def _start_ps(port, *extra):
    proc = subprocess.Popen([sys.executable, "-m", "thc_ps.deploy.cli", "ps", "--bind", f"127.0.0.1:{port}",
                             "--stats-every", "0", "--lease-s", "1", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    assert "PS shard 0" in line, line
    return proc


@pytest.mark.parametrize("policy", ["retransmit", "zero"])
def test_restarted_ps_is_detected_and_workers_resume(policy):
    """Reproduction: after a PS restart every retransmission was dropped as unregistered."""
    ROUNDS = 600
    port = _free_port()
    proc = _start_ps(port, "--workers", "3")
    docs = []
    try:
        th = threading.Thread(target=lambda: docs.append(run_launch(
            workers=3, rounds=ROUNDS, dim=1 << 14, ps=f"127.0.0.1:{port}", policy=policy,
            timeout_ms=50)))
        th.start()
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port + 1}")
        for _ in range(300):                          # wait until the job is well under way
            st = ask(sock, {"type": "status"})
            if min(st.get("progress", {"-": 0}).values(), default=0) >= 20:
                break
            time.sleep(0.1)
        sock.close(0)
        assert th.is_alive() and len(st["progress"]) == 3
        proc.kill()                                   # the PS dies mid-job ...
        proc.wait()
        time.sleep(0.5)
        proc = _start_ps(port, "--workers", "3")       # ... and comes back on the same ports
        th.join(180)
        doc = docs[0]
        assert doc["ps_restarts_survived"] >= 3 and doc["mismatched_chunks"] == 0, doc
        if policy == "retransmit":
            assert doc["ok"] and doc["lost_chunks"] == 0 and doc["exact_rounds"] == ROUNDS, doc["problems"]
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_prints_the_final_stats():
    port = _free_port()
    proc = _start_ps(port)
    proc.terminate()
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "final stats shard 0" in out


def test_warning_when_bound_to_every_interface_without_keys():
    lines = []
    server = PSServer(None, ("0.0.0.0", 0), control_port=0, log=lines.append)
    server.stop()
    assert any("WITHOUT keys" in m for m in lines)


@pytest.mark.parametrize("argv,message", [
    (["launch", "--shards", "40000"], "a shard count in 1..16"),
    (["launch", "--straggler-delay-ms", "1e9"], "milliseconds in [0, 60000]"),
    (["ps", "--control-port", "70000"], "a port number in 1..65535"),
    (["worker", "--ps", "127.0.0.1:9000", "--timeout-ms", "0"], "milliseconds in [1, 60000]"),
    (["train", "--lr", "nan"], "a learning rate"),
    (["worker", "--ps", "127.0.0.1:9000", "--report", "/nonexistent/dir/r.json"], "does not exist"),
    (["launch", "--workers", "33"], "1..32"),
    (["launch", "--dim", "-5"], "a dimension"),
    (["launch", "--kill-rank", "1", "--kill-at-round", "20", "--rounds", "10"], "below --rounds"),
    (["launch", "--rank-base", "2"], "need --local-workers"),
    (["launch", "--local-workers", "2", "--rank-base", "3"], "do not fit"),
])
def test_nonsense_arguments_exit_2_with_one_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", *argv], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_launch_exits_1_when_its_check_fails():
    """Reproduction: `thc launch` exited 0 with mismatched chunks and with every chunk lost."""
    proc = subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", "launch", "--workers", "2",
                           "--rounds", "6", "--dim", "4096", "--quorum", "0.5", "--kill-rank", "1",
                           "--kill-at-round", "2", "--lease-s", "0.5", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "killed at round 2" in proc.stderr
