"""The worker's loss recovery (worker/rto.py): the adaptive timer's arithmetic (queueing
scale, the floor from the ranks' meeting, the 1 ms minimum, the reorder windows), its
robustness to answers that waited for a loss recovery, the probe, order and notice rules of
RetransmitPolicy, that both phase engines feed the timer, and that on a rate-limited path it
stops the spurious resends of the fixed timer."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from thc_ps.deploy import netns
from thc_ps.deploy.procs import stop_gracefully
from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.server import PSServer
from thc_ps.worker.rto import FLOOR_RTTS, HELD, MIN_TIMEOUT_S, ORDER_REORDERS, REORDER_MIN_S, T_SCALES, RetransmitPolicy
from thc_ps.worker.transport import RetransmitTimer, Transport, TransportStats, rto_scale

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
    assert t.first_timeout(0, 100) == 0.05                # not measured: the first timeout
    sent, k = np.ones(40), np.arange(1, 41, dtype=np.int32)     # one batch: chunk j had j in flight
    t.phase_done(np.zeros(40, np.int64), sent, sent + 4e-3 * k, k)
    assert t.T[T_SCALES] > 0 and t.T[T_SCALES + 1] == 0   # shard 0 measured, shard 1 not
    scale = t.T[T_SCALES]
    assert scale == pytest.approx(3 * 4e-3)               # 4 ms per chunk in flight, × 3
    # the floor: 3 × the phase's meeting round trip (its first chunk's, 4 ms)
    assert t.floor == pytest.approx(FLOOR_RTTS * 4e-3)
    assert t.first_timeout(0, 1) == pytest.approx(t.floor)
    assert t.first_timeout(0, 50) == pytest.approx(scale * 50)
    assert t.first_timeout(0, 10_000) == 1.0
    # shard 1 not measured: a chunk alone in flight waits the floor (its round trip is the
    # meeting), one behind others at least the first timeout (the queue is not measured)
    assert t.first_timeout(1, 1) == pytest.approx(t.floor) and t.first_timeout(1, 100) == 0.05
    # the reorder windows: the least round trip (4 ms) / 4, at least REORDER_MIN_S
    assert t.reorder == pytest.approx(max(REORDER_MIN_S, 1e-3)) and t.order_wait == ORDER_REORDERS * t.reorder


def test_the_floor_is_the_median_meeting_and_at_least_a_millisecond():
    t = RetransmitTimer(0.05, 1.0, shards=1)
    one = np.zeros(1, np.int64)
    for wait in [2e-3] * 9 + [0.4] * 7:                  # 7 of 16 phases met late: no effect
        t.phase_done(one, np.ones(1), np.ones(1) + wait, np.ones(1, np.int32))
    assert t.floor == pytest.approx(FLOOR_RTTS * 2e-3)
    for _ in range(16):                                  # a path faster than the minimum
        t.phase_done(one, np.ones(1), np.ones(1) + 1e-5, np.ones(1, np.int32))
    assert t.floor == MIN_TIMEOUT_S == 1e-3
    assert t.first_timeout(0, 1) == MIN_TIMEOUT_S and t.reorder == REORDER_MIN_S
    # the meeting is the first-sent chunk's round trip, not the phase's fastest
    t.phase_done(np.zeros(3, np.int64), np.array([1.0, 1.0, 1.2]), np.array([1.03, 1.03, 1.2001]),
                 np.ones(3, np.int32))
    assert t._meets[-1] == pytest.approx(0.03) and t._least[-1] == pytest.approx(1e-4)


def test_the_norm_floor_is_the_wait_of_a_rank_that_comes_first():
    """NORM phases: a rank that comes last is answered at once, one that comes first waits for
    the slowest; with 4 ranks each about a quarter of the phases.  The floor is from the
    upper quartile of the NORM round trips, where the median would fire on the first-comer."""
    from thc_ps.proto.job import JobConfig as J
    from thc_ps.worker.phases import PhaseEngine
    waits = [1e-4, 5e-3, 20e-3, 45e-3] * 4               # last, third, second, first
    norm = RetransmitTimer(0.05, 1.0, shards=1, meeting_q=0.75)
    one = np.zeros(1, np.int64)
    for w in waits:
        norm.phase_done(one, np.ones(1), np.ones(1) + w, np.ones(1, np.int32))
    assert norm.floor == pytest.approx(FLOOR_RTTS * np.quantile(waits, 0.75)) and norm.floor > max(waits)
    assert FLOOR_RTTS * np.median(waits) < max(waits)

    class Session:
        shard_addrs, worker_id = [("127.0.0.1", 9)], 0

    class Net:
        stats = TransportStats()

    for n, q in ((1, 0.5), (2, 0.5), (4, 0.75), (8, 0.875)):
        Session.job = J(num_workers=n)
        eng = PhaseEngine(Session(), Net())
        assert eng.norm_rtt.meeting_q == q and eng.rtt.meeting_q == 0.5


def test_each_shard_with_enough_answers_gets_its_own_scale_and_no_other():
    """Chunks of one phase spread over shards in runs: a shard answered MIN_SAMPLES times or
    more is measured on its own answers, one answered fewer times and one not sent to keep
    their scales, and a phase whose answers came from one shard only moves that one."""
    t = RetransmitTimer(0.05, 1.0, shards=4)
    m = RetransmitTimer.MIN_SAMPLES
    shard = np.r_[np.zeros(m, np.int32), np.full(m - 1, 1, np.int32), np.full(m + 4, 3, np.int32)]
    per = np.r_[np.full(m, 2e-3), np.full(m - 1, 5e-3), np.full(m + 4, 7e-3)]   # round trip per chunk in flight
    sent, k = np.ones(shard.size), np.ones(shard.size, np.int32)
    t.phase_done(shard, sent, sent + per * k, k)
    assert t.T[T_SCALES:T_SCALES + 4].tolist() == pytest.approx([3 * 2e-3, 0, 0, 3 * 7e-3])
    t.phase_done(np.full(m, 1, np.int32), np.ones(m), np.ones(m) + 4e-3, np.ones(m, np.int32))
    assert t.T[T_SCALES:T_SCALES + 4].tolist() == pytest.approx([3 * 2e-3, 3 * 4e-3, 0, 3 * 7e-3])


def test_a_job_s_first_phase_imports_nothing():
    """The timer's end of a phase is numpy arithmetic only: a first call of np.unique imports
    numpy.ma (6-16 ms), which landed inside every rank's first phase of a job."""
    code = ("import sys, numpy as np\n"
            "from thc_ps.worker.rto import RetransmitTimer\n"
            "t = RetransmitTimer(0.05, 1.0, shards=2)\n"
            "before = set(sys.modules)\n"
            "n = 40\n"
            "t.phase_done(np.arange(n, dtype=np.int32) % 2, np.ones(n), np.ones(n) + 1e-3, np.ones(n, np.int32))\n"
            "print(sorted(set(sys.modules) - before))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_phases_with_few_answers_and_the_fixed_rule_leave_the_timer_alone():
    t = RetransmitTimer(0.05, 1.0, shards=1)
    sent = np.full(RetransmitTimer.MIN_SAMPLES - 1, 1.0)
    t.phase_done(np.zeros(len(sent), np.int64), sent, sent + 0.5, np.ones(len(sent), np.int32))
    assert t.T[T_SCALES] == 0 and t.floor == pytest.approx(1.5)     # no scale, but a meeting
    fixed = RetransmitTimer(0.05, 1.0, shards=1, adaptive=False)
    sent = np.arange(64) * 1e-3 + 1.0
    fixed.phase_done(np.zeros(64, np.int64), sent, sent + 0.5, np.ones(64, np.int32))
    assert fixed.T[T_SCALES] == 0 and fixed.first_timeout(0, 64) == 0.05 and fixed.floor == 0.05
    # unanswered chunks (lost, or settled from the stash) give no sample
    u = RetransmitTimer(0.05, 1.0, shards=1)
    u.phase_done(np.zeros(20, np.int64), np.full(20, 1.0), np.r_[np.full(7, 2.0), np.zeros(13)],
                 np.ones(20, np.int32))
    assert u.T[T_SCALES] == 0
    u.phase_done(np.zeros(3, np.int64), np.ones(3), np.zeros(3), np.ones(3, np.int32))
    assert u.floor == pytest.approx(3.0) and len(u._meets) == 1


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
    assert clean.T[T_SCALES] == pytest.approx(3e-3)     # 1 ms per chunk in flight, × 3
    assert lossy.T[T_SCALES] == pytest.approx(clean.T[T_SCALES])
    # the estimator before (median + 4 MAD) ratchets where the waits near half the answers
    q = 1e-3 + np.where(rng.random(256) < expected, 10 * clean.T[T_SCALES], 0.0)
    m = np.median(q)
    if ranks == 8:
        assert m + 4 * np.median(np.abs(q - m)) > 3 * clean.T[T_SCALES]


@pytest.mark.parametrize("engine", ["c", "python"])
def test_both_phase_engines_measure_the_path(engine):
    from thc_ps.worker.client import Worker
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
                    assert t.rtt.T[T_SCALES] > 0, t.rtt.T
                    assert MIN_TIMEOUT_S <= t.rtt.floor <= t.rtt.first_timeout(0, t.cwnd) <= 1.0
                    # 3 DATA phases on the DATA timer, 3 NORM phases on the NORM phases' own
                    assert len(t.rtt._meets) == 3 and len(t.norm_rtt._meets) == 3 and t.rtt.floor != 0.05
                else:
                    assert t.rtt.T[T_SCALES] == 0 and t.rtt.first_timeout(0, t.cwnd) == 0.05
            finally:
                t.close()
    finally:
        server.stop()


@pytest.mark.skipif(netns.unavailable(need_tc=True) is not None, reason=netns.unavailable(need_tc=True) or "")
def test_on_a_rate_limited_path_the_adaptive_timer_stops_spurious_resends():
    """4 workers behind a 100 Mbit/s token bucket: the queue makes a round trip longer than
    the 50 ms first timeout.  The fixed timer resends a share of the packets though nothing
    was lost (a probe per shard at each expiry since the probe rule: 4% of the packets, 18%
    before; about 1% since the window halves on a run of drops); the adaptive one resends
    about what the queue dropped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "THC_UDP_OFFLOAD": "0"}
    py = [sys.executable, "-m", "thc_ps.deploy.cli"]
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
        runs[fixed] = (doc["retransmissions"] - drops, doc["packets_sent"], doc["rto_ms"])
    (fixed_spurious, fixed_sent, _), (spurious, sent, rto_ms) = runs[True], runs[False]
    # the path is slow enough to matter: its round trip outgrows the fixed 50 ms, which then
    # resends what the PS holds (0.9-1.8% of the packets in three runs since the window follows
    # the queue's drops; 0.02-0.07% for the adaptive timer)
    assert rto_ms > 50 and fixed_spurious > 0.002 * fixed_sent, runs
    assert spurious < 0.01 * sent and spurious < fixed_spurious / 2, runs


class _Engine:
    """What RetransmitPolicy reads of a phase engine (worker/phases.py)."""

    def __init__(self, policy="retransmit"):
        self.policy, self.timeout, self.max_timeout, self.max_retries = policy, 0.05, 1.0, 60
        self.rtt, self.stats = RetransmitTimer(0.05, 1.0, shards=1), TransportStats()

    def give_up(self, what, dest, tries):
        raise AssertionError(f"gave up on {what}")

    def note_stall(self, what, tries, now):
        pass


def test_a_timer_resends_only_the_oldest_chunk_and_the_shard_s_answer_restarts_the_rest():
    eng = _Engine()
    pol = RetransmitPolicy(eng)
    p = [pol.start(c, b"pkt", 0.0, shard=0, in_flight=c + 1) for c in range(4)]    # all due at 0.05
    now = 0.06
    held = [pol.due(x, now) and pol.hold(x, now, oldest=x.chunk == 0) for x in p]
    assert held == [False, True, True, True]
    assert pol.expired(p[0], now, "chunk 0", None) and p[0].tries == 1 and p[0].timeout == 0.1
    assert all(x.fast == HELD and not pol.due(x, 100.0) for x in p[1:])
    assert eng.stats.counters["timeouts"] == 1 and eng.stats.counters["retransmissions"] == 1
    # the shard answers chunk 0: the held chunks are in flight again with fresh timers, a first
    # timeout for their place behind it; expiring, the oldest is the next probe, the rest held
    for x in p[1:]:
        pol.release(x, 0, 0, 1.0)
        assert x.fast == 0 and x.deadline == pytest.approx(1.0 + eng.rtt.first_timeout(0, x.chunk))
    assert [pol.due(x, 2.0) and pol.hold(x, 2.0, oldest=x.chunk == 1) for x in p[1:]] == [False, True, True]
    assert pol.expired(p[1], 2.0, "chunk 1", None) and eng.stats.counters["retransmissions"] == 2
    # under the zero policy every expiry loses its chunk: nothing is held
    z = RetransmitPolicy(_Engine("zero"))
    q = z.start(1, b"pkt", 0.0, shard=0)
    assert not z.hold(q, 1.0, oldest=False) and z.expired(q, 1.0, "q", None) is False


def test_the_order_rule_and_a_notice_resend_once_without_a_timeout():
    eng = _Engine()
    pol = RetransmitPolicy(eng)
    a = pol.start(0, b"pkt", 0.0, shard=0)                   # deadline 0.05
    pol.found_lost(a, 0.010)
    pol.found_lost(a, 0.005)                                 # the first finding stands
    assert not pol.due(a, 0.009) and pol.due(a, 0.010)
    assert pol.expired(a, 0.010, "a", None)
    assert a.timeout == 0.05 and a.deadline == pytest.approx(0.06) and a.fast == -1    # no backoff
    assert eng.stats.counters["fast_losses"] == 1 and eng.stats.counters["timeouts"] == 0
    pol.found_lost(a, 0.02)                                  # found once: the timer goes on
    pol.noticed(a, 0.02, 1e-3)
    assert a.fast == -1 and not pol.due(a, 0.05)
    # a notice: due a reorder window after it arrived, or sooner if found lost so
    b = pol.start(1, b"pkt", 1.0, shard=0)
    pol.noticed(b, 1.01, 1e-3)
    assert b.fast == pytest.approx(1.011) and not pol.due(b, 1.0105)
    c = pol.start(2, b"pkt", 1.0, shard=0)
    pol.found_lost(c, 1.005)
    pol.noticed(c, 1.0049, 1e-3)
    assert c.fast == pytest.approx(1.005)
    # a held chunk noticed is due too; under the zero policy a chunk found lost is lost
    d = pol.start(3, b"pkt", 0.0, shard=0)
    assert pol.hold(d, 0.06, oldest=False)
    pol.noticed(d, 0.07, 1e-3)
    assert not pol.due(d, 0.0705) and pol.due(d, 0.072)
    z = RetransmitPolicy(_Engine("zero"))
    e = z.start(0, b"pkt", 0.0, shard=0)
    z.found_lost(e, 0.001)
    assert z.expired(e, 0.002, "e", None) is False


def test_a_norm_phase_waiting_for_a_late_rank_is_not_timed_out_by_the_data_phases_floor():
    """A NORM phase's one chunk waits for the slowest rank's transform and norms; the DATA
    phase after it starts with the ranks lined up.  Rank 1 comes to each NORM phase 20-60 ms
    late, on a lossless loopback: rank 0's NORM timer follows the NORM phases' waits and
    never fires; one floor from both kinds of phases (three times the median of meetings of
    0.x ms and 20-60 ms: about 30 ms) fired on the 40-60 ms waits."""
    import threading

    from thc_ps.proto import headers as H
    late_ms = [40, 20, 60, 30, 50, 45, 25, 55, 35, 60, 40, 50]
    server = PSServer(JobConfig(num_workers=2), ("127.0.0.1", 0), control_port=0).start()
    ts = [Transport("127.0.0.1", server.data_addr[1], r, control_port=server.control_port, timeout_ms=200)
          for r in range(2)]
    try:
        norm_timeouts = []          # rank 0's, phase by phase (its DATA phases are not the point)

        def rank(r):
            norm = [(0, 1, np.array([7 + r], np.uint32).tobytes())]
            data = [(c * 64, 64, bytes(32)) for c in range(16)]
            for ms in late_ms:
                if r == 1:
                    time.sleep(ms / 1e3)
                before = ts[r].stats.counters["timeouts"]
                ts[r].run_phase(H.NORM, norm)
                if r == 0:
                    norm_timeouts.append(ts[r].stats.counters["timeouts"] - before)
                ts[r].run_phase(H.DATA, data)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads)
        assert norm_timeouts == [0] * len(late_ms), norm_timeouts
        assert ts[0].norm_rtt.floor >= FLOOR_RTTS * 0.02 > ts[0].rtt.floor
    finally:
        for t in ts:
            t.close()
        server.stop()



def test_the_timer_s_quantile_is_numpy_s_bit_for_bit():
    """rto.quantile against np.quantile (linear) on samples of every size the timer sees,
    ties and one sample included, at the quartile, the median and the NORM floor's 1 − 1/n."""
    from thc_ps.worker.rto import quantile
    rng = np.random.default_rng(5)
    qs = [0.0, 0.25, 0.5, 0.75, 1.0] + [1 - 1 / n for n in range(2, 17)]
    for size in list(range(1, 40)) + [255, 1000]:
        for a in (rng.lognormal(-7, 1, size), np.round(rng.random(size) * 4) / 1e3):
            for q in qs:
                assert quantile(a, q) == float(np.quantile(a, q)), (size, q)
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0        # a list (the meetings' deque) as well
    with pytest.raises(ValueError, match="no samples"):
        quantile([], 0.5)
