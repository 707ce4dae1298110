"""The worker's adaptive retransmission timer (worker/rto.py, RetransmitTimer): its
arithmetic, its robustness to answers that waited for a loss recovery, that both phase
engines feed it, and that on a rate-limited path it stops the spurious resends of the
fixed timer."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from deploy import netns
from deploy.procs import stop_gracefully
from proto.job import JobConfig
from ps_server.server import PSServer
from worker.transport import RetransmitTimer, Transport, rto_scale

ROOT = Path(__file__).resolve().parents[1]


def test_the_scale_is_three_lower_quartiles_whatever_the_answers_that_waited():
    assert rto_scale(np.full(10, 2.0)) == pytest.approx(6.0)
    q = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert rto_scale(q) == pytest.approx(3 * 2.0)                            # lower quartile 2
    # 6 of 10 answers waited a whole timeout for another rank's resend: ignored
    assert rto_scale(np.array([1.0] * 4 + [100.0] * 6)) == pytest.approx(3.0)
    # from three quarters on they are the path
    assert rto_scale(np.array([1.0] * 2 + [100.0] * 8)) == pytest.approx(300.0)


def test_first_timeout_follows_the_chunks_in_flight_between_floor_and_cap():
    t = RetransmitTimer(0.05, 1.0, shards=2)
    assert t.first_timeout(0, 100) == 0.05                # not measured: the floor
    sent, k = np.ones(40), np.arange(1, 41, dtype=np.int32)     # one batch: chunk j had j in flight
    t.phase_done(np.zeros(40, np.int64), sent, sent + 4e-3 * k, k)
    assert t.T[3] > 0 and t.T[4] == 0                     # shard 0 measured, shard 1 not
    scale = t.T[3]
    assert t.first_timeout(0, 1) == 0.05
    assert scale == pytest.approx(3 * 4e-3)               # 4 ms per chunk in flight, × 3
    assert t.first_timeout(0, 50) == pytest.approx(scale * 50)
    assert t.first_timeout(0, 10_000) == 1.0
    assert t.first_timeout(1, 100) == 0.05


def test_phases_with_few_answers_and_the_fixed_rule_leave_the_timer_alone():
    t = RetransmitTimer(0.05, 1.0, shards=1)
    sent = np.full(RetransmitTimer.MIN_SAMPLES - 1, 1.0)
    t.phase_done(np.zeros(len(sent), np.int64), sent, sent + 0.5, np.ones(len(sent), np.int32))
    assert t.T[3] == 0
    fixed = RetransmitTimer(0.05, 1.0, shards=1, adaptive=False)
    sent = np.arange(64) * 1e-3 + 1.0
    fixed.phase_done(np.zeros(64, np.int64), sent, sent + 0.5, np.ones(64, np.int32))
    assert fixed.T[3] == 0 and fixed.first_timeout(0, 64) == 0.05
    # unanswered chunks (lost, or settled from the stash) give no sample
    t.phase_done(np.zeros(20, np.int64), np.full(20, 1.0), np.r_[np.full(7, 2.0), np.zeros(13)],
                 np.ones(20, np.int32))
    assert t.T[3] == 0


def _phase(rng, timer, n=256, per_chunk=1e-3, loss=0.05, ranks=4):
    """A simulated phase: n chunks sent in one batch, chunk j answered per_chunk × j later
    (a queue served in order); a chunk any rank lost, or whose answer this rank lost, is
    answered one first timeout later (the resend's)."""
    sent = np.ones(n)
    k = np.arange(1, n + 1, dtype=np.int32)
    hit = rng.random(n) < 1 - (1 - loss) ** (ranks + 1)
    tmo = np.array([timer.first_timeout(0, int(j)) for j in k])
    timer.phase_done(np.zeros(n, np.int64), sent, sent + per_chunk * k + np.where(hit, tmo, 0.0), k)
    return hit.mean()


@pytest.mark.parametrize("loss, ranks", [(0.05, 4), (0.1, 8)])
def test_answers_that_waited_for_loss_recovery_do_not_ratchet_the_timeout_up(loss, ranks):
    rng = np.random.default_rng(0)
    clean, lossy = RetransmitTimer(0.001, 10.0, 1), RetransmitTimer(0.001, 10.0, 1)
    waited = []
    for _ in range(40):
        _phase(rng, clean, loss=0.0)
        waited.append(_phase(rng, lossy, loss=loss, ranks=ranks))
    expected = 1 - (1 - loss) ** (ranks + 1)            # 23% and 61% of the answers waited
    assert abs(np.mean(waited) - expected) < 0.05
    assert clean.T[3] == pytest.approx(3e-3)            # 1 ms per chunk in flight, × 3
    assert lossy.T[3] == pytest.approx(clean.T[3])
    # the estimator before (median + 4 MAD) ratchets where the waits near half the answers
    q = 1e-3 + np.where(rng.random(256) < expected, 10 * clean.T[3], 0.0)
    m = np.median(q)
    if ranks == 8:
        assert m + 4 * np.median(np.abs(q - m)) > 3 * clean.T[3]


@pytest.mark.parametrize("engine", ["c", "python"])
def test_both_phase_engines_measure_the_path(engine):
    from worker.client import Worker
    server = PSServer(JobConfig(num_workers=1), ("127.0.0.1", 0), control_port=0).start()
    try:
        for adaptive in (True, False):
            t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port,
                          phase_engine=engine, adaptive_timeout=adaptive)
            try:
                w = Worker(t, seed=1)
                grad = np.random.default_rng(2).standard_normal(1 << 16).astype(np.float32)
                for _ in range(3):
                    w.allreduce(grad)
                if adaptive:
                    assert t.rtt.T[3] > 0, t.rtt.T
                    assert 0.05 <= t.rtt.first_timeout(0, t.cwnd) <= 1.0
                else:
                    assert t.rtt.T[3] == 0 and t.rtt.first_timeout(0, t.cwnd) == 0.05
            finally:
                t.close()
    finally:
        server.stop()


