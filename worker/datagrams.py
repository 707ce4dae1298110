"""The worker's data-plane sockets: set-up (its own UDP socket, and the job's result group
when it has one), batched sends and receives, and the fault injection of experiments.

I/O is batched (worker/_batchio.c): the packets that enter the window in one pass leave with
one sendmmsg, and one recvmmsg takes everything queued; with $THC_UDP_OFFLOAD unset or 1 the
sockets receive with UDP GRO (proto/udpio.py).  Which phase or shard a datagram belongs to is
not decided here: `recv_many` hands back every well-formed packet with its source, and the
phase engine (worker/phases.py) keeps those of its job and session.

Fault injection: seeded drops of outgoing and incoming packets, duplicates and reordering
of outgoing packets (`Faults`), each drawn per packet from an RNG of (seed, rank), and drops
of chosen packets by their (type, slot, round), once each (tests that need one loss exactly
where they say).  The C phase loop draws the random drops itself (its own SplitMix64
stream of (seed, rank), `Datagrams.drop_state`); the other faults run the Python loop.
"""
from __future__ import annotations

import select
import socket
from dataclasses import dataclass, field

import numpy as np

from thc_ps.proto import headers as H
from thc_ps.proto import udpio
from thc_ps.proto.job import parse_group
from thc_ps.proto.sockets import group_socket, set_buffer

try:
    from thc_ps.worker import _batchio      # sendmmsg/recvmmsg, built by `pip install`
except ImportError:                  # pragma: no cover - the per-datagram loop serves without it
    _batchio = None


