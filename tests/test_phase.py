"""The worker's phase loop in C (_batchio.phase_run) against the Python loop, on a scripted PS.

A fake PS thread answers a worker's DATA packets by a fixed script — one chunk in seven only
on its retransmission, a STRAGGLER notice for one in eleven, a reply with another job's
nonce before the real one for one in thirteen, a result for the next phase's round ahead of
time, replies coalesced with UDP GSO — and both phase engines must return the same results
and count the same, with and without UDP offload (THC_UDP_OFFLOAD=0 forces the fallback).
"""
import socket
import threading

import numpy as np
import pytest

from thc_ps.proto import headers as H
from thc_ps.proto import udpio
from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.server import PSServer
from thc_ps.worker.transport import PhaseResults, PSUnavailable, Transport

COUNTERS = ("packets_sent", "bytes_sent", "retransmissions", "timeouts", "lost_chunks",
            "straggler_notices", "stashed_results", "resynced_chunks", "bad_packets")


class ScriptedPS(threading.Thread):
    def __init__(self, nonce: int, gso: bool, silent: bool = False):
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.nonce, self.gso, self.silent = nonce, gso, silent
        self.stop = threading.Event()
        self.seen: set = set()
        self.ahead_sent = False

    def result(self, h, nonce=None, round_=None, k=1):
        payload = bytes((h.offset + i) & 0xFF for i in range(h.count))
        return H.build(H.Header(type=H.RESULT, job_id=h.job_id, num_workers=h.num_workers, elem_bits=8,
                                slot=h.slot, round=h.round if round_ is None else round_, offset=h.offset,
                                count=h.count, bitmap=1, contributors=k, op=h.op,
                                nonce=self.nonce if nonce is None else nonce), payload)

    def answer(self, h) -> list:
        c = h.offset // 16
        first = (h.slot, h.round) not in self.seen
        self.seen.add((h.slot, h.round))
        if c % 7 == 3 and first:
            return []                                   # answered only when resent
        if c % 11 == 5:
            return [H.build(H.Header(type=H.STRAGGLER, job_id=h.job_id, num_workers=h.num_workers,
                                     slot=h.slot, round=h.round + 1, offset=h.offset, op=h.op,
                                     nonce=self.nonce))]
        out = [self.result(h, nonce=self.nonce ^ 1)] if c % 13 == 7 and first else []
        out.append(self.result(h, k=2 if c % 2 else 1))
        if c == 0 and not self.ahead_sent:              # the next phase's chunk 0, early
            self.ahead_sent = True
            out.append(self.result(h, round_=h.round + 10))
        return out

    def run(self):
        while not self.stop.is_set():
            try:
                data, addr = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            if self.silent:
                continue
            replies = self.answer(H.parse(data)[0])
            same = [r for r in replies if len(r) == len(replies[0])] if replies else []
            if self.gso and len(same) > 1 and same == replies:
                self.sock.sendmsg([b"".join(same)], [(udpio.SOL_UDP, udpio.UDP_SEGMENT,
                                                      len(same[0]).to_bytes(2, "little"))], 0, addr)
                continue
            for r in replies:
                self.sock.sendto(r, addr)


def run_script(engine: str, offload: bool, monkeypatch, policy="retransmit"):
    monkeypatch.setenv("THC_UDP_OFFLOAD", "1" if offload else "0")
    # 8-bit lanes: the scripted PS answers each 16-element chunk with 16 bytes
    server = PSServer(JobConfig(num_workers=1, slots=10, lane_bits=8), ("127.0.0.1", 0), control_port=0).start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port,
                  phase_engine=engine, timeout_ms=300, max_timeout_ms=600, policy=policy)
    fake = ScriptedPS(t.sessions[0]["nonce"], gso=offload)
    fake.start()
    t.shard_addrs = [fake.sock.getsockname()]          # results from the fake are this shard's
    try:
        chunks = [(16 * c, 16, bytes(8)) for c in range(30)]
        first = list(t.run_phase(H.DATA, chunks))
        # the next phase's chunk 0 uses the round the PS answered ahead of time (slot 0, phase
        # one's first round + 10): it must come from the stash without being sent
        t.slot_round[0, 0] = first[0][0].round + 9
        second = list(t.run_phase(H.DATA, chunks[:4]))
        return first, second, {k: t.stats.counters[k] for k in COUNTERS}, t.io
    finally:
        fake.stop.set()
        fake.join(2)
        t.close(leave=False)
        server.stop()


def as_plain(results):
    """Results without the nonce (each run registers with a new job of its own)."""
    return [None if r is None else ({k: v for k, v in H.header_dict(r[0]).items() if k != "nonce"},
                                    bytes(r[1])) for r in results]


