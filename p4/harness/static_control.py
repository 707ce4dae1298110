"""Control plane for a switch whose tables the harness programmed in advance.

Run on a Mininet host: it answers the workers' registration (with the switch job),
barriers and stats; the data plane is the switch.  `python -m thc_ps.p4.harness.static_control
--bind 10.0.0.100:9001 --workers 4 --expect 10.0.0.1:5000 ...`
"""
from __future__ import annotations

import argparse
import logging
import sys

from thc_ps.p4.control import switch_job
from thc_ps.p4.spec import SLOTS
from thc_ps.ps_server.engine import wait
from thc_ps.ps_server.server import DEFAULT_LEASE_S, PSServer


class StaticEngine:
    """Registration only checks that the worker is the one the switch was programmed for; the
    job's nonce and the workers' tokens are the ones programmed in advance (fixed_*)."""

    def __init__(self, expected: dict, nonce: int = 0):
        self.expected = {w: (ip, port) for w, (ip, port, _) in expected.items()}
        self.fixed_tokens = {w: token for w, (_, _, token) in expected.items()}
        self.fixed_nonce = nonce

    job = None
    #: The switch was programmed for one job, in slots 0..: the PS admits one at a time.
    slot_space = SLOTS
    max_jobs = 1

    def start_job(self, job, nonce: int, base: int = 0) -> StaticEngine:
        """The switch was programmed for the job before it started: nothing to program."""
        self.job = job
        return self

    def register(self, rank: int, ip: str, port: int, token: int = 0) -> None:
        if self.expected.get(rank) != (ip, port):
            raise ValueError(f"worker {rank} at {ip}:{port} is not the address the switch expects")

    def unregister(self, rank: int) -> None:
        """The switch's workers table is fixed: a rank that left keeps its entry."""

    def region(self) -> tuple:
        """The one job's slots start at register 0."""
        return 0, self.job.slots + self.job.norm_slots

    def close(self) -> None:
        """The next job's start_job resets the registers."""

    def process(self, datagram: bytes, addr: tuple) -> list:
        return []

    def serve(self, fd: int, duration_ms: int, gro: bool = True, gso: bool = True) -> int:
        return wait(duration_ms)

    def stats(self) -> dict:
        return {"engine": "bmv2 (counters read by the harness)"}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--expect", action="append", default=[],
                    help="IP:PORT:TOKEN of worker i, in rank order (as the switch was programmed)")
    ap.add_argument("--nonce", type=int, default=0, help="the job nonce the switch was programmed with")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quorum", type=float, default=1.0)
    ap.add_argument("--granularity", type=int, default=30)
    ap.add_argument("--p", default="1/32")
    ap.add_argument("--lease-s", type=float, default=DEFAULT_LEASE_S, help="a rank's lease (seconds)")
    args = ap.parse_args()
    host, port = args.bind.rsplit(":", 1)
    expected = {}
    for i, item in enumerate(args.expect):
        h, p, token = item.split(":")
        expected[i] = (h, int(p), int(token))
    job = switch_job(args.workers, seed=args.seed, quorum=args.quorum, granularity=args.granularity,
                     p=args.p)
    # the control plane's events (jobs started and ended, leases lost, stalls) go to the harness,
    # which shows their last lines when a worker fails
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    server = PSServer(job, (host, 0), control_port=int(port), engine=StaticEngine(expected, args.nonce),
                      lease_s=args.lease_s).start()
    print("control plane up", flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:           # the harness stops it with SIGINT once the workers are done
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
