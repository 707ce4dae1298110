"""worker/_batchio.c: sendmmsg/recvmmsg wrappers on loopback."""
import select
import socket

import pytest

from thc_ps.proto.sockets import set_buffer
from thc_ps.worker import _batchio


@pytest.fixture
def pair():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    set_buffer(rx, 4 << 20)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.bind(("127.0.0.1", 0))
    tx.setblocking(False)
    yield tx, rx
    tx.close()
    rx.close()


def recv_all(rx, want, max_size=2048):
    got = []
    for _ in range(100):
        if len(got) >= want or not select.select([rx], [], [], 1.0)[0]:
            break
        got += _batchio.recv_many(rx.fileno(), 256, max_size)
    return got


def test_round_trip_in_order_with_sources(pair):
    tx, rx = pair
    pkts = [bytes([i % 256]) * (1 + i % 300) for i in range(150)]   # > 2 sendmmsg batches
    sent, refused = _batchio.send_many(tx.fileno(), pkts, *rx.getsockname())
    assert (sent, refused) == (150, 0)
    got = recv_all(rx, 150)
    assert [d for d, _ in got] == pkts
    assert {src for _, src in got} == {tx.getsockname()}


def test_oversized_datagram_is_cut_to_max_size(pair):
    tx, rx = pair
    _batchio.send_many(tx.fileno(), [b"a" * 100, b"b" * 10], *rx.getsockname())
    assert [d for d, _ in recv_all(rx, 2, max_size=16)] == [b"a" * 16, b"b" * 10]


def test_nothing_queued_returns_empty(pair):
    _, rx = pair
    assert _batchio.recv_many(rx.fileno(), 8, 2048) == []


def test_refused_destination_counts_as_lost(pair):
    tx, _ = pair
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    dead = probe.getsockname()
    probe.close()                                  # nobody listens there: ICMP port unreachable
    tx.connect(dead)                               # a connected socket reports ECONNREFUSED
    total_refused = 0
    for _ in range(20):
        sent, refused = _batchio.send_many(tx.fileno(), [b"x"] * 4, *dead)
        assert sent == 4
        total_refused += refused
        select.select([], [], [], 0.01)
    assert total_refused >= 1


def test_bad_arguments_are_explained(pair):
    tx, rx = pair
    with pytest.raises(ValueError, match="bad IPv4 destination"):
        _batchio.send_many(tx.fileno(), [b"x"], "not-an-ip", 9)
    with pytest.raises(TypeError):
        _batchio.send_many(tx.fileno(), [1, 2], "127.0.0.1", 9)
    with pytest.raises(ValueError, match="max_packets"):
        _batchio.recv_many(rx.fileno(), 0, 2048)
    with pytest.raises(OSError):
        _batchio.recv_many(-1, 4, 2048)
