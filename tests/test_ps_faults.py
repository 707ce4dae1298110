"""The PS's own faults: killed and restarted under several jobs, stopped past the lease, gone for
good; and `thc launch --json` when its workers fail (the reproductions of issue 43, section 1)."""
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from thc_ps.deploy.launch import run_launch
from thc_ps.proto import control
from thc_ps.proto import headers as H
from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.server import PSServer
from tests.test_cli_errors import ROOT
from tests.test_service import _free_port, _start_ps, ask
from thc_ps.worker.transport import PSUnavailable, Transport


def status(port: int) -> dict:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port + 1}")
    try:
        return ask(sock, {"type": "status"}) or {}
    finally:
        sock.close(0)


def running(port: int) -> dict:
    """{job name: (job id, least progress of its live ranks, live ranks)} of the PS's running jobs."""
    return {j["job_name"]: (j["job_id"], min(j["progress"].values(), default=-1), len(j["live"]))
            for j in status(port).get("jobs", [])}


def launches(port: int, names: list, docs: dict, **kw) -> list:
    """run_launch of job `name` against the PS on `port`, one thread each, summaries into docs."""
    threads = [threading.Thread(target=lambda n=n: docs.__setitem__(n, run_launch(
        ps=f"127.0.0.1:{port}", job_name=n, **kw))) for n in names]
    for t in threads:
        t.start()
    return threads


def wait_until(what, threads: list, timeout: float = 120.0) -> None:
    """Until what() holds, while the launch threads run."""
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        assert all(t.is_alive() for t in threads), "a launch ended first"
        time.sleep(0.1)


def test_a_restarted_ps_resumes_three_jobs_whatever_ids_it_gives_them():
    """Reproduction: a restarted PS hands out job ids in the order jobs register again, and a
    worker whose job came back under another id gave up ("now runs another job
    configuration").  Three jobs run; the PS is killed (SIGKILL) and started again on the same
    port, and three other jobs take ids 1..3 before the workers are let back, so every job
    returns under an id it never had: each is exact, no chunk lost."""
    ROUNDS, names = 300, ["job-a", "job-b", "job-c"]
    port = _free_port()
    proc = _start_ps(port)
    docs, occupants, workers = {}, [], []
    others = {c.pid for c in multiprocessing.active_children()}
    # each round waits 20 ms before its data phase: no job ends before the last one starts
    threads = launches(port, names, docs, workers=2, rounds=ROUNDS, dim=1 << 13, straggler_delay_ms=20)
    try:
        wait_until(lambda: (lambda r: len(r) == 3 and all(p >= 10 for _, p, _ in r.values()))(running(port)),
                   threads)
        before = {n: v[0] for n, v in running(port).items()}
        workers = [c for c in multiprocessing.active_children() if c.pid not in others]
        assert len(workers) == 6
        for w in workers:                       # held back while the PS is replaced
            os.kill(w.pid, signal.SIGSTOP)
        proc.kill()                             # the PS dies mid-job ...
        proc.wait()
        proc = _start_ps(port)                  # ... and comes back on the same ports, where
        for k in (1, 2, 3):                     # three other jobs take ids 1, 2 and 3 first
            occupants.append(Transport("127.0.0.1", port, 0, job_name=f"occupant-{k}",
                                       propose=JobConfig(num_workers=1, job_id=k, slots=16)))
        assert sorted(t.job.job_id for t in occupants) == [1, 2, 3]
        for w in workers:
            os.kill(w.pid, signal.SIGCONT)
        wait_until(lambda: (lambda r: all(r.get(n, (0, 0, 0))[2] == 2 for n in names))(running(port)), threads)
        after = {n: v[0] for n, v in running(port).items() if n in names}
        for t in threads:
            t.join(180)
        assert set(before) == set(after) == set(names)
        assert all(after[n] != before[n] and after[n] > 3 for n in names), (before, after)
        for n in names:
            doc = docs[n]
            assert doc["ok"], (n, doc["problems"])
            assert doc["exact_rounds"] == ROUNDS and doc["lost_chunks"] == 0 and doc["mismatched_chunks"] == 0
            assert doc["ps_restarts_survived"] == 2, doc    # each rank resumed once
    finally:
        for w in workers:
            if w.is_alive():
                os.kill(w.pid, signal.SIGCONT)
        for t in occupants:
            t.close()
        proc.kill()
        proc.wait()


