"""A THC round as a pipeline over its RHT blocks (worker/client.py `_pipelined_round`): the
same bytes on the wire, the same averages and residuals bit for bit as the plain round, each
block decoded with its own k under partial aggregation, and a failing encode that stops the
phase instead of leaving it waiting."""
import threading

import numpy as np
import pytest

from thc_ps.compression import thc
from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.server import PSServer
from tests.helpers import ranks_against_ps
from thc_ps.worker.client import Worker, average_lanes
from thc_ps.worker.transport import PackedChunks, Transport

DIM = 5 * 4096 + 1000          # block_log2 = 12: five whole blocks and a padded sixth


def cluster(n, pipeline, rounds=3, quorum=1.0, straggle=None, seed=7, lane_bits=0):
    """n workers in threads against the C PS; per rank, per round: (average, residual, report)."""
    job = JobConfig(num_workers=n, block_log2=12, quorum=quorum, seed=seed, lane_bits=lane_bits)
    out = {r: [] for r in range(n)}

    def rank(r, t):
        w = Worker(t, seed=seed, per_round_rng=True)
        w.pipeline = pipeline
        rng = np.random.default_rng([seed, r])
        for k in range(rounds):
            g = rng.standard_normal(DIM).astype(np.float32)
            if straggle is not None and r == straggle:
                w.straggler_delay = 0.03 if k % 2 else 0.0
            avg = w.allreduce(g, key="g", round_no=k)
            out[r].append((avg.copy(), w.errors.errors["g"].copy(), w.last))

    ranks_against_ps(job, n, rank)
    return out


@pytest.mark.parametrize("span", [None, 1000])
def test_pipelined_rounds_equal_plain_rounds_bit_for_bit(monkeypatch, span):
    """Whole blocks, and (span 1000) each block quantized in spans, chunks (1,432 coordinates
    here) straddling two spans, the first span made before the phase."""
    spans = []
    if span is not None:
        from thc_ps.worker import client
        monkeypatch.setattr(client, "SEND_SPAN", span)
        real = thc.WorkerRound.encode_span
        monkeypatch.setattr(thc.WorkerRound, "encode_span",
                            lambda self, j, lo, hi: (spans.append(hi - lo), real(self, j, lo, hi))[1])
    piped, plain = cluster(3, True), cluster(3, False)
    assert (1000 in spans) == (span is not None) and all(n % 2 == 0 for n in spans)
    for r in range(3):
        for (a, e, rep), (a0, e0, rep0) in zip(piped[r], plain[r]):
            assert rep.pipelined and not rep0.pipelined
            np.testing.assert_array_equal(a, a0)              # the average
            np.testing.assert_array_equal(e, e0)              # the error-feedback residual
            assert rep.chunk_digests() == rep0.chunk_digests()     # the PS's sums, chunk by chunk
            assert (rep.bytes_up, rep.chunks) == (rep0.bytes_up, rep0.chunks)
    for r in (1, 2):                                          # every replica decodes the same
        for (a, _, _), (a_0, _, _) in zip(piped[r], piped[0]):
            np.testing.assert_array_equal(a, a_0)


