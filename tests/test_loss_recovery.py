"""Loss recovery without a timer (docs/design.md, "Loss recovery"): one packet lost where the
test says (fault injection by sequence), a RESULT lost toward one worker, reordering without
loss, and the PS's NOTICE authenticated like every packet.  The workers' first timeout is
set to seconds, so a recovery that waited for a timer shows as a timeout (and a slow phase)."""
import socket
import threading
import time

import numpy as np
import pytest

from thc_ps.proto import headers as H
from thc_ps.proto.job import JobConfig
from thc_ps.proto.packing import pack_indices, unpack_lanes
from thc_ps.ps_server.reference import ReferencePS
from thc_ps.ps_server.server import PSServer
from thc_ps.worker.transport import Faults, Transport

N, CHUNKS, SLOW_MS = 4, 48, 5000.0
LOST = 20                                   # the chunk whose packet is lost (slot 20, round 1)


def chunks_of(rank: int, job: JobConfig) -> tuple:
    """A DATA phase of CHUNKS chunks of indices, and their table values (to check sums)."""
    rng = np.random.default_rng(100 + rank)
    per = 64
    z = rng.integers(0, 16, CHUNKS * per).astype(np.uint8)
    chunks = [(c * per, per, pack_indices(z[c * per:(c + 1) * per], 4).tobytes()) for c in range(CHUNKS)]
    return chunks, np.asarray(job.table)[z]


def run_job(server: PSServer, faults: dict, order_wait: float | None = None, policy: str = "retransmit"):
    """N ranks each run one DATA phase (rank r with faults[r]); their results, counters, and
    the phase's seconds.  `order_wait`: the order rule's wait, for every rank."""
    ts = [Transport("127.0.0.1", server.data_addr[1], r, control_port=server.control_port, timeout_ms=SLOW_MS,
                    max_timeout_ms=2 * SLOW_MS, faults=faults.get(r), policy=policy) for r in range(N)]
    out: dict = {}
    try:
        if order_wait is not None:
            for t in ts:
                t.rtt.T[4] = order_wait

        def rank(r):
            ts[r].barrier("start")
            t0 = time.monotonic()
            res = ts[r].run_phase(H.DATA, chunks_of(r, ts[r].job)[0])
            out[r] = (res, time.monotonic() - t0)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(N)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert len(out) == N, "a rank did not finish its phase"
        counters = [dict(t.stats.counters) for t in ts]
        want = sum(chunks_of(r, ts[0].job)[1] for r in range(N))
        # the PS's counters once it has taken every datagram sent (a resend may still be on its
        # way when its rank has its result), and before the ranks leave and the job ends
        sent = sum(c["packets_sent"] - c["injected_drops_out"] for c in counters)
        deadline = time.monotonic() + 5
        while (ps := server.engine.stats())["packets_in"] < sent and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        for t in ts:
            t.close()
    return out, counters, want, ps


def exact(out, want) -> bool:
    """Every rank's every chunk is the sum of the N ranks' table values."""
    for res, _ in out.values():
        got = np.concatenate([unpack_lanes(bytes(p), h.elem_bits, h.count) for h, p in res])
        if not np.array_equal(got, want):
            return False
    return True


def test_a_data_packet_lost_once_costs_its_rank_one_resend_on_the_ps_s_notice():
    """Rank 2's packet for chunk LOST is dropped once: the PS tells rank 2 when its next packet
    arrives, rank 2 resends it at once, and nobody waits for a timer (5 s here): with the
    order rule's wait at 0.5 s no other rank resends."""
    server = PSServer(JobConfig(num_workers=N), ("127.0.0.1", 0), control_port=0).start()
    try:
        out, ctr, want, ps = run_job(server, {2: Faults(drop_out_once=((H.DATA, LOST, 1),))}, order_wait=0.5)
    finally:
        server.stop()
    assert exact(out, want)
    assert ctr[2]["injected_drops_out"] == 1 and ctr[2]["notices"] == 1 and ctr[2]["retransmissions"] == 1
    assert [c["retransmissions"] for i, c in enumerate(ctr) if i != 2] == [0, 0, 0]
    assert sum(c["timeouts"] for c in ctr) == 0
    assert ps["notices"] == 1 and ps["drops"]["duplicate"] == 0
    assert max(s for _, s in out.values()) < 0.5 * SLOW_MS / 1e3           # no timer waited out


