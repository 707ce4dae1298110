"""Codec framework: built-in codecs, the BLOB path through the PS, corrupt payloads."""
import socket
import struct

import numpy as np
import pytest

from thc_ps.compression import registry
from thc_ps.compression.codec import CodecError, Context, run_round
from thc_ps.compression.codecs_builtin import TopKCodec
from thc_ps.deploy.launch import run_launch
from thc_ps.proto import blob as B
from thc_ps.proto import headers as H
from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.server import PSServer
from thc_ps.worker.client import Worker
from thc_ps.worker.transport import Transport

from tests.helpers import run_threads

BUILTIN = ["thc", "uhc", "terngrad", "topk", "none"]


def grads(n=3, d=5000, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.lognormal(0, 1, d).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("name,bound", [("thc", 0.05), ("uhc", 2.0), ("terngrad", 40.0), ("topk", 1.0),
                                        ("none", 1e-12)])
def test_builtin_codecs_estimate_the_mean(name, bound):
    g = grads()
    mean = np.mean(g, axis=0)
    est, ups, down = run_round(registry.get(name), g, np.random.default_rng(1))
    assert est.shape == mean.shape and est.dtype == np.float32
    assert np.sum((est - mean) ** 2) / np.sum(mean ** 2) <= bound


def test_registry_lists_homomorphic_flags():
    assert registry.get("thc").homomorphic and registry.get("terngrad").homomorphic
    assert not registry.get("topk").homomorphic
    with pytest.raises(ValueError, match="unknown codec"):
        registry.get("gzip")


def test_topk_payload_bytes_exact():
    c = TopKCodec(fraction=0.5, error_feedback=False)
    x = np.array([0.0, 3.0, -5.0, 1.0], np.float32)
    payload = c.encode(x, {}, None, Context("t", 4))
    assert payload == struct.pack(">IIIff", 2, 1, 2, 3.0, -5.0)
    assert c.decode(payload, Context("t", 4)).tolist() == [0.0, 3.0, -5.0, 0.0]


def test_terngrad_codes_bytes_exact():
    c = registry.get("terngrad")
    x = np.array([1.0, -1.0, 0.0, 0.5], np.float32)
    u = np.array([0.0, 0.0, 0.0, 0.9], np.float32)

    class FixedRng:
        def random(self, n, dtype=None):
            return u
    payload = c.encode(x, {}, FixedRng(), Context("t", 4, shared=np.array([1.0])))
    # ternary (1, -1, 0, 0) -> codes (2, 0, 1, 1), 2 bits each, MSB first
    assert payload == bytes([0b10000101])


@pytest.mark.parametrize("name", BUILTIN)
def test_corrupt_payloads_raise_codec_error(name):
    c = registry.get(name)
    g = grads(2, 300)
    _, ups, down = run_round(c, g, np.random.default_rng(0))
    shared = np.array([100.0, 100.0]) if name in ("uhc",) else np.array([100.0])
    ctx = Context("t", 300, shared=shared, contributors=2)
    for bad in (down[:-1], down + b"\x00", b""):
        with pytest.raises(CodecError):
            c.decode(bad, ctx)
    if not c.homomorphic:
        with pytest.raises(CodecError):
            c.aggregate([ups[0][:-3], ups[1]], {}, ctx)


def _two_ranks(job: JobConfig, body) -> dict:
    """body(rank, worker) for the two ranks of `job` on a fresh PS, in threads: {rank: result}."""
    server = PSServer(job, ("127.0.0.1", 0), control_port=0).start()
    res = {}

    def run(rank):
        t = Transport("127.0.0.1", server.data_addr[1], rank, control_port=server.control_port)
        try:
            res[rank] = body(rank, Worker(t, seed=9))
        finally:
            t.close()
    errors = run_threads(run, 2)
    server.stop()
    assert not errors, errors
    return res


def test_error_feedback_is_keyed_by_tensor_not_chunking():
    """The same tensor through two PS jobs with different packet sizes gives the same results."""
    out = {mtu: _two_ranks(JobConfig(num_workers=2, codec="topk", mtu=mtu),
                           lambda rank, w: [w.allreduce(grads(2, 20000, seed=r)[rank], key="layer")
                                            for r in range(3)])
           for mtu in (1500, 600)}
    for r in range(3):
        assert np.array_equal(out[1500][0][r], out[600][0][r])
    assert not np.array_equal(out[1500][0][0], out[1500][0][1])   # error feedback changed round 2


@pytest.mark.parametrize("codec", ["thc", "none", "topk"])
def test_allreduce_in_place_equals_a_new_result(codec):
    """allreduce(x, out=x) writes the same average into x as the returned vector of a run
    without `out`, round after round (THC's error feedback and pooled buffers included);
    an unusable `out` is refused before anything is sent."""
    def rounds(rank, w, in_place):
        got = []
        for r in range(3):
            g = grads(2, 20000, seed=r)[rank].astype(np.float32)
            if in_place:
                assert w.allreduce(g, key="layer", out=g) is g
                got.append(g)
            else:
                got.append(w.allreduce(g, key="layer"))
        if in_place and rank == 0:
            with pytest.raises(ValueError, match="out must be"):
                w.allreduce(g, key="layer", out=np.empty(10, np.float32))
        return got
    out = {in_place: _two_ranks(JobConfig(num_workers=2, codec=codec),
                                lambda rank, w, in_place=in_place: rounds(rank, w, in_place))
           for in_place in (False, True)}
    for rank in range(2):
        for r in range(3):
            assert np.array_equal(out[False][rank][r], out[True][rank][r])


def test_blob_path_equals_in_process_aggregate_under_faults():
    doc = run_launch(workers=3, rounds=4, dim=30000, codec="topk", loss=0.03, duplicate=0.03, reorder=0.03)
    assert doc["exact_rounds"] == 4 and doc["mismatched_chunks"] == 0
    assert doc["retransmissions"] > 0 and doc["drops"]["duplicate"] > 0


def test_blob_path_with_quorum_and_zero_policy():
    doc = run_launch(workers=3, rounds=4, dim=20000, codec="topk", loss=0.05, policy="zero",
                     timeout_ms=200)
    assert doc["mismatched_chunks"] == 0
    assert doc["exact_rounds"] + doc["lost_chunks"] >= 4


def test_corrupt_blob_is_counted_and_ps_keeps_serving():
    job = JobConfig(num_workers=1, codec="topk")
    server = PSServer(job, ("127.0.0.1", 0), control_port=0).start()
    try:
        t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port, timeout_ms=100,
                      max_retries=2)
        bad = struct.pack(">I", 5) + b"\x00" * 7                     # claims 5 entries, has fewer
        with pytest.raises(Exception):  # noqa: B017 - any refusal: an error reply or the transport giving up
            t.run_blob(bad, 100, t.next_blob_round())
        # garbage fragments: sub-header missing, inconsistent lengths
        raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for payload in (b"\x01", B.SUB.pack(10, 5) + b"\x00" * 20):
            pkt = H.build(H.Header(type=H.DATA, job_id=1, worker_id=0, num_workers=1, elem_bits=8,
                                   round=50, count=max(0, len(payload) - 8), op=H.OP_BLOB,
                                   nonce=t.sessions[0]["nonce"], token=t.sessions[0]["token"]), payload)
            t.sock.sendto(pkt, t.ps)
        raw.close()
        w = Worker(t, seed=1)
        x = grads(1, 4000)[0]
        est = w.allreduce(x, key="k")
        assert np.count_nonzero(est) == 400
        drops = server.stats()["drops"]
        assert drops["codec_error"] >= 1 and drops["malformed"] >= 1
        t.close()
    finally:
        server.stop()


def test_fragmentation_round_trip_and_rejects():
    payload = bytes(range(256)) * 13
    frags = B.fragments(payload, 77, 100)
    r = None
    for off, f in reversed(frags + frags[:3]):
        total, dim, data = B.parse_fragment(f)
        r = r or B.Reassembly(total, dim)
        r.add(off, data, total, dim)
    assert r.complete and r.payload() == payload
    with pytest.raises(B.BlobError):
        r.add(0, b"x", len(payload), 78)
    with pytest.raises(B.BlobError):
        B.parse_fragment(b"abc")