def restart_in_process(server: PSServer, job) -> PSServer:
    """Stop `server` and start another PS with `job` on its ports."""
    data, control = server.data_addr[1], server.control_port
    server.stop()
    for _ in range(50):                     # ZeroMQ lets go of the port in its own thread
        try:
            return PSServer(job, ("127.0.0.1", data), control_port=control, lease_s=0.5).start()
        except zmq.ZMQError:
            time.sleep(0.1)
    raise RuntimeError(f"port {control} stayed busy")


def test_a_restarted_ps_running_another_configuration_is_refused_naming_it():
    """The id a restarted PS gives is no reason to stop, but another configuration under the
    same name is: the worker refuses it, naming the field."""
    server = PSServer(JobConfig(num_workers=1, bits=4), ("127.0.0.1", 0), control_port=0, lease_s=0.5).start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port)
    try:
        server = restart_in_process(server, JobConfig(num_workers=1, bits=2, job_id=7))
        with pytest.raises(ValueError, match="now runs another job configuration for job 'default': "
                                             "bits: PS has 2, worker expects 4"):
            t.run_phase(H.NORM, [(0, 1, bytes(4))])
    finally:
        t.close(leave=False)
        server.stop()


def test_a_barrier_goes_on_at_a_restarted_ps():
    """A rank waiting in a barrier when the PS restarts, and one that reaches the barrier
    after: both resume with the new PS and the barrier releases there."""
    job = JobConfig(num_workers=2)
    server = PSServer(job, ("127.0.0.1", 0), control_port=0, lease_s=0.5).start()
    ts = [Transport("127.0.0.1", server.data_addr[1], r, control_port=server.control_port) for r in (0, 1)]
    errors = []

    def barrier(t):
        try:
            t.barrier("start")
        except Exception as exc:        # surfaced below
            errors.append(exc)

    try:
        first = threading.Thread(target=barrier, args=(ts[0],))
        first.start()
        wait_until(lambda: server.status()["barriers"].get("start") == [0], [first])
        server = restart_in_process(server, job)
        second = threading.Thread(target=barrier, args=(ts[1],))
        second.start()
        for th in (first, second):
            th.join(60)
        assert not errors and not first.is_alive() and not second.is_alive(), errors
        assert [t.resumes for t in ts] == [1, 1] and server.status()["live"] == [0, 1]
    finally:
        for t in ts:
            t.close()
        server.stop()


def test_a_rank_whose_first_registration_crossed_the_restart_starts_with_the_others():
    """Reproduction (the fault soak, bench/soak.py): the PS was killed while a job assembled;
    rank 1's first registration reached only the new PS, so it knew of no restart and waited
    in barrier "start", while rank 0 asked the new PS to `resume`, which waited for every
    rank: both hung until the launch's watchdog stopped them.  The PS counts a rank waiting
    in barrier "start" as at phase 0, and the job starts."""
    from thc_ps.worker.client import Worker
    job = JobConfig(num_workers=2, codec="none")
    server = PSServer(job, ("127.0.0.1", 0), control_port=0, lease_s=0.5).start()
    ts = [Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port)]
    errors, done = [], []

    def start_and_round(t):
        try:
            t.barrier("start")
            done.append(Worker(t).allreduce(np.full(5000, 1.0 + t.worker_id, np.float32)))
        except Exception as exc:        # surfaced below
            errors.append(exc)

    try:
        first = threading.Thread(target=start_and_round, args=(ts[0],))
        first.start()
        wait_until(lambda: server.status()["barriers"].get("start") == [0], [first])
        server = restart_in_process(server, job)
        ts.append(Transport("127.0.0.1", server.data_addr[1], 1, control_port=server.control_port))
        second = threading.Thread(target=start_and_round, args=(ts[1],))
        second.start()
        for th in (first, second):
            th.join(60)
        assert not errors and not first.is_alive() and not second.is_alive(), errors
        assert [t.resumes for t in ts] == [1, 0] and len(done) == 2
        assert np.array_equal(done[0], done[1]) and (done[0] == 1.5).all()
    finally:
        for t in ts:
            t.close()
        server.stop()


def test_a_ps_that_never_comes_back_is_given_up_after_ps_wait_s_saying_so():
    server = PSServer(JobConfig(num_workers=1), ("127.0.0.1", 0), control_port=0, lease_s=0.5).start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port, ps_wait_s=2)
    try:
        server.stop()                           # gone for good
        with pytest.raises(PSUnavailable, match=r"answered nothing for 2\.[0-4] s \(no heartbeat reply\); "
                                                r"a worker waits ps_wait_s = 2 s"):
            t.run_phase(H.NORM, [(0, 1, bytes(4))])
    finally:
        t.close(leave=False)


