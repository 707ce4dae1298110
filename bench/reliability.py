"""Reliability run of a long-lived PS: consecutive jobs of varying shapes and codecs, workers
killed and restarted, injected packet loss/duplicates/reordering, and a stranger sending
random control messages and random datagrams the whole time.  Prints a markdown table
(docs/reliability.md holds a run).

    .venv/bin/python bench/reliability.py --jobs 30
"""
from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thc_ps.deploy.launch import run_launch  # noqa: E402
from thc_ps.proto import control  # noqa: E402
from thc_ps.proto import headers as H  # noqa: E402
from thc_ps.ps_server.server import PSServer  # noqa: E402


def random_value(rng, depth=0):
    kind = rng.integers(0, 8 if depth < 2 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return int(rng.integers(-(1 << 62), 1 << 62)) * int(rng.choice([1, 1 << 1]))
    if kind == 2:
        return float(rng.standard_normal())
    if kind == 3:
        return rng.bytes(int(rng.integers(0, 40)))
    if kind == 4:
        return "".join(chr(int(c)) for c in rng.integers(32, 0x2FF, int(rng.integers(0, 12))))
    if kind == 5:
        return bool(rng.integers(0, 2))
    if kind == 6:
        return [random_value(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
    return {str(rng.integers(0, 9)): random_value(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))}


def junk_datagram(rng) -> bytes:
    """Half the time a well-formed THC header with a guessed nonce and token, else random bytes,
    most of them behind a valid magic, version and type: what a stranger can send the data plane."""
    if rng.random() < 0.5:
        r = lambda bits: int(rng.integers(0, 1 << bits))
        h = H.Header(type=H.DATA, job_id=1, worker_id=r(2), num_workers=r(2) + 1, elem_bits=4,
                     slot=r(9), round=r(32), count=64, op=H.OP_LOOKUP_SUM, nonce=r(32), token=r(32))
        return H.build(h, rng.bytes(32))
    b = bytearray(rng.bytes(int(rng.integers(0, 120))))
    if len(b) >= H.HEADER_SIZE and rng.random() < 0.7:
        b[0:3] = b"TH" + bytes([H.VERSION])
        b[3] = H.DATA
    return bytes(b)


def random_frame(rng) -> bytes:
    """Random bytes, or a random msgpack map with a known request type (never shutdown or
    drain, which a loopback peer of a key-less PS may legitimately send)."""
    if rng.random() < 0.3:
        return rng.bytes(int(rng.integers(0, 300)))
    types = [t for t in control.REQUEST_TYPES if t not in ("shutdown", "drain")] + ["bogus"]
    fields = sorted({f for spec in control.SCHEMA.values() for f in spec})
    msg = {"type": str(rng.choice(types))}
    for name in rng.choice(fields, int(rng.integers(0, 5)), replace=False):
        msg[str(name)] = random_value(rng)
    return msgpack.packb(msg, use_bin_type=True)


def stranger(server: PSServer, stop: threading.Event, counts: dict, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.control_port}")
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    while not stop.is_set():
        sock.send(random_frame(rng))
        if sock.poll(5000):
            counts["control_answered"] += control.decode(sock.recv())["type"] in ("error", "status", "stats")
        else:
            counts["control_unanswered"] += 1
            sock.close(0)
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{server.control_port}")
        counts["control_sent"] += 1
        for _ in range(20):
            udp.sendto(junk_datagram(rng), server.data_addr)
            counts["datagrams_sent"] += 1
        time.sleep(0.01)
    sock.close(0)
    udp.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    server = PSServer(None, ("127.0.0.1", 0), control_port=0, lease_s=0.5).start()
    counts = dict.fromkeys(("control_sent", "control_answered", "control_unanswered", "datagrams_sent"), 0)
    stop = threading.Event()
    fuzz = threading.Thread(target=stranger, args=(server, stop, counts, args.seed), daemon=True)
    fuzz.start()
    at = {"ps": f"127.0.0.1:{server.data_addr[1]}", "ps_control_port": server.control_port}
    rows, totals = [], dict.fromkeys(("rounds", "exact", "lost", "mismatched", "kills", "rejoins",
                                      "injected", "retransmissions"), 0)
    t0 = time.time()
    try:
        for j in range(args.jobs):
            workers = int(rng.integers(2, 5))
            codec = str(rng.choice(["thc", "thc", "none", "topk", "terngrad", "3lc"]))
            rounds = int(rng.integers(8, 20))
            dim = int(rng.choice([1000, 4096, 20000, 65536]))
            quorum = float(rng.choice([1.0, 0.75])) if workers == 4 and codec in ("thc", "none") else 1.0
            faults = {}
            if rng.random() < 0.5:
                faults = {"loss": 0.02, "duplicate": 0.02, "reorder": 0.02}
            kill = None
            if codec in ("thc", "none") and rng.random() < 0.5:
                kill = (int(rng.integers(0, workers)), int(rng.integers(1, rounds - 1)))
            doc = run_launch(workers=workers, rounds=rounds, dim=dim, codec=codec, quorum=quorum, kill=kill,
                             restart=True, seed=j, **faults, **at)
            injected = sum(doc["injected"].values())
            rows.append(f"| {j + 1} | {workers} | {codec} | {quorum:g} | {dim} | {rounds} | "
                        f"{'rank %d at round %d' % kill if kill else '-'} | {injected} | "
                        f"{doc['exact_rounds']}/{doc['rounds']} | {doc['lost_chunks']} | "
                        f"{'yes' if doc['ok'] else 'NO: ' + '; '.join(doc['problems'])} |")
            print(rows[-1], flush=True)
            totals["rounds"] += doc["rounds"]
            totals["exact"] += doc["exact_rounds"]
            totals["lost"] += doc["lost_chunks"]
            totals["mismatched"] += doc["mismatched_chunks"]
            totals["kills"] += kill is not None
            totals["injected"] += injected
            totals["retransmissions"] += doc["retransmissions"]
    finally:
        stop.set()
        fuzz.join(10)
        stats = server.stats()
        server.stop()
    totals["rejoins"] = stats["rejoins"]
    print()
    print(f"{args.jobs} jobs in {time.time() - t0:.0f} s: {totals}")
    print(f"stranger: {counts}")
    print(f"PS: jobs_started {stats['jobs_started']}, jobs_ended {stats['jobs_ended']}, "
          f"control_errors {stats['control_errors']}, leases_expired {stats['leases_expired']}, "
          f"drops {stats['drops']}")
    ok = totals["lost"] == 0 and totals["mismatched"] == 0 and totals["exact"] == totals["rounds"] \
        and counts["control_unanswered"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
