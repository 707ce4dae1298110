"""What a new user meets when something is off (issue 43, "Messages and exit codes"): each
test reproduces one finding and failed before its fix."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.pauses import free_port_pair
from thc_ps.deploy.commands import format_status
from thc_ps.proto.control import describe_behind
from thc_ps.proto.job import JobConfig
from thc_ps.proto.keys import HandshakeFailed, create_keys
from thc_ps.ps_server.server import PSServer
from thc_ps.worker.transport import Transport

ROOT = Path(__file__).resolve().parents[1]


def thc(*argv, timeout=120, **kw):
    return subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, **kw)


def _client_dir(d: Path, client_from: Path, server_from: Path) -> Path:
    """A worker's key directory: client.key_secret of one `thc keys` directory, server.key of another."""
    d.mkdir()
    shutil.copy(client_from / "client.key_secret", d / "client.key_secret")
    shutil.copy(server_from / "server.key", d / "server.key")
    return d


@pytest.mark.parametrize("which,cause", [
    ("none", "the PS runs with --keys (CURVE) and this client has no keys: pass --keys DIR"),
    ("unauthorized", "the PS refused this client's key: its public key is not in the PS's keys/authorized/"),
    ("other server", "this client's server.key is not that PS's public key"),
])
def test_keys_that_do_not_fit_are_named_at_once_by_both_ends(tmp_path, which, cause):
    """Reproduction: unauthorized keys waited 32 s for "no reply from the PS control plane", with
    no word of keys, and the PS logged nothing.  The worker's wait here is 60 s: the
    error must come from the failed handshake, not from the timeout."""
    keys, other = create_keys(tmp_path / "keys"), create_keys(tmp_path / "other")
    client = {"none": lambda: None, "unauthorized": lambda: _client_dir(tmp_path / "c", other, keys),
              "other server": lambda: _client_dir(tmp_path / "c", keys, other)}[which]()
    lines = []
    server = PSServer(JobConfig(num_workers=1), ("127.0.0.1", 0), control_port=0, keys=keys,
                      log=lines.append).start()
    try:
        with pytest.raises(HandshakeFailed) as exc:
            Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port,
                      keys=client, control_timeout_s=60)
        assert cause in str(exc.value)
        assert f"tcp://127.0.0.1:{server.control_port} refused the connection" in str(exc.value)
    finally:
        server.stop()
    said = [line for line in lines if "CURVE handshake refused" in line]
    assert said and said[0].startswith("WARNING: control plane: CURVE handshake refused: ")
    ps_cause = {"none": "a client without keys", "unauthorized": "not among this PS's authorized keys",
                "other server": "another PS's server.key"}[which]
    assert any(ps_cause in line for line in said), said


ENV = {**os.environ, "THC_HOST_CHECK": "0"}     # no note about other sessions' load on stderr


def _ps(job=None, **kw) -> PSServer:
    """A PS on a data port whose control port is the next one (as `thc launch --ps` expects)."""
    port = free_port_pair()
    return PSServer(job, ("127.0.0.1", port), control_port=port + 1, **kw).start()


def _addr(server) -> str:
    return f"127.0.0.1:{server.data_addr[1]}"


def test_a_refused_configuration_exits_2_with_one_line():
    """Reproduction: `thc launch --ps` against a PS running another job exited 1, with a
    ValueError per worker."""
    server = _ps(JobConfig(num_workers=2, codec="none"))
    try:
        proc = thc("launch", "--ps", _addr(server), "--workers", "2", "--rounds", "3", "--dim", "2000",
                   "--codec", "thc", env=ENV)
    finally:
        server.stop()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("thc launch: error: PS refused register: job configuration differs: codec: "
                           "PS has 'none', worker expects 'thc'\n"), proc.stderr


def _children(pid: int) -> list:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return out.split()


def _interrupt_when(proc, ready, timeout=120) -> tuple:
    """Ctrl-C as a terminal sends it (SIGINT to the whole process group) once `ready()`."""
    deadline = time.monotonic() + timeout
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)
    return proc.communicate(timeout=120)


def test_an_interrupted_launch_leaves_its_job_and_exits_130_with_one_line():
    """Reproduction: Ctrl-C of `thc launch` exited 1, and `launch --ps` sent no leave: the job
    showed live until the lease lapsed (60 s here: only a leave ends it at once)."""
    server = _ps(JobConfig(num_workers=2, codec="none"), lease_s=60)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "thc_ps.deploy.cli", "launch", "--ps", _addr(server),
                                 "--workers", "2", "--rounds", "1000000", "--dim", "2000", "--codec", "none"],
                                cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        running = lambda: any(min(j["progress"].values(), default=-1) >= 2 for j in server.status()["jobs"])
        out, err = _interrupt_when(proc, running)
        assert proc.returncode == 130 and err == "thc launch: interrupted\n", err
        assert server.status()["jobs"] == [], "the interrupted workers did not leave"
        assert server.stats()["jobs_ended"] == 1 and server.stats()["leases_expired"] == 0
    finally:
        server.stop()


