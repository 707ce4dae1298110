"""Running the PS as a service (issue 53): Prometheus metrics at /metrics and /healthz, the drain
(`thc status --drain`, SIGUSR1), the refusals of a bad --metrics, and the systemd unit."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from thc_ps.deploy.launch import run_launch
from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.metrics import MetricsServer
from thc_ps.ps_server.server import PSServer
from bench.soak import healthz
from tests.test_cli_errors import ROOT
from tests.test_ps_faults import status
from tests.test_service import _free_port
from thc_ps.worker.client import Worker
from thc_ps.worker.transport import Draining, Transport


def scrape(addr) -> dict:
    """{(metric sample name, frozenset of labels): value} of one /metrics scrape."""
    with urllib.request.urlopen(f"http://{addr[0]}:{addr[1]}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def job_value(samples: dict, name: str, job: str, **labels) -> float:
    return samples[(name, frozenset({"shard": "0", "job_name": job, **labels}.items()))]


def ps_value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset({"shard": "0", **labels}.items()))]


def test_metrics_of_two_jobs_equal_their_reports_and_go_when_they_end():
    """/metrics during two jobs at once (thc n=2 and none n=3): each job's counters are what its
    workers did — slot rounds = the chunks of its phases, packets in = what its ranks sent —
    and what the PS's status listing says of it; after the jobs end their series are gone
    and the totals hold both.  Malformed HTTP requests in between stop nothing."""
    server = PSServer(None, ("127.0.0.1", 0), control_port=0).start()
    metrics = MetricsServer([server], "127.0.0.1", 0).start()
    jobs = {"m-thc": (JobConfig(num_workers=2, codec="thc"), 65_536, 6),
            "m-none": (JobConfig(num_workers=3, codec="none"), 20_000, 4)}
    ts = {name: [Transport("127.0.0.1", server.data_addr[1], r, control_port=server.control_port,
                           job_name=name, propose=job) for r in range(job.num_workers)]
          for name, (job, _, _) in jobs.items()}
    chunks = dict.fromkeys(jobs, 0)
    try:
        assert healthz(metrics.address) == (200, "ok")

        def run(name, rank):
            _, dim, rounds = jobs[name]
            w = Worker(ts[name][rank])
            for r in range(rounds):
                w.allreduce(np.random.default_rng([r, rank]).standard_normal(dim).astype(np.float32))
                if rank == 0:   # one round's slot rounds: its NORM chunk (thc) and DATA chunks
                    chunks[name] += w.last.chunks + (w.job.codec == "thc")

        threads = [threading.Thread(target=run, args=(n, r)) for n in ts for r in range(len(ts[n]))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        # garbage on the metrics port: a request line that is no HTTP, a header far too long
        for junk in (b"\x16\x03\x01 not http\r\n\r\n", b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n"):
            with socket.create_connection(metrics.address, timeout=5) as c:
                c.sendall(junk)
                c.recv(1024)
        samples = scrape(metrics.address)
        listing = {j["job_name"]: j["stats"] for j in server.status()["jobs"]}
        for name in jobs:
            sent = sum(t.stats.counters["packets_sent"] for t in ts[name])
            assert job_value(samples, "thc_job_rounds_completed_total", name) == chunks[name] \
                == listing[name]["rounds_completed"], name
            assert job_value(samples, "thc_job_packets_in_total", name) == sent == listing[name]["packets_in"], name
            assert job_value(samples, "thc_job_live_ranks", name) == jobs[name][0].num_workers
            assert job_value(samples, "thc_job_registrations_total", name) == jobs[name][0].num_workers
            assert job_value(samples, "thc_job_drops_total", name, reason="malformed") == 0
        assert ps_value(samples, "thc_ps_jobs_running") == 2
        assert ps_value(samples, "thc_ps_rounds_completed_total") == sum(chunks.values())
    finally:
        for group in ts.values():
            for t in group:
                t.close()
    try:
        for _ in range(50):
            if not server.jobs:
                break
            time.sleep(0.1)
        after = scrape(metrics.address)
        assert not [k for k in after if k[0].startswith("thc_job_")], "a job's series outlived it"
        assert ps_value(after, "thc_ps_jobs_ended_total") == 2 and ps_value(after, "thc_ps_jobs_running") == 0
        assert ps_value(after, "thc_ps_rounds_completed_total") == sum(chunks.values())
        assert ps_value(after, "thc_ps_io_rx_datagrams_total") >= ps_value(after, "thc_ps_packets_in_total") > 0
        assert server.serving() and healthz(metrics.address) == (200, "ok")
    finally:
        metrics.stop()
        server.stop()
    assert healthz_gone(metrics.address)


def healthz_gone(addr) -> bool:
    try:
        healthz(addr)
    except (urllib.error.URLError, ConnectionError):
        return True
    return False


def thc_ps(port: int, log: Path, *extra) -> subprocess.Popen:
    """`thc ps` on `port` (output to `log`) once its control plane answers."""
    proc = subprocess.Popen([sys.executable, "-m", "thc_ps.deploy.cli", "ps", "--bind", f"127.0.0.1:{port}",
                             "--stats-every", "0", *extra], cwd=ROOT, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not status(port):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    return proc


@pytest.mark.parametrize("how", ["thc status --drain", "SIGUSR1"])
def test_a_drain_lets_the_running_job_finish_tells_the_queued_one_and_exits_0(how, tmp_path):
    """One job runs, a second waits in the queue (the slot space holds one); the PS is told to
    drain: the queued job's workers exit naming the drain, the running job finishes exact,
    `thc status` and /healthz say draining meanwhile, and the PS exits 0."""
    port, mport = _free_port(), _free_port()
    proc = thc_ps(port, tmp_path / "ps.log", "--slot-space", "540", "--metrics", f"127.0.0.1:{mport}")
    docs, errors = {}, {}

    def launch(name, **kw):
        try:
            docs[name] = run_launch(ps=f"127.0.0.1:{port}", job_name=name, workers=2, dim=4096, **kw)
        except Exception as exc:            # the queued one fails: checked below
            errors[name] = exc

    a = threading.Thread(target=launch, args=("drain-a",), kwargs={"rounds": 200, "straggler_delay_ms": 20})
    b = threading.Thread(target=launch, args=("drain-b",), kwargs={"rounds": 5})
    try:
        a.start()
        deadline = time.monotonic() + 120
        while not any(j["job_name"] == "drain-a" for j in status(port).get("jobs", [])):
            assert time.monotonic() < deadline and a.is_alive()
            time.sleep(0.1)
        b.start()
        while not any(q["job_name"] == "drain-b" for q in status(port).get("queued", [])):
            assert time.monotonic() < deadline and b.is_alive()
            time.sleep(0.1)
        if how == "SIGUSR1":
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.5)
            shown = subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", "status", "--ps", f"127.0.0.1:{port}"],
                                   cwd=ROOT, capture_output=True, text=True, timeout=60)
        else:
            shown = subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", "status", "--ps", f"127.0.0.1:{port}",
                                    "--drain"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "DRAINING: it admits no new job" in shown.stdout and "drain-a" in shown.stdout, shown.stdout
        assert healthz(("127.0.0.1", mport)) == (200, "draining")
        assert status(port)["draining"] is True
        b.join(60)
        assert not b.is_alive() and "drain-b" not in docs
        assert "Draining: PS refused register: this PS is draining" in str(errors["drain-b"]), errors
        assert "job 'drain-b' cannot start (it was queued)" in str(errors["drain-b"])
        # a new job is told the same at once
        with pytest.raises(Draining, match="this PS is draining"):
            Transport("127.0.0.1", port, 0, job_name="late", propose=JobConfig(num_workers=1))
        a.join(180)
        doc = docs["drain-a"]
        assert doc["ok"] and doc["exact_rounds"] == 200 and doc["lost_chunks"] == 0, doc["problems"]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    out = (tmp_path / "ps.log").read_text()
    assert "draining (" in out and "drained: every job has ended; the PS stops" in out, out[-3000:]


def test_sigterm_during_a_drain_stops_at_once(tmp_path):
    """A drain waits for the running jobs; a SIGTERM meanwhile stops the PS at once, as it does
    without a drain (final counters, status 0)."""
    port = _free_port()
    proc = thc_ps(port, tmp_path / "ps.log")
    t = Transport("127.0.0.1", port, 0, propose=JobConfig(num_workers=2), ps_wait_s=5)   # rank 1 never comes
    try:
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
        assert proc.poll() is None and status(port)["draining"] is True     # job 1 keeps it up
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0 and time.monotonic() - started < 5
    finally:
        t.close(leave=False)
        if proc.poll() is None:
            proc.kill()
    assert "final stats shard 0" in (tmp_path / "ps.log").read_text()


def test_a_drain_request_needs_a_local_peer_without_keys():
    """Without keys (no CURVE), `drain` is accepted from this host only, as `shutdown` is."""
    from thc_ps.proto import control
    server = PSServer(None, ("127.0.0.1", 0), control_port=0).start()
    try:
        with pytest.raises(control.ControlError, match="drain is accepted only from this host"):
            server._handle_ps("drain", {"type": "drain"}, "10.1.2.3")
        assert not server.draining
        assert server._handle_ps("drain", {"type": "drain"}, "127.0.0.1") == {"type": "ok"}
        assert server.draining and server.wait(5)      # nothing ran: it stops at once
    finally:
        server.stop()


@pytest.mark.parametrize("value,message", [
    ("127.0.0.1", "is not HOST:PORT"),
    ("127.0.0.1:http", "is not a number"),
    ("nohost.invalid:9100", "cannot serve metrics there"),
    ("in-use", "cannot serve metrics there: Address already in use"),
])
def test_a_bad_metrics_address_is_refused_at_start(value, message):
    port = _free_port()
    holder = None
    if value == "in-use":
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        value = f"127.0.0.1:{holder.getsockname()[1]}"
    try:
        proc = subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", "ps", "--bind", f"127.0.0.1:{port}",
                               "--metrics", value], cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        if holder is not None:
            holder.close()
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert message in last and "Traceback" not in proc.stderr, proc.stderr
    assert "PS shard 0" not in proc.stdout          # refused before the PS bound anything


UNIT = ROOT / "deploy" / "systemd" / "thc-ps.service"


def test_the_systemd_unit_parses():
    """`systemd-analyze verify` accepts the unit (its ExecStart pointed at this checkout's `thc`,
    since verify checks that the program exists)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (no systemd here): the unit file is not verified")
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/thc ps " in text and "--metrics" in text and "--keys" in text
    thc = Path(sys.executable).with_name("thc")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"thc-unit-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    unit = tmp / "thc-ps.service"
    unit.write_text(text.replace("/usr/local/bin/thc", str(thc)))
    try:
        proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
        complaints = [line for line in (proc.stdout + proc.stderr).splitlines() if "thc-ps.service" in line]
        assert proc.returncode == 0 and not complaints, proc.stdout + proc.stderr
        # a broken copy is refused: the check can fail
        unit.write_text(text.replace("[Service]", "[Servicee]"))
        bad = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 or "thc-ps.service" in bad.stdout + bad.stderr
    finally:
        shutil.rmtree(tmp)


def test_a_drain_with_keys_needs_keys_that_fit(tmp_path):
    """`thc status --drain` is a control request like any other: with a PS run with --keys, keys
    that do not fit are refused at the handshake (exit 2, naming it) and the PS goes on; the
    PS's own client keys drain it."""
    from thc_ps.proto.keys import create_keys
    keys, other = create_keys(tmp_path / "keys"), create_keys(tmp_path / "other")
    server = PSServer(None, ("127.0.0.1", 0), control_port=0, keys=keys).start()
    drain = lambda d: subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", "status", "--ps",
                                      f"127.0.0.1:{server.data_addr[1]}", "--control-port", str(server.control_port),
                                      "--keys", str(d), "--drain"], cwd=ROOT, capture_output=True, text=True,
                                     timeout=60)
    try:
        refused = drain(other)
        assert refused.returncode == 2 and "refused the connection" in refused.stderr, refused.stderr
        assert not server.draining and server.serving()
        done = drain(keys)
        assert done.returncode == 0, done.stderr
        assert server.draining and server.wait(10)       # no job ran: it stopped at once
    finally:
        server.stop()