def test_without_notices_the_order_of_results_finds_the_loss_at_every_rank():
    """The same loss through a PS that sends no notices (a switch's rules): the ranks find
    chunk LOST lost when the next chunks' results come first and each resends it once unless
    its result came meanwhile (the design's number for a switch: up to n resends, all but one
    dropped by the aggregator as duplicates or answered from its kept result); no timer."""
    class Quiet(ReferencePS):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw, notices=False)

    import thc_ps.ps_server.server as S
    orig, S.ReferencePS = S.ReferencePS, Quiet
    try:
        server = PSServer(JobConfig(num_workers=N), ("127.0.0.1", 0), control_port=0, engine="python").start()
        try:
            out, ctr, want, ps = run_job(server, {2: Faults(drop_out_once=((H.DATA, LOST, 1),))})
        finally:
            server.stop()
    finally:
        S.ReferencePS = orig
    assert exact(out, want)
    resent = [c["retransmissions"] for c in ctr]
    assert resent[2] == 1 and max(resent) == 1 and resent == [c["fast_losses"] for c in ctr]
    assert sum(c["timeouts"] for c in ctr) == 0 and ps["notices"] == 0
    assert ps["drops"]["duplicate"] + ps["results_resent"] == sum(resent) - 1
    assert max(s for _, s in out.values()) < 0.5 * SLOW_MS / 1e3


def test_a_result_lost_toward_one_worker_is_asked_for_by_it_alone():
    """Rank 1 does not get chunk LOST's result: it alone resends (found by the order of the
    results that follow), and the PS answers from its kept result."""
    server = PSServer(JobConfig(num_workers=N), ("127.0.0.1", 0), control_port=0).start()
    try:
        out, ctr, want, ps = run_job(server, {1: Faults(drop_in_once=((H.RESULT, LOST, 1),))})
    finally:
        server.stop()
    assert exact(out, want)
    assert ctr[1]["injected_drops_in"] == 1 and ctr[1]["fast_losses"] == 1 and ctr[1]["retransmissions"] == 1
    assert [c["retransmissions"] for i, c in enumerate(ctr) if i != 1] == [0, 0, 0]
    assert sum(c["timeouts"] for c in ctr) == 0
    assert ps["results_resent"] == 1 and ps["drops"]["duplicate"] == 0 and ps["notices"] == 0


def test_under_the_zero_policy_a_lost_packet_is_a_lost_chunk_for_every_rank_at_once():
    server = PSServer(JobConfig(num_workers=N), ("127.0.0.1", 0), control_port=0).start()
    try:
        out, ctr, _, ps = run_job(server, {2: Faults(drop_out_once=((H.DATA, LOST, 1),))}, policy="zero")
    finally:
        server.stop()
    assert all([c for c, r in enumerate(res) if r is None] == [LOST] for res, _ in out.values())
    assert [c["lost_chunks"] for c in ctr] == [1] * N and sum(c["timeouts"] for c in ctr) == 0
    assert sum(c["retransmissions"] for c in ctr) == 0
    assert max(s for _, s in out.values()) < 0.5 * SLOW_MS / 1e3


def test_reordering_without_loss_resends_nothing():
    """Every rank's transport holds back one datagram in five to the end of its batch: the PS
    sees a rank's later packet first and sends it a notice, and results come out of order;
    the reorder windows (a notice waits one after the chunk's send, the order rule four after
    the result that came first) let the late packets and results arrive: no resend."""
    server = PSServer(JobConfig(num_workers=N), ("127.0.0.1", 0), control_port=0).start()
    try:
        out, ctr, want, ps = run_job(server, {r: Faults(reorder=0.2, seed=r) for r in range(N)})
    finally:
        server.stop()
    assert exact(out, want)
    assert sum(c["injected_reorders"] for c in ctr) > 20 and ps["notices"] > 0     # reordering was seen
    assert sum(c["retransmissions"] for c in ctr) == 0 and sum(c["timeouts"] for c in ctr) == 0