@pytest.mark.parametrize("own_ps", [True, False])
def test_an_interrupted_train_exits_130_with_one_line(own_ps):
    """Reproduction: Ctrl-C of `thc train` printed 92 lines of worker tracebacks.  With --ps
    the workers leave their job (the PS's lease is 60 s: only a leave ends it at once)."""
    server = None if own_ps else _ps(lease_s=60)
    where = [] if own_ps else ["--ps", _addr(server)]
    try:
        proc = subprocess.Popen([sys.executable, "-m", "thc_ps.deploy.cli", "train", "--workers", "2", "--epochs", "50",
                                 "--model", "mlp", "--train-limit", "20000", "--test-limit", "100",
                                 "--no-baseline", *where],
                                cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        if own_ps:
            started = lambda: len(_children(proc.pid)) >= 3        # 2 workers + multiprocessing's tracker
        else:
            started = lambda: any(min(j["progress"].values(), default=-1) >= 2 for j in server.status()["jobs"])
        out, err = _interrupt_when(proc, started)
        assert proc.returncode == 130 and err == "thc train: interrupted\n", err
        if own_ps:
            assert out.startswith("training mlp on Fashion-MNIST: PS + 2 workers on loopback"), out
        else:
            assert out.startswith(f"training mlp on Fashion-MNIST: 2 workers here, through the PS at {_addr(server)}")
            assert server.status()["jobs"] == [], "the interrupted workers did not leave"
    finally:
        if server is not None:
            server.stop()


def test_train_against_a_ps_running_another_job_exits_2_with_one_line():
    server = _ps(JobConfig(num_workers=2, codec="none"))
    try:
        proc = thc("train", "--ps", _addr(server), "--workers", "2", "--epochs", "1", "--model", "mlp",
                   "--train-limit", "256", "--test-limit", "100", env=ENV)
    finally:
        server.stop()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("thc train: error: PS refused register: job configuration differs: codec: "
                                  "PS has 'none', worker expects 'thc'"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_train_takes_keys_and_says_where_it_trains(tmp_path, monkeypatch, capsys):
    """Reproduction: `thc train` had no --keys (a keyed PS then failed after 38 s saying "this
    worker needs --keys too"), and `thc train --ps` said "PS + 4 workers on loopback"."""
    from thc_ps.deploy import cli, train
    seen = {}

    def fake(cfg, log, baseline):
        seen["keys"], seen["ps"] = cfg.keys, cfg.ps
        return {"run": {"epochs": [], "seconds": 0.0, "bytes_up": 0, "bytes_down": 0}}

    monkeypatch.setattr(train, "run_with_baseline", fake)
    monkeypatch.setattr(train, "print_comparison", lambda doc: None)
    assert cli.main(["train", "--epochs", "1", "--ps", "10.0.0.1:9000", "--keys", str(tmp_path)]) == 0
    assert seen == {"keys": str(tmp_path), "ps": "10.0.0.1:9000"}
    out = capsys.readouterr().out
    assert "2 workers" not in out and "4 workers here, through the PS at 10.0.0.1:9000, codec=thc" in out
    assert "PS +" not in out and "loopback" not in out


def test_train_with_keys_trains_through_its_keyed_ps(tmp_path):
    keys = create_keys(tmp_path / "keys")
    proc = thc("train", "--keys", str(keys), "--workers", "2", "--epochs", "1", "--model", "mlp",
               "--train-limit", "512", "--test-limit", "100", "--no-baseline", "--json", env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["ok"] and len(doc["epochs"]) == 1 and doc["epochs"][0]["steps"] == 4


def test_status_prints_text_without_json_and_job_rounds():
    """Reproduction: `thc status` printed JSON on stdout when the PS did not answer, counted
    slot rounds as "rounds", and named a job by two numbers."""
    port = free_port_pair()
    proc = thc("status", "--ps", f"127.0.0.1:{port}", "--timeout-s", "0.3", env=ENV)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout
    assert f"no status reply from the PS control plane at tcp://127.0.0.1:{port + 1}" in proc.stderr
    job = {"job_number": 3, "job_name": "a", "job_id": 7, "codec": "thc", "num_workers": 3, "live": [0, 1, 2],
           "missing": [], "progress": {"0": 7, "1": 3, "2": 7}, "age_s": 2.0,
           "region": {"base": 0, "data": 512, "norm": 16}, "stats": {"rounds_completed": 9000, "drops": {}}}
    text = format_status("h:1", {"jobs": [job], "queued": [], "slots_free": 1, "slot_space": 529})
    assert "job 3 'a': thc, live 3/3, rounds 3..7, slots 0..527" in text
    assert "id 7" not in text and "9000" not in text
    job["progress"] = {"0": -1, "1": -1, "2": -1}
    assert "live 3/3, not started, slots" in format_status("h:1", {"jobs": [job], "queued": [], "slots_free": 1,
                                                                   "slot_space": 529})


def test_status_of_a_keyed_ps_without_keys_says_so(tmp_path):
    server = _ps(keys=create_keys(tmp_path / "keys"))
    try:
        proc = thc("status", "--ps", _addr(server), env=ENV)
    finally:
        server.stop()
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert "the PS runs with --keys (CURVE) and this client has no keys: pass --keys DIR" in proc.stderr


def test_a_host_that_never_joins_is_named():
    """Reproduction: "no worker started a round for 20 s; rank 0 is at round -1", not which
    ranks the job waits for (the PS's status knows: ranks 2 and 3 never registered)."""
    server = _ps(lease_s=60)
    try:
        proc = thc("launch", "--ps", _addr(server), "--workers", "4", "--local-workers", "2", "--node-rank", "0",
                   "--rounds", "5", "--dim", "2000", "--stall-s", "20", env=ENV)
    finally:
        server.stop()
    assert proc.returncode == 1, proc.stderr
    assert "waits for ranks 2, 3 (2: never registered; 3: never registered)" in proc.stderr, proc.stderr


def test_a_killed_and_restarted_rank_is_named():
    """Reproduction: the survivors said "slot 516 round 7 unanswered…; waiting for the PS"."""
    proc = thc("launch", "--workers", "3", "--rounds", "6", "--dim", "2000", "--kill-rank", "1",
               "--kill-at-round", "2", "--restart-killed", "--lease-s", "1", env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "rank 1 was killed at round 2 (fault injection); started it again: it rejoins the running job" \
        in proc.stderr
    assert "waiting for the PS\n" not in proc.stderr


def test_a_late_result_names_the_ranks_behind():
    status = {"progress": {"0": 7, "1": 3, "2": 7, "3": -1}}
    assert describe_behind(status, 0, 7) == ("ranks 1, 3 (1: step 3; 3: not started; rank 0 is at step 7: "
                                             "restarted or rejoined and catching up, or slow)")
    assert describe_behind(status, 1, 3) == "rank 3 (3: not started; rank 1 is at step 3: restarted or " \
                                            "rejoined and catching up, or slow)"
    assert describe_behind({"progress": {"0": 7, "1": 7}}, 0, 7) == ""
    assert describe_behind(None, 0, 7) == ""


def test_the_loss_table_counts_the_chunks_every_rank_lost(tmp_path):
    """Reproduction: `thc experiment loss`'s table summed rank 0's lost chunks while the
    progress lines summed all ranks'."""
    from thc_ps.deploy import experiments, train
    report = lambda rank, epoch, lost: {"epoch": epoch, "train_loss": 1.0 + rank, "test_accuracy": 0.5,
                                        "mean_round_ms": 2.0, "bytes_up": 1, "bytes_down": 1, "lost_chunks": lost,
                                        "param_digest": 1.0, "loss_curve": []}
    history = {1: {0: report(0, 1, 3), 1: report(1, 1, 5)}, 2: {1: report(1, 2, 7), 0: report(0, 2, 0)}}
    lines = []
    cfg = train.TrainConfig(job=JobConfig(num_workers=2), epochs=2)
    for e in sorted(history):
        train._log_epoch(cfg, history[e], lines.append)
    assert ", lost chunks 8, " in lines[0] and ", lost chunks 7, " in lines[1]
    records = train.epoch_records(history)
    assert [r["lost_chunks"] for r in records] == [8, 7] and [r["train_loss"] for r in records] == [1.0, 1.0]
    row = experiments._summary("thc", {"epochs": records, "seconds": 1.0})
    assert row["lost_chunks"] == 15
    table = experiments._write("loss", "t", "thc experiment loss", "", [row], out=tmp_path).read_text()
    assert "| lost chunks (all ranks) |" in table and "| 2.0 | 15 |" in table


def test_a_handshake_dropped_once_is_not_taken_for_keys_that_do_not_fit():
    """Reproduction (the fault soak, bench/soak.py): a PS killed while a worker's socket was in
    its CURVE handshake made the worker fail with "this client's server.key is not that PS's
    public key" although its keys fit the PS that came back.  A failure that says no cause
    counts only when it repeats (keys that do not fit fail every reconnection); a refusal
    with its cause (an unauthorized key) still fails at once."""
    import zmq

    from thc_ps.proto.keys import AMBIGUOUS_FAILURES, HandshakeWatch
    watch = HandshakeWatch.__new__(HandshakeWatch)
    watch.failed, watch._ambiguous, queued = None, 0, []
    watch._events = lambda: [queued.pop(0)] if queued else []
    dropped = ("the PS ended the CURVE handshake: …", False)
    queued.append(dropped)
    watch.check("tcp://ps:9001")                        # one dropped handshake: a PS restarting
    for _ in range(AMBIGUOUS_FAILURES - 2):
        queued.append(dropped)
        watch.check("tcp://ps:9001")
    queued.append(dropped)
    with pytest.raises(HandshakeFailed, match="the PS ended the CURVE handshake"):
        watch.check("tcp://ps:9001")                    # every reconnection fails: the keys
    watch.failed, watch._ambiguous = None, 0
    queued.append(("the PS refused this client's key", True))
    with pytest.raises(HandshakeFailed, match="refused this client's key"):
        watch.check("tcp://ps:9001")
    assert zmq.EVENT_HANDSHAKE_FAILED_AUTH      # the event a definite refusal arrives as