@pytest.mark.parametrize("offload,spin", [(True, 0), (False, 0), (True, 300)],
                         ids=["gso-gro", "no-offload", "gso-gro-busy-poll"])
def test_c_phase_matches_python_phase(offload, spin, monkeypatch):
    monkeypatch.setattr("thc_ps.worker.phases.SPIN_US", spin)     # THC_BUSY_POLL_US: the same results
    c1, c2, c_counts, c_io = run_script("c", offload, monkeypatch)
    p1, p2, p_counts, _ = run_script("python", offload, monkeypatch)
    assert as_plain(c1) == as_plain(p1) and as_plain(c2) == as_plain(p2)
    assert c_counts == p_counts
    lost = [c for c in range(30) if c % 11 == 5]
    assert [c for c, r in enumerate(c1) if r is None] == lost
    # chunks 3, 10, 17, 24 of phase one and chunk 3 of phase two are answered only when resent
    assert c_counts["retransmissions"] == len([c for c in range(30) if c % 7 == 3 and c not in lost]) + 1
    assert c_counts["straggler_notices"] == len(lost) and c_counts["lost_chunks"] == len(lost)
    assert c_counts["bad_packets"] == len([c for c in range(30) if c % 13 == 7])
    assert c_counts["stashed_results"] == 1 and c_counts["resynced_chunks"] == 1
    assert c2[0] is not None and c2[0][0].round == c1[0][0].round + 10
    if offload:
        assert c_io["gso_messages"] > 0 and c_io["gro_batches"] > 0


def test_c_phase_results_as_one_lanes_vector(monkeypatch):
    monkeypatch.setenv("THC_UDP_OFFLOAD", "1")
    server = PSServer(JobConfig(num_workers=1), ("127.0.0.1", 0), control_port=0).start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port)
    try:
        job = t.job
        rng = np.random.default_rng(2)
        per = job.elems_per_packet
        total = 5 * per + 24
        from thc_ps.worker.transport import PackedChunks
        z = rng.integers(0, 16, total).astype(np.uint8)
        from thc_ps.proto.packing import pack_indices
        chunks = PackedChunks(pack_indices(z, 4), total, 4, per)
        res = t.run_phase(H.DATA, chunks)
        assert isinstance(res, PhaseResults) and res.ok().all()
        assert job.lane_bits == 5 and res.lanes.size == 5 * per * 5 // 8 + 15     # as sent: 5-bit lanes
        assert res.byte_lanes().tolist() == np.asarray(job.table)[z].tolist()     # n = 1: Y = T[Z]
        assert res.contributors.tolist() == [1] * 6 and res.bitmaps.tolist() == [1] * 6
        assert [bytes(r[1]) for r in res] == [res.payload(c).tobytes() for c in range(6)]
    finally:
        t.close()
        server.stop()


@pytest.mark.parametrize("engine", ["c", "python"])
def test_zero_policy_and_give_up_on_a_silent_ps(engine, monkeypatch):
    monkeypatch.setenv("THC_UDP_OFFLOAD", "1")
    server = PSServer(JobConfig(num_workers=1), ("127.0.0.1", 0), control_port=0).start()
    silent = ScriptedPS(0, gso=False, silent=True)
    silent.start()
    try:
        for policy in ("zero", "retransmit"):
            t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port,
                          phase_engine=engine, timeout_ms=20, max_timeout_ms=40, max_retries=3,
                          policy=policy, heartbeat=False)
            t.shard_addrs = [silent.sock.getsockname()]
            chunks = [(16 * c, 16, bytes(8)) for c in range(5)]
            if policy == "zero":
                assert list(t.run_phase(H.DATA, chunks)) == [None] * 5
                assert t.stats.counters["lost_chunks"] == 5 == t.stats.counters["timeouts"]
            else:
                with pytest.raises(PSUnavailable, match="after 3 retransmissions"):
                    t.run_phase(H.DATA, chunks)
                assert t.stats.counters["retransmissions"] >= 3
            t.close(leave=False)
    finally:
        silent.stop.set()
        silent.join(2)
        server.stop()


@pytest.mark.parametrize("offload,engine", [("1", "c"), ("0", "c"), ("0", "python"), ("1", "python")])
def test_rounds_exact_on_every_data_path(offload, engine, monkeypatch):
    """PS + 4 worker processes, every chunk of every round checked against the in-process
    reference, with GRO/GSO on and forced off and with either phase loop."""
    from thc_ps.deploy.launch import run_launch
    monkeypatch.setenv("THC_UDP_OFFLOAD", offload)
    monkeypatch.setenv("THC_PHASE_ENGINE", engine)
    doc = run_launch(workers=4, rounds=10, dim=1 << 16, quorum=0.75)
    assert doc["exact_rounds"] == 10 and doc["mismatched_chunks"] == 0 and doc["ok"], doc["problems"]