# ---------------------------------------------------------------- the notice is authenticated
class NoticingPS(threading.Thread):
    """A PS for one rank that answers every chunk of a phase of 10, holding back chunk 4
    until it is resent, and sends NOTICEs: three that must be ignored (another job's nonce,
    from another address, for a round not pending), the real one for chunk 4, and a forged one
    (right nonce and address) for chunk 7, which it holds."""

    def __init__(self, nonce: int):
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.other.bind(("127.0.0.1", 0))
        self.nonce, self.stop, self.seen = nonce, threading.Event(), {}

    def result(self, h):
        payload = bytes((h.offset + i) & 0xFF for i in range(h.count))
        return H.build(H.Header(type=H.RESULT, job_id=h.job_id, num_workers=h.num_workers, elem_bits=8, slot=h.slot,
                                round=h.round, offset=h.offset, count=h.count, bitmap=1, contributors=1, op=h.op,
                                nonce=self.nonce), payload)

    def notice(self, h, slot, round_=1, nonce=None):
        return H.build(H.Header(type=H.NOTICE, job_id=h.job_id, worker_id=0, num_workers=h.num_workers, slot=slot,
                                round=round_, offset=16 * slot, count=16, op=h.op,
                                nonce=self.nonce if nonce is None else nonce))

    def run(self):
        while not self.stop.is_set():
            try:
                data, addr = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            h = H.parse(data)[0]
            self.seen[h.slot] = self.seen.get(h.slot, 0) + 1
            if h.slot == 9 and self.seen[9] == 1:         # every chunk sent: the notices
                self.other.sendto(self.notice(h, 4), addr)                  # not from the PS
                for note in (self.notice(h, 4, nonce=self.nonce ^ 1),       # another job's nonce
                             self.notice(h, 5, round_=2),                   # a round not pending
                             self.notice(h, 4), self.notice(h, 7)):
                    self.sock.sendto(note, addr)
            if h.slot in (4, 7) and self.seen[h.slot] == 1:
                continue                                   # answered when resent
            self.sock.sendto(self.result(h), addr)


@pytest.mark.parametrize("engine", ["c", "python"])
def test_a_notice_is_authenticated_and_a_forged_one_changes_nothing_but_a_resend(engine):
    # 8-bit lanes: the fake PS answers a 16-element chunk with 16 bytes
    server = PSServer(JobConfig(num_workers=1, slots=16, lane_bits=8), ("127.0.0.1", 0), control_port=0).start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port, phase_engine=engine,
                  timeout_ms=SLOW_MS, max_timeout_ms=2 * SLOW_MS, heartbeat=False)
    fake = NoticingPS(t.sessions[0]["nonce"])
    fake.start()
    t.shard_addrs = [fake.sock.getsockname()]
    try:
        t0 = time.monotonic()
        res = list(t.run_phase(H.DATA, [(16 * c, 16, bytes(8)) for c in range(10)]))
        took = time.monotonic() - t0
        c = t.stats.counters
    finally:
        fake.stop.set()
        fake.join(2)
        t.close(leave=False)
        server.stop()
    assert all(bytes(p) == bytes((16 * i + j) & 0xFF for j in range(16)) for i, (_, p) in enumerate(res))
    assert c["bad_packets"] == 2                # another job's nonce; not from the PS's address
    assert c["notices"] == 2 and c["retransmissions"] == 2 and c["timeouts"] == 0
    assert fake.seen[4] == fake.seen[7] == 2 and fake.seen[5] == 1 and took < SLOW_MS / 1e3