def test_a_blob_round_reports_a_ps_restart_as_soon_as_it_is_known():
    """Reproduction: a BLOB codec's round learnt of a PS restart only when its retransmissions ran
    out (58 s); the heartbeat that finds the new PS ends it at once.  (The retry budget here
    would take minutes: only the restart can end the round within the bound.)"""
    job = JobConfig(num_workers=2, codec="topk")
    server = PSServer(job, ("127.0.0.1", 0), control_port=0, lease_s=0.5).start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port, max_retries=10_000)
    errors = []

    def blob_round():
        try:
            t.run_blob(b"\0" * 64, 16, t.next_blob_round())
        except PSUnavailable as exc:
            errors.append(exc)

    try:
        server = restart_in_process(server, job)
        th = threading.Thread(target=blob_round)
        th.start()
        th.join(60)
        assert not th.is_alive(), "the BLOB round did not end"
        assert "the PS restarted during BLOB round 1" in str(errors[0])
    finally:
        t.close(leave=False)
        server.stop()


@pytest.mark.parametrize("stall_s", [10, pytest.param(30, marks=pytest.mark.long)])
def test_a_stalled_ps_excuses_its_own_stall(stall_s):
    """Reproduction: a PS stopped (SIGSTOP) past the lease expired every lease when it woke,
    ended both jobs and blamed the workers ("the job ended while ranks 0, 1, 2 were away").
    Its control loop measures its own stall and extends every lease by it: both jobs exact."""
    ROUNDS, names = 400, ["stall-a", "stall-b"]
    port = _free_port()
    proc = _start_ps(port)                      # a 1 s lease: either stall is many leases long
    docs = {}
    threads = launches(port, names, docs, workers=2, rounds=ROUNDS, dim=1 << 13, straggler_delay_ms=20)
    try:
        wait_until(lambda: (lambda r: len(r) == 2 and all(p >= 10 for _, p, _ in r.values()))(running(port)),
                   threads)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(stall_s)
        os.kill(proc.pid, signal.SIGCONT)
        for t in threads:
            t.join(180)
        for n in names:
            doc = docs[n]
            assert doc["ok"], (n, doc["problems"])
            assert doc["exact_rounds"] == ROUNDS and doc["lost_chunks"] == 0 and doc["ps_restarts_survived"] == 0
            assert doc["lease_rejoins"] == 0 and not doc["away_at_end"]
            assert doc["ps"]["leases_expired"] == 0
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "the PS stalled for" in out and "lost its lease" not in out, out[-2000:]


@pytest.mark.parametrize("quorum,exact", [(1.0, 0), (0.5, 6)])
def test_launch_json_prints_its_line_when_a_worker_dies(quorum, exact):
    """Reproduction: `thc launch --json` printed nothing on stdout when no worker reported (one
    killed, the other raising for want of it at quorum 1).  At quorum 0.5 the survivor's
    rounds are all exact, and the line says so beside the dead worker."""
    proc = subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", "launch", "--workers", "2", "--rounds", "6",
                           "--dim", "4096", "--kill-rank", "1", "--kill-at-round", "2", "--lease-s", "0.5",
                           "--rejoin-grace-s", "1", "--quorum", str(quorum), "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["ok"] is False and doc["exact_rounds"] == exact and doc["rounds"] == 6, doc
    assert any("worker 1: killed at round 2" in p for p in doc["problems"]), doc["problems"]
    if quorum == 1.0:
        assert any(p.startswith("worker 0: JobStalled") and "rank 1" in p for p in doc["problems"]), doc["problems"]
    assert "killed at round 2" in proc.stderr



def test_a_launch_whose_rank_0_is_killed_still_reports_the_job_counters():
    """Reproduction (the fault soak, wave 90): the job's counters were read by rank 0 after the
    end barrier; killed there, and restarted into a job that had ended (quorum), it read
    nothing, so the launch reported no PS counters.  The lowest rank not killed reads them."""
    doc = run_launch(workers=3, rounds=8, dim=4096, codec="none", quorum=0.66, kill=(0, 3), restart=False,
                     lease_s=0.5, rejoin_grace_s=1.0, seed=3)
    assert doc["ps_job"] is not None, doc["problems"]
    assert doc["ps_job"]["rounds_completed"] == doc["ps"]["rounds_completed"] > 0