@pytest.mark.skipif(netns.unavailable(need_tc=True) is not None, reason=netns.unavailable(need_tc=True) or "")
def test_on_a_rate_limited_path_the_adaptive_timer_stops_spurious_resends():
    """4 workers behind a 100 Mbit/s token bucket: the queue makes a round trip longer than
    the 50 ms first timeout.  The fixed timer resends a large share of the packets though
    nothing was lost; the adaptive one resends about what the queue dropped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "THC_UDP_OFFLOAD": "0"}
    py = [sys.executable, "-m", "deploy.cli"]
    runs = {}
    for fixed in (True, False):
        with netns.two_hosts(rate_mbit=100) as net:
            ps = subprocess.Popen(net.prefix(net.ps_ns) + py + ["ps", "--bind", f"{net.ps_ip}:9000", "--workers",
                                                                "4", "--stats-every", "0"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
            try:
                time.sleep(1.5)
                run = subprocess.run(net.prefix(net.worker_ns) + py + [
                    "launch", "--ps", f"{net.ps_ip}:9000", "--workers", "4", "--rounds", "6",
                    "--dim", str(1 << 20), "--json"] + (["--fixed-timeout"] if fixed else []),
                    capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
                drops = netns.qdisc_drops(net.ps_ns) + netns.qdisc_drops(net.worker_ns)
            finally:
                stop_gracefully(ps)
        assert run.returncode == 0, run.stderr[-2000:]
        doc = json.loads(run.stdout.strip().splitlines()[-1])
        assert doc["exact_rounds"] == 6 and doc["lost_chunks"] == 0
        runs[fixed] = (doc["timeouts"] - drops, doc["packets_sent"], doc["rto_ms"])
    (fixed_spurious, fixed_sent, _), (spurious, sent, rto_ms) = runs[True], runs[False]
    assert fixed_spurious > 0.05 * fixed_sent, runs        # the path is slow enough to matter
    assert spurious < 0.01 * sent, runs
    assert rto_ms > 50, runs