@pytest.mark.parametrize("pipeline", [True, False])
def test_seven_bit_lanes_decode_to_the_eight_bit_lanes_average_bit_for_bit(pipeline):
    """3 ranks at g = 30 (n·g = 90) get 7-bit result lanes by default: 1,632 coordinates a
    datagram instead of 1,432, an eighth fewer RESULT bytes, and the same averages and
    residuals, bit for bit, as a job that names 8-bit lanes."""
    narrow, wide = cluster(3, pipeline), cluster(3, pipeline, lane_bits=8)
    padded = 5 * 4096 + 1024            # the sixth block's 1,000 coordinates padded to 2^10
    for r in range(3):
        for (a, e, rep), (a8, e8, rep8) in zip(narrow[r], wide[r]):
            assert rep.pipelined == rep8.pipelined == pipeline
            np.testing.assert_array_equal(a, a8)
            np.testing.assert_array_equal(e, e8)
            assert (rep.chunks, rep8.chunks) == (-(-padded // 1632), -(-padded // 1432))
            counts = [min(1632, padded - o) for o in range(0, padded, 1632)]
            assert rep.bytes_down - 40 * rep.chunks == sum(-(-7 * c // 8) for c in counts) == 18816
            assert rep8.bytes_down - 40 * rep8.chunks == padded


def test_partial_aggregation_each_block_with_its_own_k():
    """Quorum 2 of 3 with rank 2 late every other round: chunks come back with k = 2 or 3;
    the average must be the plain decode of exactly those results (Y/k per chunk)."""
    piped = cluster(3, True, rounds=4, quorum=0.66, straggle=2)
    ks = set()
    for r in (0, 1):
        for k, (avg, _, rep) in enumerate(piped[r]):
            assert rep.pipelined and rep.lost == 0
            ks.update(rep.contributors)
            res = rep.phase
            layout = thc.make_layout(DIM, 12)
            job = JobConfig(num_workers=3, block_log2=12, quorum=0.66, seed=7)
            cfg = thc.ThcConfig.of_job(job)
            geometry = PackedChunks(np.zeros(layout.padded_dim // 2, np.uint8), layout.padded_dim, 4,
                                    job.elems_per_packet)
            ref = thc.decode(average_lanes(geometry, res, layout.padded_dim, cfg.granularity, job.lane_bits), 1,
                             np.asarray(rep.norms), cfg, layout, k)
            np.testing.assert_array_equal(avg, ref)
    assert 2 in ks


def test_a_failing_encode_stops_the_phase(monkeypatch):
    """The encode thread raises in the third block: the allreduce raises that error at once
    (bounded), rather than the phase waiting for chunks that will never be made."""
    job = JobConfig(num_workers=1, block_log2=12)
    server = PSServer(job, ("127.0.0.1", 0), control_port=0, engine="c").start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port)
    real = thc.WorkerRound.encode_blocks

    def broken(self, blocks):
        if blocks[0] == 2:
            raise RuntimeError("encode failed in block 2")
        return real(self, blocks)

    monkeypatch.setattr(thc.WorkerRound, "encode_blocks", broken)
    try:
        w = Worker(t, seed=1)
        w.pipeline = True
        done = threading.Event()
        with pytest.raises(RuntimeError, match="encode failed in block 2"):
            try:
                w.allreduce(np.ones(DIM, np.float32))
            finally:
                done.set()
        assert done.is_set()
    finally:
        t.close()
        server.stop()


def test_auto_pipelines_when_the_host_idled_through_the_last_phase(monkeypatch):
    """THC_PIPELINE=auto: plain until a DATA phase has been measured; pipelined after a
    plain phase with START_IDLE of the host idle, and kept while a pipelined one still
    leaves STAY_IDLE; back to plain on a busy host.  Other values are refused."""
    from thc_ps.worker import client
    assert client.idle_share((100, 1000), (160, 1100)) == pytest.approx(0.6)
    assert client.idle_share((100, 1000), (100, 1000)) is None and client.idle_share(None, (1, 2)) is None
    idle, total = client.cpu_times()
    assert 0 <= idle <= total

    w = Worker.__new__(Worker)
    w.pipeline, w._idle, w._piped = "auto", None, False
    assert not w._pipelines()
    for idle_, piped, want in ((0.30, False, True), (0.20, False, False), (0.12, True, True), (0.05, True, False)):
        w._idle, w._piped = idle_, piped
        assert w._pipelines() is want, (idle_, piped)
    w.pipeline = False
    w._idle = 0.9
    assert not w._pipelines()

    monkeypatch.setattr(client, "PIPELINE", "sometimes")
    with pytest.raises(ValueError, match="THC_PIPELINE must be auto, 0 or 1"):
        Worker(transport=type("T", (), {"job": JobConfig(num_workers=1), "worker_id": 0})())


def test_spans_start_small_grow_to_the_cap_and_cover_each_block_in_order():
    """A rotated round's quantizer spans (`send_spans`): the first SEND_SPAN long, so the wire
    starts early; each next twice the last up to SPAN_CAP, so a 2^20 block is six hand-offs
    to the phase, not sixteen; no span crosses a block's end; every boundary even."""
    from thc_ps.worker.client import SEND_SPAN, SPAN_CAP, send_spans
    padded = [1 << 20, 1 << 19, 1 << 12, 4]
    spans = send_spans(padded, SEND_SPAN, SPAN_CAP)
    assert [b - a for j, a, b in spans if j == 0] == [1 << 16, 1 << 17, 1 << 18, 1 << 18, 1 << 18, 1 << 16]
    assert [(a, b) for j, a, b in spans if j > 0] == [(0, 1 << 18), (1 << 18, 1 << 19), (0, 1 << 12), (0, 4)]
    assert [j for j, _, _ in spans] == sorted(j for j, _, _ in spans)
    for j, p in enumerate(padded):
        mine = [(a, b) for k, a, b in spans if k == j]
        assert mine[0][0] == 0 and mine[-1][1] == p
        assert all(b == a2 for (_, b), (a2, _) in zip(mine, mine[1:]))     # back to back
    assert all(a % 2 == 0 and b % 2 == 0 for _, a, b in spans)
    # a cap of the first span gives the fixed spans of before
    assert [b - a for _, a, b in send_spans([1 << 18], 1 << 16, 1 << 16)] == [1 << 16] * 4
    assert SEND_SPAN % 2 == 0 and SPAN_CAP % SEND_SPAN == 0
