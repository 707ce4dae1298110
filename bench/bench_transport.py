"""Loopback UDP transport: plain Python sendto/recvfrom vs sendmmsg/recvmmsg vs UDP GSO/GRO.

Sender and receiver are separate processes (one core each on a 2-core machine); each
mode sends the same number of THC-sized datagrams (32-byte header + 720-byte payload
by default) and the receiver counts what arrived.  Same run, side by side.

    .venv/bin/python bench/bench_transport.py [--packets 400000] [--size 752]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import time


def receiver(mode, port_q, result_q, size, idle_ms):
    from bench._udpbench import udp_drain
    from thc_ps.proto.sockets import set_buffer
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    set_buffer(s, 32 << 20)
    s.bind(("127.0.0.1", 0))
    port_q.put(s.getsockname()[1])
    if mode == "python":
        s.settimeout(idle_ms / 1e3)
        n = b = 0
        t0 = None
        try:
            while True:
                data = s.recv(65536)
                if t0 is None:
                    t0 = time.perf_counter()
                n += 1
                b += len(data)
        except TimeoutError:
            pass
        result_q.put((n, b))
        return
    pkts, byts = udp_drain(s.fileno(), idle_ms, 120000, 64, mode == "gso", size)
    result_q.put((pkts, byts))


def sender(mode, port, count, size):
    from bench._udpbench import udp_blast
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    payload = bytes(size)
    t = time.perf_counter()
    if mode == "python":
        dest = ("127.0.0.1", port)
        for _ in range(count):
            s.sendto(payload, dest)
    elif mode == "mmsg":
        udp_blast(s.fileno(), "127.0.0.1", port, payload, count, 64, 0)
    else:
        udp_blast(s.fileno(), "127.0.0.1", port, payload, count, 16, 40)
    return time.perf_counter() - t


def run(mode, count, size, idle_ms=300):
    ctx = mp.get_context("spawn")
    pq, rq = ctx.Queue(), ctx.Queue()
    rx = ctx.Process(target=receiver, args=(mode, pq, rq, size, idle_ms))
    rx.start()
    port = pq.get(timeout=30)
    time.sleep(0.2)
    elapsed = sender(mode, port, count, size)
    got, byts = rq.get(timeout=300)
    rx.join(10)
    return elapsed, got, byts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packets", type=int, default=400000)
    ap.add_argument("--size", type=int, default=752, help="datagram bytes (default: THC 32 + 720)")
    args = ap.parse_args()
    print(f"{args.packets} datagrams of {args.size} B over loopback, sender timed, receiver counts")
    print(f"{'mode':<26}{'send s':>8}{'Mpps sent':>11}{'Gbit/s':>8}{'received':>10}{'x python':>9}")
    base = None
    for mode, label in (("python", "python sendto/recvfrom"), ("mmsg", "sendmmsg/recvmmsg (C)"),
                        ("gso", "UDP GSO/GRO + mmsg (C)")):
        t, got, _ = run(mode, args.packets, args.size)
        rate = args.packets / t
        base = base or rate
        print(f"{label:<26}{t:8.2f}{rate / 1e6:11.3f}{rate * args.size * 8 / 1e9:8.2f}"
              f"{got / args.packets:10.1%}{rate / base:9.1f}", flush=True)


if __name__ == "__main__":
    main()