@dataclass
class Faults:
    """Injected faults: each of the first four a probability per packet, from a seeded RNG;
    `drop_out_once` / `drop_in_once` name packets, as (type, slot, round) triples, that are
    dropped the first time one passes (outgoing / incoming; a resend then passes)."""

    drop_out: float = 0.0
    drop_in: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    seed: int = 0
    drop_out_once: tuple = ()
    drop_in_once: tuple = ()

    def __post_init__(self):
        for name in ("drop_out", "drop_in", "duplicate", "reorder"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                raise ValueError(f"{name} must be a probability in [0, 1), got {v}")
        for name in ("drop_out_once", "drop_in_once"):
            if any(len(t) != 3 for t in getattr(self, name)):
                raise ValueError(f"{name} holds (type, slot, round) triples")

    @property
    def active(self) -> bool:
        """Whether any fault is injected."""
        return bool(self.drop_out or self.drop_in or self.python_only)

    @property
    def python_only(self) -> bool:
        """Whether a fault is injected that only the Python phase loop draws (the C loop
        draws the random drops itself)."""
        return bool(self.duplicate or self.reorder or self.drop_out_once or self.drop_in_once)

    def thresholds(self) -> tuple:
        """The random drops' probabilities in units of 2^-32, as the C phase loop takes them."""
        return int(self.drop_out * 2 ** 32), int(self.drop_in * 2 ** 32)


@dataclass
class TransportStats:
    counters: dict = field(default_factory=lambda: dict.fromkeys((
        "packets_sent", "packets_received", "bytes_sent", "bytes_received", "retransmissions",
        "timeouts", "fast_losses", "notices", "lost_chunks", "straggler_notices", "stashed_results",
        "resynced_chunks",
        "injected_drops_out", "injected_drops_in", "injected_duplicates", "injected_reorders",
        "bad_packets"), 0))

    def add(self, key: str, n: int = 1) -> None:
        self.counters[key] += n


def local_ip_towards(host: str, port: int) -> str:
    """The local address the kernel routes to `host` from (so the PS sees this source)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, port))
        return probe.getsockname()[0]
    finally:
        probe.close()


class Datagrams:
    """One worker's UDP sockets with fault injection and batched I/O.

    `toward` is the first shard's data address: the socket binds to the local address the
    kernel routes there from (port `bind_port`, 0: any).  `batched` False (or no _batchio)
    is the one-call-per-datagram loop.  Packets and bytes are counted in `stats`, as are
    injected faults and packets that do not parse."""

    def __init__(self, worker_id: int, toward: tuple, *, bind_port: int = 0, batched: bool = True,
                 faults: Faults | None = None, stats: TransportStats | None = None):
        self.faults = faults or Faults()
        self.stats = stats if stats is not None else TransportStats()
        self._frng = np.random.default_rng(np.random.SeedSequence([self.faults.seed, worker_id, 7]))
        # the C phase loop's drop stream: a SplitMix64 state of (seed, rank), as a signed int64
        state = int(np.random.SeedSequence([self.faults.seed, worker_id, 8]).generate_state(1, np.uint64)[0])
        self.drop_state = state - (1 << 64) if state >= 1 << 63 else state
        self._once_out, self._once_in = set(self.faults.drop_out_once), set(self.faults.drop_in_once)
        self._held: list = []
        self.batched = batched and _batchio is not None
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        set_buffer(self.sock, 8 << 20)
        self.sock.bind((local_ip_towards(*toward), bind_port))
        self.sock.setblocking(False)
        self.offload = self.batched and udpio.offload_enabled()
        # GRO batches are split by recv_many / phase_run; the per-datagram path reads plainly
        udpio.set_gro(self.sock, self.offload)
        self.gso = int(self.offload)        # the C phase sends UDP GSO messages (it may turn them off)
        self.gsock = None
        self.rx_size = 2048

    @property
    def address(self) -> tuple:
        """(ip, port) this worker sends from and receives its results at."""
        return self.sock.getsockname()

    def join_group(self, worker_id: int, job) -> None:
        """Receive on the socket of the job's result group (JobConfig.result_group) too, if
        it has one.  The PS multicasts each result to the group once; a result it resends to
        this worker alone arrives on `sock`."""
        self.rx_size = max(job.mtu, 2048)
        group = parse_group(job.result_group)
        if group is None:
            return
        iface = self.sock.getsockname()[0]
        try:
            sock = group_socket(group, iface, 8 << 20)
        except OSError as exc:
            raise RuntimeError(f"worker {worker_id}: cannot join the job's result group "
                               f"{job.result_group} on {iface}: {exc}") from exc
        udpio.set_gro(sock, self.offload)
        self.gsock = sock

    def sockets(self) -> list:
        """Where results arrive: the worker's own socket, and the result group's."""
        return [self.sock] if self.gsock is None else [self.sock, self.gsock]

    def emit(self, out: list) -> None:
        """Send [(packet, dest)] in order after fault injection; reordered packets go out
        after the rest of the batch (or of the next one)."""
        f, rng = self.faults, self._frng
        wire = []
        for pkt, dest in out:
            self.stats.add("packets_sent")
            self.stats.add("bytes_sent", len(pkt))
            if (f.drop_out and rng.random() < f.drop_out) or self._dropped_once(self._once_out, pkt):
                self.stats.add("injected_drops_out")
                continue
            copies = 2 if f.duplicate and rng.random() < f.duplicate else 1
            if copies == 2:
                self.stats.add("injected_duplicates")
            if f.reorder and rng.random() < f.reorder:
                self.stats.add("injected_reorders")
                self._held.extend([(pkt, dest)] * copies)
                continue
            wire.extend([(pkt, dest)] * copies)
        if wire:
            wire.extend(self._held)
            self._held = []
            self.write(wire)

    def flush_held(self) -> None:
        """Send the packets that fault injection held back to reorder them."""
        held, self._held = self._held, []
        self.write(held)

    def write(self, wire: list) -> None:
        """Datagrams [(packet, dest)] onto the socket: sendmmsg per run of one destination, or
        one sendto each.  A full socket buffer is waited out (bounded); ECONNREFUSED (ICMP
        from an earlier send: the PS is not there yet) and EPERM (a netfilter drop rule in a
        loss experiment) lose the datagram, which timeouts then handle."""
        if not self.batched:
            for pkt, dest in wire:
                self._sendto(pkt, dest)
            return
        fd = self.sock.fileno()
        i = 0
        while i < len(wire):
            dest = wire[i][1]
            j = i
            while j < len(wire) and wire[j][1] == dest:
                j += 1
            group = [pkt for pkt, _ in wire[i:j]]
            for _ in range(1000):
                sent, _refused = _batchio.send_many(fd, group, dest[0], dest[1])
                group = group[sent:]
                if not group:
                    break
                select.select([], [self.sock], [], 0.01)
            i = j

    def _sendto(self, pkt: bytes, dest) -> None:
        for _ in range(1000):
            try:
                self.sock.sendto(pkt, dest)
                return
            except BlockingIOError:
                select.select([], [self.sock], [], 0.01)
            except (ConnectionRefusedError, PermissionError):
                return

    def recv_many(self, timeout: float, limit: int = 256) -> list:
        """Every datagram waiting (up to `limit`) once one arrives within `timeout`, as
        [(source address, header, payload)]; injected drops and packets that do not parse
        are counted and left out."""
        ready, _, _ = select.select(self.sockets(), [], [], max(0.0, timeout))
        raw: list = []
        for sock in ready:
            if self.batched:
                raw += _batchio.recv_many(sock.fileno(), limit, self.rx_size)
                continue
            try:
                while len(raw) < limit:
                    raw.append(sock.recvfrom(65536))
            except (BlockingIOError, ConnectionRefusedError):
                pass
        return [g for g in map(self._parse, raw) if g is not None]

    def _parse(self, item):
        data, src = item
        self.stats.add("packets_received")
        self.stats.add("bytes_received", len(data))
        if (self.faults.drop_in and self._frng.random() < self.faults.drop_in) \
                or self._dropped_once(self._once_in, data):
            self.stats.add("injected_drops_in")
            return None
        try:
            h, payload = H.parse(data)
        except H.PacketError:
            self.stats.add("bad_packets")
            return None
        return src, h, bytes(payload)

    @staticmethod
    def _dropped_once(once: set, datagram) -> bool:
        """Whether `datagram` is one of the (type, slot, round) packets still to drop once
        (it is taken off the set)."""
        if not once or len(datagram) < H.HEADER_SIZE:
            return False
        key = (datagram[3], int.from_bytes(datagram[10:12], "big"), int.from_bytes(datagram[12:16], "big"))
        if key not in once:
            return False
        once.discard(key)
        return True

    def close(self) -> None:
        self.sock.close()
        if self.gsock is not None:
            self.gsock.close()
