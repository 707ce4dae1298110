"""The aggregation engine protocol: what the PS process (ps_server/server.py) needs of the
thing that aggregates one job's packets.

Four implementations, one signature each:

- ``thc_ps.ps_server.reference.ReferencePS``: the executable specification, in Python;
- ``thc_ps.ps_server._fastpath.Engine``: the C hot path (recvmmsg/sendmmsg, GIL released);
- ``thc_ps.p4.control.SwitchJob``: programs one job on a bmv2 switch, which aggregates (made by
  ``thc_ps.p4.control.SwitchEngine``, the switch's ExternalEngine);
- ``thc_ps.p4.harness.static_control.StaticEngine``: a switch programmed in advance.

The PS owns the UDP socket and hands its descriptor to ``serve``; ``process`` is the same
step for one datagram, without a socket (the differential tests drive it directly).  The
two switch engines aggregate in the switch: their ``serve`` only waits and their
``process`` answers nothing.
"""
from __future__ import annotations

import os
import select
import socket
import time
from typing import Protocol, runtime_checkable

from thc_ps.proto import headers as H
from thc_ps.proto.udpio import recv_datagrams


@runtime_checkable
class Engine(Protocol):
    """One job's aggregation engine."""

    def register(self, rank: int, ip: str, port: int, token: int = 0) -> None:
        """Bind `rank` to its source address and 32-bit data-plane token (replaces an old one)."""

    def unregister(self, rank: int) -> None:
        """Forget `rank` (it left or lost its lease): its packets count as `unregistered`."""

    def process(self, datagram: bytes, addr: tuple) -> list:
        """One datagram in, the [(packet, (ip, port))] to send out."""

    def serve(self, fd: int, duration_ms: int, gro: bool = True, gso: bool = True) -> int:
        """Serve the UDP socket `fd` for about `duration_ms`; returns the datagrams handled.
        `gro`/`gso`: whether coalesced receives and segmented sends may be used (proto/udpio.py)."""

    def stats(self) -> dict:
        """Counters by name and ``"drops"``: {reason: count}."""

    def region(self) -> tuple:
        """(base, size): the job's slots in the PS's slot space (or the switch's registers)."""

    def close(self) -> None:
        """The job ended: free its slots (cleared) for the next job."""


@runtime_checkable
class ExternalEngine(Protocol):
    """What aggregates for the PS rather than engines it makes (a switch): the PS admits jobs
    into its `slot_space` slots, at most `max_jobs` at once, and `start_job` gives each its
    engine.  ``fixed_nonce`` / ``fixed_tokens`` are what a switch programmed in advance
    already holds (None / {} when the PS draws them).  ``serve`` and ``stats`` are the
    switch's own: what no job owns."""

    fixed_nonce: int | None
    fixed_tokens: dict
    slot_space: int
    max_jobs: int

    def start_job(self, job, nonce: int, base: int = 0) -> Engine:
        """A new job starts in slots base..: program it (clean region, its configuration and
        nonce) and return its engine."""

    def serve(self, fd: int, duration_ms: int, gro: bool = True, gso: bool = True) -> int:
        """Wait on the PS socket (the switch answers the data plane)."""

    def stats(self) -> dict:
        """Counters of what no job owns."""


def header_drop(datagram: bytes) -> str | None:
    """The drop reason of a datagram that is not a well-formed DATA/NORM header (the checks
    that need no job), or None: what a Mux counts before it looks the job id up."""
    try:
        h, _ = H.parse(datagram)
    except H.PacketError as exc:
        return exc.reason
    return None if h.type in (H.DATA, H.NORM) else "malformed"


class JobTable:
    """Several jobs on one socket, in Python: each datagram goes to the engine of its job id,
    a datagram of no job is counted here (the twin of the C `_fastpath.Mux`, tested equal)."""

    def __init__(self):
        self.engines: dict = {}
        self.counters = {"packets_in": 0, "bytes_in": 0}
        self.drops: dict = {}

    def add(self, job_id: int, engine) -> None:
        if job_id in self.engines:
            raise ValueError(f"job id {job_id} is already served")
        self.engines[job_id] = engine

    def remove(self, job_id: int) -> None:
        if job_id not in self.engines:
            raise KeyError(f"job id {job_id} is not served")
        del self.engines[job_id]

    def jobs(self) -> list:
        return list(self.engines)

    def process(self, datagram: bytes, addr: tuple) -> list:
        reason = header_drop(datagram)
        engine = None if reason else self.engines.get(int.from_bytes(datagram[8:10], "big"))
        if engine is None:
            self.counters["packets_in"] += 1
            self.counters["bytes_in"] += len(datagram)
            reason = reason or "unknown_job"
            self.drops[reason] = self.drops.get(reason, 0) + 1
            return []
        return engine.process(datagram, addr)

    def serve(self, fd: int, duration_ms: int, gro: bool = True, gso: bool = True) -> tuple:
        """As Mux.serve: (datagrams handled, []) — every job is handled here."""
        return serve_by_process(self, fd, duration_ms), []

    def stats(self) -> dict:
        return {**self.counters, "drops": dict(self.drops)}


def serve_by_process(engine: Engine, fd: int, duration_ms: int) -> int:
    """`Engine.serve` for an engine with only a per-datagram `process`: wait on `fd`, hand
    each datagram to ``engine.process`` and send what it returns, for `duration_ms`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, fileno=os.dup(fd))
    handled = 0
    deadline = time.monotonic() + duration_ms / 1e3
    try:
        sock.setblocking(False)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([sock], [], [], left)[0]:
                return handled
            try:
                datagrams, addr = recv_datagrams(sock)      # a GRO batch split into datagrams
            except (BlockingIOError, ConnectionRefusedError):
                continue
            for data in datagrams:
                handled += 1
                for pkt, dest in engine.process(data, addr):
                    try:
                        sock.sendto(pkt, dest)
                    except OSError:
                        pass
    finally:
        sock.close()        # the duplicate; the PS's socket stays open


def wait(duration_ms: int) -> int:
    """`Engine.serve` of an engine whose data plane is elsewhere (a switch): sleep."""
    time.sleep(duration_ms / 1e3)
    return 0
