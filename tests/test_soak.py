"""A long-lived PS under abuse: a control-plane fuzz during a running job, and a soak of 20
consecutive jobs of different shapes and codecs with workers killed and restarted.
Both are bounded (examples, jobs, rounds, and each launch's own timeouts)."""
import threading
import time

import msgpack
import pytest
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thc_ps.deploy.launch import run_launch
from thc_ps.proto import control
from thc_ps.proto.job import JobConfig
from tests.test_service import ask, at, ps, req_socket

_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
                     st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=40))
_values = st.recursive(_scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                       max_leaves=12)
_field_names = st.sampled_from(sorted({f for spec in control.SCHEMA.values() for f in spec} | {"x"}))
# every request type but shutdown and drain, which a loopback peer of a key-less PS may legitimately send
_types = st.sampled_from([t for t in control.REQUEST_TYPES if t not in ("shutdown", "drain")] + ["bogus", ""])
_messages = st.builds(lambda kind, fields: msgpack.packb({"type": kind, **fields}, use_bin_type=True),
                      _types, st.dictionaries(_field_names, _values, max_size=5))
_frames = st.one_of(st.binary(max_size=200), _messages, _values.map(lambda v: msgpack.packb(v, use_bin_type=True)))


def test_control_plane_fuzz_while_a_job_runs():
    server = ps(JobConfig(num_workers=2), lease_s=2.0)
    docs = []
    job = threading.Thread(target=lambda: docs.append(run_launch(workers=2, rounds=300, dim=1 << 13,
                                                                 **at(server))))
    job.start()
    sock = req_socket(server)
    try:
        for _ in range(200):                          # fuzz between the messages of a live job
            if server.job is not None and len(server.job.live()) == 2:
                break
            time.sleep(0.05)
        answered = []

        @settings(max_examples=250, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(_frames, st.booleans())
        def fuzz(frame, split):
            nonlocal sock
            if split and len(frame) > 1:
                sock.send_multipart([frame[:1], frame[1:]])     # extra frames: the last is the body
                reply = control.decode(sock.recv()) if sock.poll(3000) else None
            else:
                reply = ask(sock, frame, 3000)
            assert reply is not None, frame                  # every frame is answered
            assert reply["type"] in ("error", "status", "stats"), (frame, reply)
            answered.append(reply["type"])

        fuzz()
        assert len(answered) >= 250 and "error" in answered
        assert ask(sock, {"type": "stats"})["type"] == "stats"
    finally:
        sock.close(0)
        job.join(300)
        server.stop()
    doc = docs[0]
    assert doc["ok"] and doc["exact_rounds"] == 300 and doc["lost_chunks"] == 0, doc["problems"]
    assert server.stats()["control_errors"] >= 100


@pytest.mark.long
def test_soak_twenty_jobs_with_crashes_on_one_ps():
    """One PS, 20 jobs back to back: shapes and codecs vary, and in about half of them a worker
    is killed mid-job and restarted (it rejoins).  Every job exact under retransmit, nothing
    of one job visible in the next."""
    rng = np.random.default_rng(20261123)
    server = ps(lease_s=0.5)
    served_rounds = 0
    try:
        for j in range(20):
            workers = int(rng.integers(2, 5))
            codec = str(rng.choice(["thc", "thc", "none", "topk", "terngrad"]))
            rounds = int(rng.integers(6, 14))
            dim = int(rng.choice([1000, 4096, 20000]))
            # (the BLOB codecs' check recomputes full rounds, so they run at quorum 1)
            quorum = float(rng.choice([1.0, 0.75])) if workers == 4 and codec in ("thc", "none") else 1.0
            kill = None
            if codec in ("thc", "none") and rng.random() < 0.6:
                kill = (int(rng.integers(0, workers)), int(rng.integers(1, rounds - 1)))
            doc = run_launch(workers=workers, rounds=rounds, dim=dim, codec=codec, quorum=quorum,
                             kill=kill, restart=True, seed=j, **at(server))
            what = f"job {j}: n={workers} {codec} q={quorum} d={dim} kill={kill}"
            assert doc["ok"], (what, doc["problems"])
            assert doc["exact_rounds"] == rounds and doc["mismatched_chunks"] == 0, what
            assert doc["restarted_workers"] == (kill is not None), what
            served_rounds += rounds
        st_ = server.stats()
        assert st_["jobs_started"] == st_["jobs_ended"] == 20 and server.job is None
        assert st_["rejoins"] >= 5 and served_rounds > 150
    finally:
        server.stop()


def test_a_short_soak_with_every_fault(tmp_path):
    """bench/soak.py, short: a real `thc ps` (keys, metrics) and five waves of two jobs, one wave
    per fault — a rank killed and restarted, junk at every port, the PS stopped past its lease,
    keys that do not fit, the PS killed and restarted.  Every job exact or failed with its
    fault's cause; after every wave no job's series is left and the totals moved by what the
    jobs report; descriptors and threads do not grow (docs/reliability.md has the 500-job run)."""
    from bench.soak import run
    faults = ("rank", "flood", "stall", "badkey", "ps_kill")
    summary = run(jobs=10, seed=5, lease_s=3.0, out=tmp_path, min_wave=2, max_wave=2, warm=1, faults=faults,
                  log=lambda line: None)
    assert summary["ok"], summary["problems"]
    assert summary["jobs"] == 10 and summary["unexpected"] == 0 and set(summary["faults"]) == set(faults)
    assert summary["faults"]["badkey"] == {"jobs": 1, "exact": 0, "failed_as_expected": 1, "failed_at_a_limit": 0,
                                           "unexpected": 0}
    for fault in ("rank", "flood", "stall"):        # exact, or (an overloaded host) a documented limit, named
        f = summary["faults"][fault]
        assert f["exact"] + f["failed_at_a_limit"] == f["jobs"] and f["exact"] >= 1, summary["faults"]
    assert summary["ps_incarnations"] == 2 and summary["junk_datagrams"] > 0 and summary["stopped_s"] == 5.0