@pytest.mark.parametrize("overlap", [False, True], ids=["after-the-phase", "during-the-phase"])
def test_error_feedback_in_its_helper_thread_and_lazy_digests(overlap, monkeypatch):
    """A one-worker job through the C PS: the residual the worker keeps (computed in its
    helper thread beside the lanes decode, or while the DATA phase runs with
    THC_OVERLAP_RESIDUAL) is x − RHT⁻¹(X) of its own indices, recomputed here from the same
    per-round randomness; the digests taken after the round are the payloads' crc32."""
    import zlib

    from thc_ps.compression import thc
    from thc_ps.worker.client import Worker, round_rng
    monkeypatch.setattr("thc_ps.worker.client.OVERLAP_RESIDUAL", overlap)
    job = JobConfig(num_workers=1, rotation="round")   # the residual in the gradient's domain
    server = PSServer(job, ("127.0.0.1", 0), control_port=0, engine="c").start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port)
    try:
        w = Worker(t, seed=3, per_round_rng=True)
        rng = np.random.default_rng(5)
        e = np.zeros(40_000, np.float32)
        for r in range(3):
            g = rng.standard_normal(40_000).astype(np.float32)
            w.allreduce(g, key="g", round_no=r)
            x = g + e
            mine = thc.WorkerRound(w.cfg, x)
            mine.encode(np.asarray(w.last.norms), round_rng(3, 0, r), r, packed=True)
            e = mine.residual()
            np.testing.assert_array_equal(w.errors.errors["g"], e)
            res = w.last.phase
            assert res is not None                           # digests not taken yet
            digests = w.last.chunk_digests()
            assert w.last.phase is None and len(digests) == len(res) > 1
            assert digests == [zlib.crc32(res.payload(c)) for c in range(len(res))]
    finally:
        t.close()
        server.stop()


