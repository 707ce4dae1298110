"""Coalesced datagrams (UDP GRO batches) at the PS and GSO sends, on both engines.

A GRO batch is one buffer of segments from one sender, each `seg_size` bytes except a
shorter last one.  Every segment must be validated and counted exactly as a lone datagram:
the C engine's `process_segments` (the path `serve` takes) against the reference engine
processing the segments one by one, and on a real loopback socket with GSO sends.
"""
import socket
import time

import numpy as np
import pytest

from thc_ps.proto import headers as H
from thc_ps.proto import udpio
from thc_ps.ps_server.reference import ReferencePS
from tests.test_ps_engine import (ADDRS, NONCE, TOKENS, data_packet, engines_for, job_for,
                                  register_all, sequence, stable_seed)


def gro_batches(seq, rng):
    """Group consecutive packets of one sender into batches the way the kernel coalesces
    (equal sizes, a shorter last one), plus batches of mixed sizes and foreign segments."""
    out, i = [], 0
    while i < len(seq):
        pkt, addr = seq[i]
        want = int(rng.integers(1, 9))
        batch, j = [pkt], i + 1
        while j < len(seq) and len(batch) < want and seq[j][1] == addr and len(seq[j][0]) <= len(pkt):
            batch.append(seq[j][0])
            j += 1
            if len(batch[-1]) < len(pkt):
                break
        if rng.random() < 0.05 and len(batch) > 1:
            batch[int(rng.integers(0, len(batch) - 1))] += b"\x00" * 3   # a segment of the wrong size
        out.append((b"".join(batch), len(batch[0]), addr))
        i = j
    return out


@pytest.mark.parametrize("codec,quorum,lane_bits,bits,g", [
    ("thc", 1.0, 8, 4, 30), ("thc", 0.75, 8, 4, 30), ("none", 1.0, 8, 4, 30), ("thc", 0.5, 32, 2, 10)])
def test_gro_batches_match_lone_datagrams(codec, quorum, lane_bits, bits, g):
    job = job_for(codec, quorum, lane_bits, bits, g)
    seed = stable_seed("gro", codec, quorum, lane_bits, bits)
    seq = sequence(job, seed=seed)
    batches = gro_batches(seq, np.random.default_rng(seed))
    assert sum(1 for b, s, _ in batches if len(b) > s) > 100
    ref, fast = engines_for(job)
    register_all(ref)
    register_all(fast)
    for buf, seg, addr in batches:
        assert ref.process_segments(buf, seg, addr) == fast.process_segments(buf, seg, addr), seed
    assert ref.stats.as_dict() == fast.stats()
    lone = ReferencePS(job, NONCE)            # the same segments as lone datagrams
    register_all(lone)
    for buf, seg, addr in batches:
        for part in H.split_segments(buf, seg):
            lone.process(bytes(part), addr)
    assert lone.stats.as_dict() == fast.stats()
    io = fast.io_stats()
    assert io["rx_coalesced"] > 100 and io["rx_datagrams"] == fast.stats()["packets_in"]


@pytest.mark.parametrize("kind", ["c", "python"])
def test_batch_with_foreign_malformed_and_short_last(kind):
    """Four contributions of one round in one batch from worker 0's address: one valid, one
    with another job's nonce, one cut short (last segment), one garbage of the same size."""
    job = job_for()
    ref, fast = engines_for(job)
    e = fast if kind == "c" else ref
    register_all(e)
    rng = np.random.default_rng(5)
    good = data_packet(job, rng, 0, 1, 3)
    foreign = bytearray(data_packet(job, rng, 0, 2, 3))
    foreign[32:36] = b"\x0b\xad\xf0\x0d"
    garbage = bytes(rng.integers(0, 256, len(good), dtype=np.uint8))
    short = data_packet(job, rng, 0, 3, 3)[:-5]
    buf = good + bytes(foreign) + garbage + short
    assert e.process_segments(buf, len(good), ADDRS[0]) == []
    s = e.stats() if kind == "c" else e.stats.as_dict()
    assert s["packets_in"] == 4 and s["bytes_in"] == len(buf)
    assert s["drops"]["unknown_job"] == 1 and s["drops"]["malformed"] == 2
    # the valid segment was aggregated: the other three workers complete slot 1's round 3
    outs = [e.process(data_packet(job, rng, w, 1, 3), ADDRS[w]) for w in (1, 2, 3)]
    assert [a for _, a in outs[-1]] == ADDRS


