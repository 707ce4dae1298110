"""Packets per second through bmv2 simple_switch running p4/thc.p4 (a correctness target:
bmv2 is slow by design), and the program's resource summary from the compiled JSON.

Needs root, simple_switch and p4c-bm2-ss (PATH or /opt/p4tools/bin).  The job and the workers
are programmed by thc_ps.p4.control.SwitchEngine, as `thc p4 run` programs them (job nonce, rank
tokens); the script exits 1 when a row completes fewer rounds than it sent.

    .venv/bin/python bench/bench_p4.py [--rounds 200]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `bench`, `tests`: run from a checkout
from thc_ps.p4.control import SwitchEngine, compile_program, switch_job  # noqa: E402
from thc_ps.p4.harness.veth_switch import VethSwitch  # noqa: E402
from thc_ps.p4.resources import resources  # noqa: E402
from scapy.layers.inet import IP, UDP  # noqa: E402
from scapy.layers.l2 import Ether  # noqa: E402

from tests.p4.test_switch import N, NONCE, OTHER_MAC, PS_MAC, TOKENS, WORKERS, datagram, frame  # noqa: E402


def _tail(sw, count: int, start: float) -> tuple[int, float]:
    """Collect the last outputs; the clock stops at the last frame received, not at the
    one-second silence that proves nothing more is coming."""
    last = time.perf_counter()
    while time.perf_counter() - start < 180:
        n = sw.poll(1.0)
        if n == 0:
            break
        count += n
        last = time.perf_counter()
    return count, last


def pump(sw, sends: list, window: int | None) -> tuple[int, float]:
    """Send [(port, frame)] keeping at most `window` frames unanswered (a worker's send
    window; None sends everything at once); returns (frames the switch emitted, seconds)."""
    out = 0
    t = time.perf_counter()
    for i, (port, f) in enumerate(sends):
        sw.send(port, f)
        while window is not None and (i + 1) - out >= window and time.perf_counter() - t < 120:
            out += sw.poll(0.05)
    out, last = _tail(sw, out, t)
    return out, last - t


def run_rounds(sw, job, rounds: int, window: int | None, rng) -> tuple[int, float]:
    """`rounds` THC rounds (N DATA packets each, slots reused round-robin); returns (rounds
    whose RESULT reached all N workers, seconds)."""
    slots = job.slots
    sends = [(w + 1, frame(w, datagram(job, w, r % slots, r // slots + 1, rng))) for r in range(rounds)
             for w in range(N)]
    results, dt = pump(sw, sends, window)
    return results // N, dt


def run_forwarding(sw, packets: int, window: int) -> tuple[int, float]:
    """Plain L2 forwarding of non-THC UDP frames through the same program, same window rule."""
    f = bytes(Ether(dst=OTHER_MAC, src=WORKERS[0].mac) / IP(src=WORKERS[0].ip, dst="10.0.0.99") /
              UDP(sport=1234, dport=4321) / (b"x" * 48))
    return pump(sw, [(1, f)] * packets, window)


def program(sw, job) -> None:
    """The job and its workers, through the one code path `thc p4 run` uses."""
    switch = SwitchEngine(sw.control, {w.ip: (w.switch_port, w.mac) for w in WORKERS}, PS_MAC, l2={OTHER_MAC: N + 1})
    engine = switch.start_job(job, NONCE)
    for w in WORKERS:
        engine.register(w.worker_id, w.ip, w.udp_port, TOKENS[w.worker_id])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200, help="THC rounds per measurement")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp())
    json_path = compile_program(out)
    print("resources:", json.dumps(resources(json_path)))
    job = switch_job(N, slots=64, norm_slots=8)
    sw = VethSwitch(json_path, N + 1)
    try:
        program(sw, job)
        rng = np.random.default_rng(0)
        print("pkts/s = input packets the switch fully processed per second (rounds done x n / time)")
        print(f"{'traffic':<22}{'window':>8}{'sent':>7}{'done':>7}{'pkts/s':>9}{'coord/s':>9}")
        short = []
        for window in (8, 32, None):
            sw.reset()
            done, dt = run_rounds(sw, job, args.rounds, window, rng)
            if window is not None and done < args.rounds:   # unwindowed, the switch's queue overflows
                short.append(f"window {window or 'none'}: {done} of {args.rounds} rounds completed")
            print(f"{'THC DATA (rounds)':<22}{window or 'none':>8}{args.rounds:>7}{done:>7}"
                  f"{done * N / dt:>9.0f}{done * 32 / dt:>9.0f}")
        got, dt = run_forwarding(sw, args.rounds * N, 32)
        print(f"{'non-THC L2 (frames)':<22}{32:>8}{args.rounds * N:>7}{got:>7}{got / dt:>9.0f}")
        if got < args.rounds * N:
            short.append(f"L2 forwarding: {got} of {args.rounds * N} frames forwarded")
    finally:
        sw.close()
    for problem in short:
        print(f"bench_p4: {problem}", file=sys.stderr)
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main())