@pytest.mark.parametrize("engine", ["c", "python"])
def test_window_doubles_when_clean_and_halves_on_timeouts(engine):
    """The chunks in flight start at START_WINDOW, double per window-full of chunks a phase
    carried without congestion (up to `window`), halve after a phase that lost more than an
    eighth of its chunks (down to MIN_WINDOW), and then grow by WINDOW_STEP per clean phase;
    results stay exact."""
    from thc_ps.worker.transport import MIN_WINDOW, START_WINDOW, WINDOW_STEP
    server = PSServer(JobConfig(num_workers=1), ("127.0.0.1", 0), control_port=0).start()
    silent = ScriptedPS(0, gso=False, silent=True)
    silent.start()
    try:
        t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port,
                      phase_engine=engine, window=300, timeout_ms=100, max_timeout_ms=200, max_retries=2,
                      policy="zero", heartbeat=False)
        assert t.cwnd == START_WINDOW
        chunks = [(16 * c, 16, bytes(range(c % 200, c % 200 + 8))) for c in range(400)]
        seen = []
        for n in (START_WINDOW // 2, START_WINDOW + 1, 2 * START_WINDOW + 1, 400, 400):
            res = t.run_phase(H.DATA, chunks[:n])
            assert all(r is not None and r[0].contributors == 1 for r in res)
            seen.append(t.cwnd)
        # not filled: no change; one window-full: ×2; 129 chunks at 128 in flight: one more
        # round trip, ×2; 400 at 256: capped at `window`
        assert seen == [START_WINDOW, 2 * START_WINDOW, 4 * START_WINDOW, 300, 300]
        assert t.stats.counters["timeouts"] == 0
        t.shard_addrs = [silent.sock.getsockname()]      # nothing answers: every phase times out
        seen = []
        for _ in range(6):
            t.run_phase(H.DATA, chunks[:3])
            seen.append(t.cwnd)
        assert seen == [150, 75, 37, 18, MIN_WINDOW, MIN_WINDOW]
        t.shard_addrs = [server.data_addr]          # answered again: past the last halving the
        seen = []                                   # window grows by WINDOW_STEP per phase
        for _ in range(2):
            assert all(r is not None for r in t.run_phase(H.DATA, chunks))
            seen.append(t.cwnd)
        assert seen == [MIN_WINDOW + WINDOW_STEP, MIN_WINDOW + 2 * WINDOW_STEP]
        t.close(leave=False)
    finally:
        silent.stop.set()
        silent.join(2)
        server.stop()


def _placer(shards: int, slots: int = 8):
    """The phase engine's chunk placement alone: no sockets, a session that is only what a
    phase needs of one (thc_ps.worker.phases.PhaseSession)."""
    from types import SimpleNamespace

    from thc_ps.worker.datagrams import TransportStats
    from thc_ps.worker.phases import PhaseEngine
    session = SimpleNamespace(worker_id=0, job=JobConfig(num_workers=2, slots=slots),
                              shard_addrs=[("127.0.0.1", 9000 + 2 * s) for s in range(shards)])
    return PhaseEngine(session, SimpleNamespace(stats=TransportStats()))


def test_random_loss_is_not_congestion():
    """The window halves only for a phase that found more than an eighth of its chunks lost
    (at least two): 1% loss each way finds about 5% of a rank's chunks lost with 4 ranks."""
    from thc_ps.worker.phases import CONGESTED
    t = _placer(1, slots=512)
    t.cwnd = t.ssthresh = 256
    t._adapt_window(733, int(733 * 0.05))               # random loss: the window grows
    assert t.cwnd == 256 + 16
    t._adapt_window(733, int(733 * CONGESTED) + 1)      # a queue's overflow: halved
    assert t.cwnd == t.ssthresh == 136
    t._adapt_window(1, 1)                               # a NORM phase's lone timeout: left alone
    t._adapt_window(3, 2)                               # two of three: halved
    assert t.cwnd == 68


def test_a_run_of_losses_is_congestion_though_few():
    """A queue that overflows drops consecutive chunks: 10 of some 16 found lost halve the
    window though the phase lost under an eighth; the same count spread out does not, and
    independent loss at 9% a chunk (8 ranks at 1% each way) almost never looks clustered."""
    from thc_ps.worker.phases import CLUSTER, CONGESTED, clustered
    least, span = CLUSTER
    run = np.zeros(733, bool)
    run[400:400 + least] = True
    spread = np.zeros(733, bool)
    spread[::733 // least][:least] = True
    assert run.sum() == spread.sum() == least < 733 * CONGESTED
    assert clustered(run) and not clustered(spread)
    gappy = np.zeros(733, bool)
    gappy[400:400 + span:2] = True                  # 8 of 16: every other chunk, too few
    assert not clustered(gappy)
    gappy[401] = gappy[403] = True                  # 10 of 16
    assert clustered(gappy)
    assert not clustered(np.ones(least - 1, bool)) and clustered(np.ones(least, bool))
    rng = np.random.default_rng(7)
    assert sum(clustered(rng.random(733) < 0.09) for _ in range(2000)) <= 2
    t = _placer(1, slots=512)
    t.cwnd = t.ssthresh = 256
    t._adapt_window(733, int(spread.sum()), spread)  # few and spread: the window grows
    assert t.cwnd == 256 + 16
    t._adapt_window(733, int(run.sum()), run)        # few in a run: halved
    assert t.cwnd == t.ssthresh == 136


def test_slow_start_at_most_quadruples_the_window_per_phase():
    t = _placer(1, slots=512)
    t.cwnd, t.ssthresh = 64, 512
    t._adapt_window(733, 0)                          # 11 windows' worth carried: x4, not x8
    assert t.cwnd == 256
    t._adapt_window(733, 0)
    assert t.cwnd == 512
    t.cwnd = 64
    t._adapt_window(100, 0)                          # one round trip carried: doubled
    assert t.cwnd == 128


@pytest.mark.parametrize("shards, nchunks", [(1, 200), (2, 300), (3, 10), (2, 1)])
def test_chunks_go_to_shards_in_runs_and_slot_rounds_advance_per_use(shards, nchunks):
    from thc_ps.worker.transport import SHARD_RUN
    t = _placer(shards)
    uses: dict = {}
    for phase in range(2):
        shard, slot, rounds = t._place(H.DATA, nchunks, phase)
        length = max(1, min(SHARD_RUN, -(-nchunks // shards)))
        assert shard.tolist() == [(c // length) % shards for c in range(nchunks)]
        if shards == 1:                                   # one shard: chunk c in slot c mod slots
            assert slot.tolist() == [c % 8 for c in range(nchunks)]
        for s in range(shards):                           # a shard's chunks take its slots in turn
            mine = np.flatnonzero(shard == s)
            assert slot[mine].tolist() == [k % 8 for k in range(len(mine))]
        for key in zip(shard.tolist(), slot.tolist(), rounds.tolist()):   # each use: the next round
            uses[key[:2]] = uses.get(key[:2], 0) + 1
            assert key[2] == uses[key[:2]], key
    if nchunks >= shards:
        assert set(shard.tolist()) == set(range(shards))  # every shard has work, small phases too