def test_split_segments_rule():
    assert [bytes(s) for s in H.split_segments(b"abcdefg", 3)] == [b"abc", b"def", b"g"]
    assert [bytes(s) for s in H.split_segments(b"abcdef", 0)] == [b"abcdef"]
    assert [bytes(s) for s in H.split_segments(b"abc", 5)] == [b"abc"]
    assert [bytes(s) for s in H.split_segments(b"", 4)] == [b""]


def _gso_send(sock, dest, datagrams):
    """One sendmsg of equal-size datagrams as a GSO message (the last may be shorter)."""
    seg = len(datagrams[0])
    sock.sendmsg([b"".join(datagrams)], [(udpio.SOL_UDP, udpio.UDP_SEGMENT, seg.to_bytes(2, "little"))],
                 0, dest)


def _serve_counts(offload: bool):
    """A C engine serving a loopback socket; worker 0 sends one GSO message of four DATA
    packets of four slots plus a foreign one; returns (stats, io_stats, replies seen)."""
    from thc_ps.ps_server.server import make_engine, udp_socket
    job = job_for(quorum=0.25)                       # one contribution completes a round
    engine = make_engine(job, "c", NONCE)
    ps = udp_socket(("127.0.0.1", 0))
    udpio.set_gro(ps, offload)
    wk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    wk.bind(("127.0.0.1", 0))
    udpio.set_gro(wk, offload)
    engine.register(0, *wk.getsockname(), TOKENS[0])
    rng = np.random.default_rng(9)
    pkts = [data_packet(job, rng, 0, s, 1) for s in range(4)]
    foreign = bytearray(data_packet(job, rng, 0, 0, 2))
    foreign[8:10] = b"\x77\x77"
    try:
        _gso_send(wk, ps.getsockname(), pkts + [bytes(foreign)])
    except OSError:
        pytest.skip("kernel without UDP GSO")
    handled = 0
    deadline = time.monotonic() + 5
    while handled < 5 and time.monotonic() < deadline:
        handled += engine.serve(ps.fileno(), 200, offload, offload)
    wk.settimeout(2)
    replies = []
    while len(replies) < 4:
        replies.extend(udpio.recv_datagrams(wk)[0])
    ps.close()
    wk.close()
    return engine.stats(), engine.io_stats(), replies


@pytest.mark.parametrize("offload", [True, False], ids=["gro-gso", "forced-fallback"])
def test_serve_loopback_coalesced(offload):
    stats, io, replies = _serve_counts(offload)
    assert stats["packets_in"] == 5 and stats["drops"]["unknown_job"] == 1
    assert stats["rounds_completed"] == 4 and stats["packets_out"] == 4
    assert sorted(H.parse(r)[0].slot for r in replies) == [0, 1, 2, 3]
    assert io["rx_datagrams"] == 5 and io["tx_datagrams"] == 4
    if offload:
        assert io["rx_coalesced"] == 1 and io["rx_messages"] == 1     # one GRO batch of five
        assert io["tx_gso_messages"] == 1 and io["tx_messages"] == 1  # four results, one GSO send
    else:
        assert io["rx_coalesced"] == 0 and io["rx_messages"] == 5 and io["tx_gso_messages"] == 0


def test_python_engine_receives_gro_batch():
    """The Python data loop splits a GRO batch left on the socket by the C engine's option."""
    from thc_ps.ps_server.server import udp_socket
    ps = udp_socket(("127.0.0.1", 0))
    if not udpio.set_gro(ps, True):
        pytest.skip("kernel without UDP GRO")
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.bind(("127.0.0.1", 0))
    try:
        _gso_send(tx, ps.getsockname(), [b"a" * 100, b"b" * 100, b"c" * 40])
    except OSError:
        pytest.skip("kernel without UDP GSO")
    ps.settimeout(2)
    got = []
    while len(got) < 3:
        got += udpio.recv_datagrams(ps)[0]
    assert got == [b"a" * 100, b"b" * 100, b"c" * 40]
    ps.close()
    tx.close()


def test_offload_env_switch(monkeypatch):
    monkeypatch.setenv("THC_UDP_OFFLOAD", "0")
    assert not udpio.offload_enabled()
    monkeypatch.delenv("THC_UDP_OFFLOAD")
    assert udpio.offload_enabled()