def test_launch_json_prints_its_line_when_the_ps_refuses_the_job():
    """A refused configuration exits 2 and, with --json, still ends with its JSON line."""
    from thc_ps.proto.job import JobConfig
    from thc_ps.ps_server.server import PSServer
    from bench.pauses import free_port_pair
    port = free_port_pair()
    server = PSServer(JobConfig(num_workers=2), ("127.0.0.1", port), control_port=port + 1).start()
    try:
        proc = subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", "launch", "--ps", f"127.0.0.1:{port}",
                               "--workers", "3", "--rounds", "2", "--json"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        server.stop()
    assert proc.returncode == 2, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["ok"] is False and doc["refused"] is True and "num_workers" in doc["problems"][0], doc


def _ps_process(port: int, log_path, *extra) -> subprocess.Popen:
    """`thc ps` on `port` (lease 1 s, no job options), its output to `log_path`, once it answers."""
    proc = subprocess.Popen([sys.executable, "-m", "thc_ps.deploy.cli", "ps", "--bind", f"127.0.0.1:{port}",
                             "--stats-every", "0", "--lease-s", "1", *extra], cwd=ROOT,
                            stdout=open(log_path, "a"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not status(port):
        assert proc.poll() is None and time.monotonic() < deadline, open(log_path).read()[-2000:]
        time.sleep(0.1)
    return proc


@pytest.mark.parametrize("cut", ["before_put", "after_put"])
def test_a_model_sync_cut_by_a_ps_kill_completes_with_the_same_parameters_everywhere(cut, tmp_path):
    """Reproduction: a model sync (sync_get/sync_put) cut by a PS restart failed at once ("a job
    resumes an interrupted data-plane phase only").  Three ranks with different parameters; the
    PS is killed (SIGKILL) while ranks 1 and 2 wait for the source's state (before_put), or
    after rank 0 put it and rank 1 took it, both now in the barrier, rank 2 not yet there
    (after_put), and started again on the same ports.  Every rank resumes with the others, the
    sync runs again at the new PS and every rank ends with rank 0's parameters, bit for bit.
    Ranks 1 and 2 never proposed the job (a restarted PS without job options learns it from
    whichever rank registers first: each sends its job again)."""
    from thc_ps.worker.client import Worker
    port, log = _free_port(), tmp_path / "ps.log"
    proc = _ps_process(port, log)
    job = JobConfig(num_workers=3, seed=5)
    ts = [Transport("127.0.0.1", port, 0, propose=job, ps_wait_s=60)]
    ts += [Transport("127.0.0.1", port, r, expect={"num_workers": 3}, ps_wait_s=60) for r in (1, 2)]
    rng = np.random.default_rng(3)
    states = [rng.standard_normal(70_000).astype(np.float32) for _ in range(3)]   # 280 kB each
    got, errors = {}, []

    def sync(r):
        try:
            got[r] = ts[r].sync_state(0, states[r].tobytes())
            Worker(ts[r]).allreduce(states[r][:5000])       # the job goes on after the sync
        except Exception as exc:        # surfaced below
            errors.append((r, exc))

    threads = {r: threading.Thread(target=sync, args=(r,)) for r in range(3)}
    try:
        rounds = [threading.Thread(target=Worker(t).allreduce, args=(states[0][:3000],)) for t in ts]
        for th in rounds:               # a gradient round first: the phases the resume agrees on
            th.start()
        for th in rounds:
            th.join(60)
        first = (1, 2) if cut == "before_put" else (0, 1)
        for r in first:
            threads[r].start()
        if cut == "before_put":         # both wait for a put that has not come
            time.sleep(1.0)
            assert not got and all(threads[r].is_alive() for r in first), errors
        else:                           # both took the state and wait in barrier sync-0
            wait_until(lambda: status(port).get("barriers", {}).get("sync-0") == [0, 1], [threads[0]])
        proc.kill()
        proc.wait()
        proc = _ps_process(port, log)
        for r in range(3):
            if not threads[r].is_alive() and r not in first:
                threads[r].start()
        for th in threads.values():
            th.join(120)
        assert not errors, errors
        assert sorted(got) == [0, 1, 2] and [got[r][1] for r in range(3)] == [True, False, False]
        for r in range(3):
            assert got[r][0] == states[0].tobytes(), f"rank {r} holds other parameters"
        assert [t.resumes for t in ts] == [1, 1, 1]
    finally:
        for t in ts:
            t.close()
        proc.kill()
        proc.wait()


def _thc_worker(port: int, rank: int, log_path, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "thc_ps.deploy.cli", "worker", "--ps", f"127.0.0.1:{port}",
                             "--rank", str(rank), "--dim", "4096", *extra], cwd=ROOT,
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def _until_running(port: int, ranks: int, procs: list, at_least: int = 5) -> None:
    deadline = time.monotonic() + 120
    while not (lambda j: j and len(j[0]["live"]) == ranks and min(j[0]["progress"].values()) >= at_least)(
            status(port).get("jobs")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.1)


def test_ps_wait_s_is_the_wait_from_the_ps_last_reply(tmp_path):
    """Reproduction: `thc worker --ps-wait-s 4` exited 8.0–8.1 s after the PS was killed, saying it
    "answered nothing for 6 s".  The silence is counted from the PS's last reply, to a tenth of
    a second, and a worker that gives up does not wait on the silent PS again (leave): it exits
    ps_wait_s after the last reply, which came within one heartbeat interval (lease_s / 5)
    before the kill."""
    port = _free_port()
    proc = _ps_process(port, tmp_path / "ps.log")      # lease 1 s: a heartbeat every 0.2 s
    log = tmp_path / "worker.log"
    w = _thc_worker(port, 0, log, "--workers", "1", "--rounds", "1000000", "--ps-wait-s", "4")
    try:
        _until_running(port, 1, [w])
        proc.kill()
        killed = time.monotonic()
        assert w.wait(30) == 1
        took = time.monotonic() - killed
    finally:
        for p in (w, proc):
            if p.poll() is None:
                p.kill()
    out = log.read_text()
    print(f"exit {took:.2f} s after the kill")
    # the give-up comes within 0.2 s of the wait (the message's 4.0–4.3 s below); the rest is the
    # process's exit, slower on a loaded host
    assert 4.0 - 0.2 - 0.1 <= took <= 4.0 + 1.0, (took, out[-2000:])
    import re
    said = re.search(r"answered nothing for (\d+\.\d) s \(no heartbeat reply\); a worker waits ps_wait_s = 4 s", out)
    assert said and 4.0 <= float(said.group(1)) <= 4.3, out[-2000:]


def test_workers_name_the_ps_when_it_is_the_silent_one(tmp_path):
    """Reproduction: while the PS was stopped for 10 s the workers printed "waiting for ranks 1, 2
    (1: not started…)", blaming ranks from the PS's last status, and never named the PS.  A PS
    that leaves heartbeats unanswered is what a worker waits for; the job then goes on exact."""
    port = _free_port()
    proc = _ps_process(port, tmp_path / "ps.log")
    logs = [tmp_path / f"worker{r}.log" for r in range(3)]
    ws = [_thc_worker(port, r, logs[r], "--workers", "3", "--rounds", "400", "--straggler-delay-ms", "20")
          for r in range(3)]
    try:
        _until_running(port, 3, ws + [proc], at_least=20)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(10)
        os.kill(proc.pid, signal.SIGCONT)
        assert [w.wait(120) for w in ws] == [0, 0, 0], [log.read_text()[-1500:] for log in logs]
    finally:
        for p in ws + [proc]:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
    out = "".join(log.read_text() for log in logs)
    assert f"waiting for the PS at tcp://127.0.0.1:{port + 1} (no reply to heartbeats for" in out, out[-3000:]
    assert "waiting for rank" not in out, out[-3000:]


def _blob_packets(job, rank: int, token: int, nonce: int, dim: int = 64, flags: int = 0) -> list:
    """One rank's BLOB round 1 of a topk job, as datagrams."""
    from thc_ps.compression.codecs_builtin import TopKCodec
    from thc_ps.proto import blob as B
    payload = TopKCodec.pack(np.arange(0, dim, 8), np.full(dim // 8, 1.0 + rank, np.float32))
    return [H.build(H.Header(type=H.DATA, job_id=job.job_id, worker_id=rank, num_workers=job.num_workers,
                             elem_bits=8, slot=0, round=1, offset=off, count=len(f) - B.SUB_SIZE, op=H.OP_BLOB,
                             nonce=nonce, token=token, flags=flags), f)
            for off, f in B.fragments(payload, dim, job.elems_per_packet + B.SUB_SIZE)]


def test_a_rank_leaving_while_its_resend_is_answered_does_not_end_the_data_plane():
    """Reproduction (the fault soak, bench/soak.py): the PS's data thread answered a BLOB resend
    of rank 1 while its control thread unregistered rank 1 (it left): a KeyError ended the
    data thread, and every later job on that PS hung.  The Python engine takes one datagram or
    one (un)registration at a time."""
    from thc_ps.ps_server.reference import ReferencePS
    job = JobConfig(num_workers=2, codec="topk")
    ps = ReferencePS(job, nonce=9)
    for r in (0, 1):
        ps.register(r, "127.0.0.1", 5000 + r, token=100 + r)
    for r in (0, 1):
        for pkt in _blob_packets(job, r, 100 + r, 9):
            ps.process(pkt, ("127.0.0.1", 5000 + r))
    resend = _blob_packets(job, 1, 101, 9, flags=H.F_RETRANSMIT)[0]
    validated, order = threading.Event(), []
    original = ps._validate

    def slow_validate(datagram, addr):         # the control thread acts between the check and the reply
        checked = original(datagram, addr)
        validated.set()
        time.sleep(0.3)
        return checked

    ps._validate = slow_validate
    leaver = threading.Thread(target=lambda: (validated.wait(5), ps.unregister(1), order.append("left")))
    leaver.start()
    out = ps.process(resend, ("127.0.0.1", 5001))
    order.append("answered")
    leaver.join(5)
    assert out and out[0][1] == ("127.0.0.1", 5001) and order == ["answered", "left"]
    assert ps.stats()["results_resent"] == 1 and 1 not in ps.workers


def test_an_engine_error_is_counted_and_the_data_plane_goes_on():
    """Whatever a Python engine raises on one datagram, the PS's data thread goes on: the next
    datagrams are served, the failure counted (`engine_errors`) and logged."""
    server = PSServer(JobConfig(num_workers=1, codec="topk"), ("127.0.0.1", 0), control_port=0).start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port)
    try:
        engine = server.job.engine
        real, calls = engine.process, []

        def flaky(datagram, addr):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug in an engine")
            return real(datagram, addr)

        engine.process = flaky
        payload = b"\x00" * 4                       # topk: K = 0, nothing kept
        got = t.run_blob(payload, 16, t.next_blob_round())       # the first datagram raised: resent
        assert got is not None and calls and server.serving()
        assert server.stats()["engine_errors"] == 1
    finally:
        t.close()
        server.stop()


def test_a_backlog_of_requests_is_the_ps_own_time_not_a_rank_silence():
    """Reproduction (the fault soak on a starved host: ranks of jobs with no fault lost their
    lease): a control loop working through a backlog of requests judged leases against
    heartbeats still waiting in its queue, sent in time, and expired every rank.  The time it
    spends behind its queue is its own, excused like a stall; a rank that really went silent
    is still found once the PS has caught up."""
    lease_s, slow_s, asks = 1.5, 0.3, 20
    server = PSServer(JobConfig(num_workers=3, codec="none"), ("127.0.0.1", 0), control_port=0,
                      lease_s=lease_s).start()
    handle = server._handle

    def slow(ident, msg, peer):                 # a status request keeps the loop busy, short of a stall
        if isinstance(msg, dict) and msg.get("type") == "status":
            time.sleep(slow_s)
        return handle(ident, msg, peer)

    server._handle = slow
    ts = [Transport("127.0.0.1", server.data_addr[1], r, control_port=server.control_port) for r in range(3)]
    socks = []
    try:
        ts[2].close(leave=False)                # rank 2 goes silent for good; 0 and 1 heartbeat
        for _ in range(asks):
            sock = zmq.Context.instance().socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{server.control_port}")
            sock.send(control.encode({"type": "status"}))
            socks.append(sock)
        t0 = time.monotonic()
        for sock in socks:
            assert sock.poll(60_000), "a status request was never answered"
            sock.recv()
        assert time.monotonic() - t0 > 2 * lease_s       # the backlog outlasted the lease
        deadline = time.monotonic() + 4 * lease_s + 5
        while server.stats()["leases_expired"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(lease_s)
        expired, job = server.stats()["leases_expired"], server.job
        assert expired == 1 and job is not None, f"{expired} leases expired; the job {'runs' if job else 'ended'}"
        assert {r: m.state for r, m in job.members.items()} == {0: "live", 1: "live", 2: "dead"}
        assert server.stats()["stall_s_excused"] >= asks * slow_s / 2
    finally:
        for sock in socks:
            sock.close(0)
        for t in ts[:2]:
            t.close()
        server.stop()
