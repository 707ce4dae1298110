"""Worker side of the data plane: chunks out through a window of slots, results back.

A *phase* sends a list of chunks (DATA or NORM) and returns one result per
chunk.  Chunk c of a phase uses slot base + (c mod slots); every use of a slot
increments that slot's round, identically in every worker (they all issue the
same sequence of phases), so round numbers never need agreeing on.

Loss handling (THC §6.1 and SwitchML, docs/prior-art.md §2.1):
  retransmit  resend after a timeout with exponential backoff; the PS answers a
              resend of a completed chunk with its kept result; nothing is lost
              (default).  After `max_retries` the worker names the cause (missing
              ranks, or a PS whose data plane is silent); a PS silent to heartbeats
              too is waited for up to `ps_wait_s` (it may be restarting or stalled).
  zero        no resend: a chunk whose result missed its timeout is reported
              lost (None) and the caller treats it as a zero update (§6.1).
Results that arrive for a later round of a slot are stashed, so a late worker
catches up without resending (resynchronization); a STRAGGLER notification
for a pending chunk marks it lost.

I/O is batched (worker/_batchio.c): the packets that enter the window in one pass
leave with one sendmmsg, and one recvmmsg takes everything queued; a batch can hold
results of later rounds or of the next phase, which are kept for their phase.

Fault injection for experiments: seeded drops of outgoing/incoming packets,
duplicates and reordering of outgoing packets.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import sys
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import zmq

from proto import blob as B
from proto import control
from proto import headers as H
from proto import udpio
from proto.job import JobConfig, parse_group
from proto.keys import HandshakeWatch
from proto.sockets import group_socket, set_buffer
from worker.policies import POLICIES

try:
    from worker import _batchio      # sendmmsg/recvmmsg, built by `pip install`
except ImportError:                  # pragma: no cover - the per-datagram loop serves without it
    _batchio = None

#: How long a worker waits for a PS that answers nothing (no heartbeat reply, no result)
#: before it gives up: a restarted PS, or one that stalled (a VM pause, swap, a long GC),
#: comes back within it and the job goes on (`--ps-wait-s`; docs/protocol.md §7).
DEFAULT_PS_WAIT_S = 60.0
#: A chunk resent this often (about 5 s with the default 50 ms doubling to 1 s) is worth a
#: warning that says what the job waits for; fewer resends are routine on a busy machine.
STALL_NOTE_TRIES = 8
log = logging.getLogger(__name__)


def _late(t) -> str:
    """Whom a worker whose results are late waits for: missing ranks, live ranks behind it,
    or the PS (a rank that died is reported missing once its lease runs out)."""
    return t.waiting_for() or control.describe_behind(t.status[0], t.worker_id, t.progress) or \
        "the PS (no rank is reported missing or behind; a rank that died is, once its lease runs out)"


class PSUnavailable(RuntimeError):
    """The PS did not answer within the retry budget."""


class Queued(ValueError):
    """The PS queued this rank's job: its slot space is full (the message says what holds it)."""


def _common_job(jobs: list):
    """The job every shard announced; each shard admits it on its own, so a contended shard
    may have granted other slots or another job id, which a worker cannot run with."""
    for i, j in enumerate(jobs[1:], 1):
        if j != jobs[0]:
            what = [f"{k} {getattr(jobs[0], k)!r} / {getattr(j, k)!r}" for k in j.__dataclass_fields__
                    if getattr(j, k) != getattr(jobs[0], k)]
            raise ValueError(f"the PS shards disagree on the job (shard 0 / shard {i}: {'; '.join(what)}); "
                             f"a job spanning shards needs the same free slots and job id on each")
    return jobs[0]


class JobStalled(RuntimeError):
    """The PS is alive but the job cannot go on: the message names the ranks it waits for."""


class LeaseLost(RuntimeError):
    """This rank's lease ran out while it was silent (paused, descheduled, partitioned): the
    PS counts it as missing and the job went on, or waits for it.  The caller rejoins
    (`Transport.rejoin`) and fast-forwards to the other ranks' step, as a restarted rank does."""


class JobEnded(RuntimeError):
    """The job this rank belonged to ended while it was away (its lease had expired)."""


class _PSRestarted(Exception):
    """Internal: a shard no longer knows this worker's session (it restarted)."""

    def __init__(self, shard: int):
        super().__init__(shard)
        self.shard = shard


@dataclass
class Faults:
    """Injected faults, each a probability per packet, from a seeded RNG."""

    drop_out: float = 0.0
    drop_in: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    seed: int = 0

    def __post_init__(self):
        for name in ("drop_out", "drop_in", "duplicate", "reorder"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                raise ValueError(f"{name} must be a probability in [0, 1), got {v}")


@dataclass
class TransportStats:
    counters: dict = field(default_factory=lambda: dict.fromkeys((
        "packets_sent", "packets_received", "bytes_sent", "bytes_received", "retransmissions",
        "timeouts", "lost_chunks", "straggler_notices", "stashed_results", "resynced_chunks",
        "injected_drops_out", "injected_drops_in", "injected_duplicates", "injected_reorders",
        "bad_packets"), 0))

    def add(self, key: str, n: int = 1) -> None:
        self.counters[key] += n


#: Counters of one C phase call, in _batchio.phase_run's order; the first nine are
#: TransportStats counters, the rest socket batching (Transport.io).
PHASE_COUNTERS = ("packets_sent", "packets_received", "bytes_sent", "bytes_received", "retransmissions",
                  "timeouts", "lost_chunks", "straggler_notices", "bad_packets", "gso_messages",
                  "gro_batches")
#: Busy-poll before the C phase loop sleeps in poll(): microseconds ($THC_BUSY_POLL_US, 0 = off).
SPIN_US = int(os.environ.get("THC_BUSY_POLL_US", "0") or 0)
#: The C phase loop returns to Python this often (restarted PS, read-ahead results, warnings).
PHASE_BUDGET_MS = 100.0
_SETTLED = 4                 # phase_run chunk state: settled by Python (a stashed result)
_RESULT = 2


@dataclass
class _Pending:
    """A packet (or a BLOB round's fragments) in flight: what to resend, and when."""

    chunk: int
    packet: bytes
    deadline: float
    timeout: float
    tries: int = 0
    datagrams: int = 1          # datagrams one resend puts on the wire
    sent: float = 0.0           # the first send


def rto_scale(per_chunk: np.ndarray) -> float:
    """The timeout per chunk in flight, from samples of round trip / chunks in flight
    (seconds): three times their lower quartile (RetransmitTimer says why not a mean, nor
    a median)."""
    return 3 * float(np.quantile(per_chunk, 0.25))


class RetransmitTimer:
    """The retransmission timeout of each shard, adapted to the path, once per phase.

    A chunk's round trip through an aggregator is queueing and service there plus the wait
    for the other ranks' packets of its slot.  A fixed timeout fits one path only: on a
    software PS over loopback a result takes a few ms, through bmv2 (about a thousand THC
    packets/s, so a window of 64 chunks from each of 4 workers queues for 250 ms) or behind
    a slow link it takes hundreds of ms, and a fixed 50 or 200 ms timer resends a fifth of
    the packets (docs/bench.md, "Retransmission timer").  The time is mostly queueing, so it
    grows with the chunks in flight, and the window (`Transport._adapt_window`) changes
    that number from phase to phase.  So the timer measures the path's time per chunk in
    flight: every answered chunk of a phase gives q = round trip / chunks in flight when it
    was sent (round trip from its first send), and at the end of a phase with MIN_SAMPLES
    answers or more from a shard, that shard's scale becomes `rto_scale` of them: three
    times their lower quartile.  A chunk sent with k chunks in flight then waits
    clamp(scale · k, floor, cap) before its first resend: the timeout follows the window as
    the queue does.

    The lower quartile of a whole phase, because some answers wait for a loss to be
    recovered, the chunk's own or another rank's, and those waits last one timeout: at 5%
    loss a chunk of 4 ranks waits with probability 1 − 0.95^5 ≈ 23%, of 8 ranks 37%, at 10%
    loss 61%.  An estimate that sees them ratchets the timeout up phase after phase, each
    timeout lengthening the waits it measures: TCP's mean did at once, and so did
    median + 4·MAD once they neared half of the answers (8 ranks at 10% loss on loopback:
    rounds 27.8 s against 4.4 s with the fixed timer, the timeout at its 1 s cap).  The lower
    quartile ignores them up to three quarters of the answers; on a path whose round trip
    is queueing, the answers' q are close together, and three times the quartile clears
    them.  A whole phase, because the chunks answered last in a phase are mostly those that
    waited.  Timing from the first send, not only chunks never resent (Karn's rule, which
    TCP needs because its mean is not robust), keeps a path slower than the timeout
    measurable: there every chunk is resent before its answer comes, and the answer still
    tells how long the path took.  Phases with fewer answers
    (a NORM phase's one or two chunks, mostly the wait for the slowest rank) are not used.
    `floor` is the configured first timeout (`--timeout-ms`): on a path faster than it,
    loss recovery is as before.

    `T` = [floor, cap, adaptive, then each shard's scale (0: not measured yet, the floor
    applies)] is what the C phase (_batchio.phase_run) reads; adaptive 0 keeps the fixed
    rule (every chunk starts at `floor`), for comparison.
    """

    MIN_SAMPLES = 8

    def __init__(self, floor_s: float, cap_s: float, shards: int, adaptive: bool = True):
        self.T = np.zeros(3 + shards)
        self.T[:3] = floor_s, cap_s, float(adaptive)

    @property
    def adaptive(self) -> bool:
        return bool(self.T[2])

    def first_timeout(self, shard: int, in_flight: int) -> float:
        """The first timeout of a chunk sent to `shard` with `in_flight` chunks in flight."""
        floor, cap, adaptive = self.T[:3]
        return float(min(max(self.T[3 + shard] * in_flight, floor), cap)) if adaptive else float(floor)

    def phase_done(self, shard: np.ndarray, sent: np.ndarray, done: np.ndarray, inflight: np.ndarray) -> None:
        """A phase ended: chunk c went to shard[c], was first sent at sent[c] with inflight[c]
        chunks in flight (itself included), and answered at done[c] (0: not answered)."""
        if not self.adaptive:
            return
        ok = done > 0
        for s in np.unique(shard[ok]).tolist():
            mine = ok & (shard == s)
            if np.count_nonzero(mine) >= self.MIN_SAMPLES:
                self.T[3 + s] = rto_scale((done[mine] - sent[mine]) / inflight[mine])


class _RetransmitPolicy:
    """The one timeout / backoff / give-up rule of phases and BLOB rounds (`retransmit`:
    resend with the timeout doubled up to max_timeout, give up after max_retries naming the
    cause; `zero`: the first timeout loses the chunk).  _batchio.phase_run implements the
    same rule in C."""

    def __init__(self, transport: Transport):
        self.t = transport

    def start(self, chunk: int, packet, now: float, datagrams: int = 1, shard: int | None = None,
              in_flight: int = 1) -> _Pending:
        """A packet enters flight with `in_flight` chunks in flight (itself included): its
        first timeout is RetransmitTimer's for the shard (`shard` None: the fixed first
        timeout, for BLOB rounds, whose round trip includes decoding)."""
        tmo = self.t.timeout if shard is None else self.t.rtt.first_timeout(shard, in_flight)
        return _Pending(chunk, packet, now + tmo, tmo, 0, datagrams, now)

    def expired(self, p: _Pending, now: float, what: str, dest) -> bool:
        """p's deadline passed: True = resend it (backoff applied, counted); False = it is
        lost (zero policy).  Raises JobStalled / PSUnavailable after max_retries."""
        t = self.t
        t.stats.add("timeouts")
        if t.policy == "zero":
            return False
        if p.tries >= t.max_retries:
            t._give_up(what, dest, p.tries)
        if now - t._last_note > 5.0 and p.tries >= STALL_NOTE_TRIES:
            t._last_note = now
            log.warning("worker %d: %s unanswered after %d retransmissions; waiting for %s",
                        t.worker_id, what, p.tries, _late(t))
        t.stats.add("retransmissions", p.datagrams)
        p.tries += 1
        p.timeout = min(p.timeout * 2, t.max_timeout)
        p.deadline = now + p.timeout
        return True


class PackedChunks(Sequence):
    """A phase's chunks as one buffer: chunk c is (offset, count, payload) with `per` elements
    of `bits` bits each (the last may be shorter), cut without copying.  The C phase sends
    straight from the buffer; the Python phase reads chunks as (offset, count, bytes)."""

    def __init__(self, payload, total: int, bits: int, per: int):
        self.buffer = np.frombuffer(payload, dtype=np.uint8) if not isinstance(payload, np.ndarray) \
            else payload.view(np.uint8).ravel()
        n = -(-total // per) if total else 0
        self.offsets = np.arange(n, dtype=np.int64) * per
        self.counts = np.minimum(per, total - self.offsets)
        ends = self.offsets * bits // 8 + (self.counts * bits + 7) // 8
        self.poff = np.concatenate([[0], ends]).astype(np.int64)
        self.poff[:-1] = self.offsets * bits // 8
        self.offsets32, self.counts32 = self.offsets.astype(np.uint32), self.counts.astype(np.int32)
        self.total, self.bits = total, bits

    @classmethod
    def from_list(cls, chunks: list) -> PackedChunks:
        """Arbitrary [(offset, count, payload)] (a NORM phase) in the same form."""
        self = cls.__new__(cls)
        self.buffer = np.frombuffer(b"".join(bytes(p) for _, _, p in chunks) or b"\0", dtype=np.uint8)
        self.offsets = np.array([o for o, _, _ in chunks], dtype=np.int64)
        self.counts = np.array([k for _, k, _ in chunks], dtype=np.int64)
        self.poff = np.concatenate([[0], np.cumsum([len(p) for _, _, p in chunks])]).astype(np.int64)
        self.offsets32, self.counts32 = self.offsets.astype(np.uint32), self.counts.astype(np.int32)
        self.total, self.bits = int(self.counts.sum()), 0
        return self

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, c):
        if isinstance(c, slice):
            return [self[i] for i in range(*c.indices(len(self)))]
        return (int(self.offsets[c]), int(self.counts[c]),
                self.buffer[self.poff[c]:self.poff[c + 1]].tobytes())

    @property
    def wire_bytes(self) -> int:
        """Bytes the phase puts on the wire once (headers included)."""
        return int(self.poff[-1]) + H.HEADER_SIZE * len(self)


class PhaseResults(Sequence):
    """A C phase's results: chunk c's result is (Header, payload) or None when lost, and the
    payloads lie back to back in `lanes` (chunk c at roff[c]) for whole-vector use."""

    def __init__(self, chunks: PackedChunks, down_bits: int):
        n = len(chunks)
        self.state = np.zeros(n, np.int8)
        self.headers = np.zeros(n * H.HEADER_SIZE, np.uint8)
        self.roff = np.concatenate([[0], np.cumsum((chunks.counts * down_bits + 7) // 8)]).astype(np.int64)
        self.lanes = np.empty(int(self.roff[-1]), np.uint8)
        self.lengths = np.zeros(n, np.int32)

    def settle(self, c: int, h: H.Header, payload: bytes) -> None:
        """Chunk c's result found before sending (a stashed read-ahead result)."""
        room = int(self.roff[c + 1] - self.roff[c])
        h = H.Header(**H.header_dict(h))
        self.headers[c * H.HEADER_SIZE:(c + 1) * H.HEADER_SIZE] = np.frombuffer(h.pack(), np.uint8)
        self.lanes[self.roff[c]:self.roff[c] + min(room, len(payload))] = \
            np.frombuffer(payload, np.uint8)[:room]
        self.lengths[c] = len(payload)
        self.state[c] = _SETTLED

    def ok(self) -> np.ndarray:
        return (self.state == _RESULT) | (self.state == _SETTLED)

    def _field(self, off: int, size: int) -> np.ndarray:
        rows = self.headers.reshape(-1, H.HEADER_SIZE)[:, off:off + size]
        return rows[:, 0] if size == 1 else rows.copy().view(f">u{size}").ravel()

    @property
    def contributors(self) -> np.ndarray:
        return np.where(self.ok(), self._field(28, 1), 0)

    @property
    def bitmaps(self) -> np.ndarray:
        return np.where(self.ok(), self._field(24, 4), 0)

    def payload(self, c: int) -> np.ndarray:
        room = int(self.roff[c + 1] - self.roff[c])
        return self.lanes[self.roff[c]:self.roff[c] + min(room, int(self.lengths[c]))]

    def digests(self) -> list:
        """crc32 of each chunk's result payload (0 for a lost chunk), for the exact checks."""
        starts = self.roff[:-1]
        ends = starts + np.minimum(np.diff(self.roff), self.lengths)
        lanes = memoryview(self.lanes)
        return [zlib.crc32(lanes[a:b]) if ok else 0
                for a, b, ok in zip(starts.tolist(), ends.tolist(), self.ok().tolist())]

    def __len__(self) -> int:
        return len(self.state)

    def __getitem__(self, c):
        if isinstance(c, slice):
            return [self[i] for i in range(*c.indices(len(self)))]
        if not self.ok()[c]:
            return None
        h, _ = H.parse(self.headers[c * H.HEADER_SIZE:(c + 1) * H.HEADER_SIZE].tobytes()
                       + bytes(int(self.lengths[c])))
        return h, self.payload(c).tobytes()



def local_ip_towards(host: str, port: int) -> str:
    """The local address the kernel routes to `host` from (so the PS sees this source)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, port))
        return probe.getsockname()[0]
    finally:
        probe.close()


DEFAULT_WINDOW = 512        # most chunks in flight per worker: the default job's 512 slots
START_WINDOW = 64           # the window a transport starts with ...
MIN_WINDOW = 16             # ... the least it shrinks to (see Transport._adapt_window) ...
WINDOW_STEP = 16            # ... and its additive increase past the last halving
SHARD_RUN = 64              # consecutive chunks a shard takes in turn: a GSO message's worth


class Transport:
    """Registration, control calls and data-plane phases for one worker."""

    def __init__(self, ps_host: str, data_port: int, worker_id: int, *, control_port: int | None = None,
                 policy: str = "retransmit", timeout_ms: float = 50.0, max_timeout_ms: float = 1000.0,
                 max_retries: int = 60, window: int = DEFAULT_WINDOW, faults: Faults | None = None,
                 control_timeout_s: float = 30.0, shards: list | None = None, bind_port: int = 0,
                 batched: bool = True, expect: dict | None = None, propose: JobConfig | None = None,
                 keys=None, heartbeat: bool = True, rejoin: bool = False, phase_engine: str | None = None,
                 job_name: str | None = None, queue_s: float = 600.0, adaptive_timeout: bool = True,
                 ps_wait_s: float = DEFAULT_PS_WAIT_S):
        """Connect to one PS, or to S shards given as [(host, data_port, control_port), ...].

        `job_name` names the job on the PS (None: the PS's "default"): workers of one name
        form one job, other names run beside it.  A job the PS queues (its slot space is
        full) waits up to `queue_s`, asking again twice a second.

        `expect` is the part of the job configuration this worker insists on (the PS refuses
        the registration naming every differing field); `propose` is a whole job for a PS
        started without one.  `keys` is a key directory (`thc keys`): the control plane
        then runs ZeroMQ CURVE.  A heartbeat thread renews this rank's lease, learns who the
        job is waiting for, and notices a restarted PS (the worker then registers again and
        resumes the interrupted phase with the other ranks).  A PS that answers nothing
        for `ps_wait_s` seconds is given up (PSUnavailable, saying how long it waited).

        `window` is the most chunks this worker keeps in flight, at most the job's slots ×
        shards (a switch job's 64 slots bound it there); the window in use starts at 64 and
        adapts per phase (`_adapt_window`): a small window leaves the cores idle between
        round trips, a large one overflows a slow link's queue (docs/bench-history.md, "Packet
        rate against the GSO/GRO blaster").
        `timeout_ms` is the first retransmission timeout and, with `adaptive_timeout`
        (the default, retransmit policy), the least one: each shard's timeout then follows
        the measured round trip (RetransmitTimer); without it every chunk starts at
        `timeout_ms`, and under the `zero` policy that is the deadline of a lost chunk.
        `batched` sends a window's packets with one sendmmsg and takes every waiting result
        with one recvmmsg (worker/_batchio.c); False is the one-call-per-datagram loop,
        kept for comparison (bench/bench_e2e.py) and for platforms without the extension.
        `phase_engine` 'c' (default, or $THC_PHASE_ENGINE) runs a whole phase — window,
        retransmit timers, results — in C with the GIL released (_batchio.phase_run);
        'python' is the Python loop, also used whenever faults are injected.  With
        $THC_UDP_OFFLOAD unset or 1 the socket receives with UDP GRO and the C phase sends
        runs of packets as UDP GSO messages (proto/udpio.py).

        The chunks of a DATA phase go to the shards in runs of SHARD_RUN (run k to shard
        k mod S: every shard busy from the start, a run one GSO message; shorter runs when a
        phase has fewer than SHARD_RUN chunks per shard); NORM phases and control calls
        (barriers, model sync) go to shard 0.  A shard may name a 4th element, the control
        host, when the control plane runs elsewhere (a switch aggregates, a host controls).
        """
        if policy not in POLICIES:
            raise ValueError(f"loss policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if window < 1:
            raise ValueError("window must be positive")
        self.worker_id = worker_id
        self.policy = policy
        self.timeout = timeout_ms / 1e3
        self.max_timeout = max_timeout_ms / 1e3
        self.max_retries = max_retries
        self.faults = faults or Faults()
        self._frng = np.random.default_rng(np.random.SeedSequence([self.faults.seed, worker_id, 7]))
        self._held: list = []
        self._blob_q: list = []
        self.batched = batched and _batchio is not None
        self.phase_engine = phase_engine or os.environ.get("THC_PHASE_ENGINE", "c")
        if self.phase_engine not in ("c", "python"):
            raise ValueError(f"phase_engine must be 'c' or 'python', got {self.phase_engine!r}")
        self.io = dict.fromkeys(PHASE_COUNTERS[9:], 0)      # socket batching, beside the stats
        self._last_note = time.monotonic()
        self.stats = TransportStats()
        shards = shards or [(ps_host, data_port, control_port or data_port + 1)]
        self.shard_addrs = [(sh[0], int(sh[1])) for sh in shards]
        self._by_addr = {a: i for i, a in enumerate(self.shard_addrs)}
        self.ps = self.shard_addrs[0]
        self.rtt = RetransmitTimer(self.timeout, self.max_timeout, len(shards),
                                   adaptive_timeout and policy == "retransmit")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        set_buffer(self.sock, 8 << 20)
        self.sock.bind((local_ip_towards(*self.shard_addrs[0]), bind_port))
        self.sock.setblocking(False)
        offload = self.batched and udpio.offload_enabled()
        # GRO batches are split by recv_many / phase_run; the per-datagram path reads plainly
        udpio.set_gro(self.sock, offload)
        self._gso = int(offload)
        self._ctx = zmq.Context.instance()
        self._ctl: dict = {}
        self._watch: dict = {}              # shard -> HandshakeWatch of its control socket
        self._endpoints = [f"tcp://{sh[3] if len(sh) > 3 else sh[0]}:{sh[2] or sh[1] + 1}" for sh in shards]
        self._control_timeout = control_timeout_s
        self._curve = None
        if keys is not None:
            from proto.keys import client_keys
            self._curve = client_keys(keys)
        self._expect = dict(expect or {})
        self.job_name = job_name
        self._queue_s = queue_s
        self._rejoin = rejoin           # a restarted rank: only a running job of ours will do
        self._propose = propose
        self.sessions: list = [None] * len(shards)      # per shard: register reply
        self.job = None
        self.progress = -1                  # the caller's step counter, reported in heartbeats
        self.status: list = [None] * len(shards)        # latest heartbeat reply per shard
        self._hb_ok = [time.monotonic()] * len(shards)
        self.ps_wait_s = ps_wait_s
        self._ps_heard = [time.monotonic()] * len(shards)   # the shard's latest reply of any kind
        self._ps_silent = [0.0] * len(shards)   # how long it had been silent at its latest unanswered heartbeat
        self._restarted: set = set()
        self._lease_lost: set = set()       # shards that answered lease_expired
        self._job_gone: str | None = None   # why the PS no longer knows our job (it ended)
        self._session_lock = threading.Lock()
        self._hb_stop = threading.Event()
        self._hb_thread = None
        jobs = [self._register(i) for i in range(len(shards))]
        self.job = _common_job(jobs)
        self.rejoined = any(s["rejoin"] for s in self.sessions)
        self._rx_size = max(self.job.mtu, 2048)
        self.gsock = self._group_socket(offload)
        self.window = min(window, self.job.slots * len(shards))
        self.cwnd = min(START_WINDOW, self.window)
        self.ssthresh = self.window
        self.slot_round = np.zeros((len(shards), self.job.slots + self.job.norm_slots), dtype=np.int64)
        self._stash: dict = {}
        self._phase_no = 0
        self._last_phase = None             # (kind, chunks, phase index) of the last completed phase
        self.blob_round = 0
        self.resumes = 0
        self._skip_until = 0
        if heartbeat:
            self._hb_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                               name=f"thc-heartbeat-{worker_id}")
            self._hb_thread.start()

    def _group_socket(self, offload: bool):
        """The socket of the job's result group (JobConfig.result_group), or None when the
        job has none.  The PS multicasts each result to the group once; a result it resends
        to this worker alone arrives on self.sock."""
        group = parse_group(self.job.result_group)
        if group is None:
            return None
        iface = self.sock.getsockname()[0]
        try:
            sock = group_socket(group, iface, 8 << 20)
        except OSError as exc:
            self.close()
            raise RuntimeError(f"worker {self.worker_id}: cannot join the job's result group "
                               f"{self.job.result_group} on {iface}: {exc}") from exc
        udpio.set_gro(sock, offload)
        return sock

    def _sockets(self) -> list:
        """Where results arrive: the worker's own socket, and the result group's."""
        return [self.sock] if self.gsock is None else [self.sock, self.gsock]

    # ---------------------------------------------------------------- membership
    def _register(self, shard: int, rejoin: bool = False) -> JobConfig:
        """Register (again) with one shard; keeps its nonce, token and session.  `rejoin`:
        as a rank whose lease expired, into the running job it held a place in."""
        msg = {"type": "register", "worker_id": self.worker_id, "data_addr": list(self.sock.getsockname())}
        if self.job_name is not None:
            msg["job_name"] = self.job_name
        if self._expect:
            msg["expect"] = self._expect
        if self._propose is not None:
            msg["job"] = self._propose.to_msg()
        if (self._rejoin and self.job is None) or rejoin:
            msg["rejoin"] = True
        if self.sessions[shard] is not None:        # lets a PS that still knows us replace it
            msg["session"] = self.sessions[shard]["session"]
        deadline = time.monotonic() + self._control_timeout
        queued_until, said = time.monotonic() + self._queue_s, None
        while True:
            try:
                reply = self.call(msg, shard=shard)
                break
            except Queued as exc:
                if time.monotonic() > queued_until:
                    raise Queued(f"still queued after {self._queue_s:g} s: {exc}") from None
                if str(exc) != said:
                    said = str(exc)
                    log.warning("rank %d: %s", self.worker_id, said)
                time.sleep(0.5)
            except ValueError as exc:
                # a restarted rank: its previous incarnation's lease has not run out yet
                if "held by a live worker" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.25)
        job = JobConfig.from_msg(reply["job"])
        if self.job is not None:
            self._same_job(shard, job)
        with self._session_lock:        # a heartbeat answered for the old session is stale now
            self.sessions[shard] = reply
            self._restarted.discard(shard)
            self._lease_lost.discard(shard)
            self._ps_heard[shard], self._ps_silent[shard] = time.monotonic(), 0.0
        self._hb_ok[shard] = time.monotonic()
        if self.job is not None and job != self.job:
            self._adopt(job)
        return job

    def _same_job(self, shard: int, job: JobConfig) -> None:
        """Registered again (a restarted PS, a lapsed lease): the PS found this rank's job by
        its name and configuration, but the ids and regions it hands out follow the order in
        which jobs register again, so only ADMISSION_FIELDS (job id, data slots) may differ
        from the job this rank ran; any other difference is another job, refused naming it."""
        diffs = job.differences(self.job.to_msg())
        if diffs:
            raise ValueError(f"the PS at {self._endpoints[shard]} now runs another job configuration "
                             f"for job {self.job_name or 'default'!r}: {'; '.join(diffs)}")

    def _adopt(self, job: JobConfig) -> None:
        """Go on with the same job under the job id and data slots the PS gives it now.  Every
        packet header (the Python and the C phase alike) takes the id from self.job when it is
        built, and a received packet is checked against it; the slot rounds are sized to the
        new region (the caller restarts them: `_resume`) and the window fits in it."""
        if job.slots != self.job.slots:
            self.slot_round = np.zeros((len(self.shard_addrs), job.slots + job.norm_slots), dtype=np.int64)
            self.window = min(self.window, job.slots * len(self.shard_addrs))
            self.cwnd, self.ssthresh = min(self.cwnd, self.window), min(self.ssthresh, self.window)
        log.warning("worker %d: job %r is job id %d on the PS now (was %d)", self.worker_id,
                    self.job_name or "default", job.job_id, self.job.job_id)
        self.job = job

    def _heartbeat_loop(self) -> None:
        """Renew the lease of every shard a few times per lease; keep the status replies."""
        socks: dict = {}
        while not self._hb_stop.wait(max(0.05, min(s["lease_s"] for s in self.sessions) / 5)):
            for shard, sess in enumerate(self.sessions):
                msg = {"type": "heartbeat", "worker_id": self.worker_id, "session": sess["session"]}
                if self.progress >= 0:
                    msg["progress"] = int(self.progress)
                sock = socks.get(shard)
                if sock is None:
                    sock = socks[shard] = self._socket(shard)
                sent = time.monotonic()
                try:
                    sock.send(control.encode(msg))
                    if not sock.poll(int(1000 * sess["lease_s"])):
                        sock.close(0)
                        del socks[shard]
                        self._unanswered(shard, sent, sess["lease_s"])
                        continue
                    reply = control.decode(sock.recv())
                except zmq.ZMQError:
                    sock.close(0)
                    socks.pop(shard, None)
                    self._unanswered(shard, sent, sess["lease_s"])
                    continue
                self._ps_heard[shard], self._ps_silent[shard] = time.monotonic(), 0.0
                if reply.get("type") == "error":
                    with self._session_lock:
                        if self.sessions[shard] is sess:
                            self._membership_error(shard, sess, reply)
                    continue
                self.status[shard] = reply
                self._hb_ok[shard] = time.monotonic()
        for sock in socks.values():
            sock.close(0)

    def _unanswered(self, shard: int, sent: float, lease_s: float) -> None:
        """A heartbeat sent at `sent` got no reply: the PS has been silent since its latest
        reply.  A wait that lasted far past its timeout means this process was stopped, not
        that the PS was silent: it is not counted (the next heartbeat asks again)."""
        now = time.monotonic()
        if now - sent < 2 * lease_s + 1.0:
            self._ps_silent[shard] = now - self._ps_heard[shard]

    def _watching(self) -> bool:
        """Whether heartbeats run, so that `_ps_silent` says how long the PS has been silent."""
        return self._hb_thread is not None and not self._hb_stop.is_set()

    def _check_ps_silence(self, during: str = "") -> None:
        """Give up on a PS that has answered nothing for `ps_wait_s` (heartbeats unanswered:
        it died, stalled or is cut off, and no restart came back within the wait)."""
        silent = max(self._ps_silent)
        if not self._watching() or silent <= self.ps_wait_s:
            return
        shard = self._ps_silent.index(silent)
        raise PSUnavailable(f"the PS at {self._endpoints[shard]} answered nothing for {silent:.0f} s "
                            f"(no heartbeat reply{', ' + during if during else ''}); a worker waits "
                            f"ps_wait_s = {self.ps_wait_s:g} s for a restarted or stalled PS to come "
                            f"back (--ps-wait-s)")

    def _membership_error(self, shard: int, sess: dict, reply: dict) -> None:
        """A heartbeat refused: note what happened to this rank's membership (the data-plane
        and control waits act on it: `_check_membership`)."""
        code = reply.get("code")
        if code == "lease_expired":
            self._lease_lost.add(shard)
        elif code == "unknown_session":
            if reply.get("incarnation") != sess.get("incarnation"):
                self._restarted.add(shard)          # a new PS process: resume
            else:
                self._job_gone = (f"job {sess.get('job_number')} ended while rank "
                                  f"{self.worker_id} was away: {reply.get('message')}")

    def _check_membership(self) -> None:
        """Raise what the last heartbeats found: the job ended, this rank's lease expired,
        the PS restarted (internal: resumed), or the job can no longer complete."""
        if self._job_gone:
            raise JobEnded(self._job_gone)
        if self._lease_lost:
            raise LeaseLost(f"rank {self.worker_id} lost its lease (it was silent for longer than "
                            f"{self.sessions[0]['lease_s']:g} s)")
        if self._restarted:
            raise _PSRestarted(min(self._restarted))
        self._check_ps_silence()
        stalled = (self.status[0] or {}).get("stalled")
        if stalled:
            raise JobStalled(f"the job cannot complete: {stalled}")

    def rejoin(self) -> None:
        """After `LeaseLost`: register again as a rejoining rank (new token and session) and
        start the data plane afresh, as a restarted rank would; the caller then fast-forwards
        the slot rounds to the other ranks' step (`Worker.skip_rounds`).  Raises JobEnded
        when the job ended meanwhile."""
        for shard in range(len(self.sessions)):
            try:
                self._register(shard, rejoin=True)
            except ValueError as exc:
                if "no running job to rejoin" in str(exc):
                    raise JobEnded(f"rank {self.worker_id}'s job ended while it was away") from None
                raise
        self._lease_lost.clear()
        self.status = [None] * len(self.sessions)
        self.slot_round[:] = 0
        self._stash.clear()
        self._blob_q = []
        self._phase_no, self._last_phase, self.blob_round, self._skip_until = 0, None, 0, 0
        self.rejoined = True

    def waiting_for(self) -> str:
        """What the job waits for, from the latest heartbeat: '' if nothing is known missing."""
        st = self.status[0]
        silent = time.monotonic() - self._hb_ok[0]
        if self.sessions[0] and silent > 2 * self.sessions[0]["lease_s"]:
            return f"the PS control plane at {self._endpoints[0]} (no heartbeat reply for {silent:.0f} s)"
        if st and st.get("missing"):
            return control.describe_missing(st["missing"])
        return ""

    def is_sync_source(self) -> bool:
        """Whether this rank publishes model-sync state (the lowest live rank)."""
        return self.call({"type": "status"}).get("sync_source") == self.worker_id

    def _resume(self, shard: int) -> None:
        """After a PS restart: register again and agree with every rank where to go on.

        retransmit: from the least phase any rank reached — slot rounds reset there, a rank
        that had finished that phase replays it (from the packets it kept), and the
        interrupted phase runs again; nothing is lost.  zero: from the greatest phase —
        ranks behind report the phases in between as lost."""
        if len(self.sessions) > 1:
            raise PSUnavailable(f"PS shard {shard} restarted; resuming is supported with one shard only")
        if self.job.blob:
            raise PSUnavailable(f"the PS restarted during a {self.job.codec} job; resuming is supported "
                                f"for the data-plane codecs (thc, none)")
        self._restarted.discard(shard)
        self.resumes += 1
        log.warning("worker %d: the PS restarted; registering again and resuming at phase %d",
                    self.worker_id, self._phase_no)
        self._register(shard)
        reply = self.call({"type": "resume", "phase": int(self._phase_no)}, shard=shard, wait=True)
        phase = reply["phase"]
        self.slot_round[shard, :] = 0
        self._stash.clear()
        self._blob_q = []
        if self.policy == "zero":
            # no replay: ranks behind count the phases up to the greatest as lost
            self._skip_until = reply["max_phase"]
            return
        if phase < self._phase_no:
            if self._last_phase is None or self._last_phase[2] != phase:
                raise PSUnavailable(f"the PS restarted and the ranks are more than one phase apart "
                                    f"(this rank at {self._phase_no}, another at {phase})")
            kind, chunks, index = self._last_phase
            self._run_phase_once(kind, chunks, index)       # results already known: discarded

    # ---------------------------------------------------------------- control plane
    def _socket(self, shard: int, watch: bool = False):
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = self._curve
        if watch:       # a handshake the PS refuses (keys that do not fit) is said at once
            self._watch[shard] = HandshakeWatch(sock, server=False, curve=self._curve is not None)
        sock.connect(self._endpoints[shard])
        return sock

    def call(self, msg: dict, shard: int = 0, wait: bool = False) -> dict:
        """One control request; raises PSUnavailable on timeout, ValueError on an error reply.

        Requests made for this rank get its worker_id and session filled in.  With `wait`
        (barriers, model sync, resume) the reply may take as long as the other ranks need:
        the call fails only when the PS stops answering heartbeats or the job waits for a
        rank that is not there (JobStalled, naming it)."""
        msg = dict(msg)
        fields = control.SCHEMA.get(msg["type"], {})
        if "session" in fields and self.sessions[shard] is not None:
            msg.setdefault("worker_id", self.worker_id)
            msg["session"] = self.sessions[shard]["session"]
        sock = self._ctl.get(shard)
        if sock is None:
            sock = self._ctl[shard] = self._socket(shard, watch=True)
        sock.send(control.encode(msg))
        try:
            reply = self._await_reply(sock, msg, shard, wait)
        except BaseException:           # interrupted mid-request (a signal, an error): a REQ
            self._drop_socket(shard)    # socket waiting for its reply cannot send again
            raise
        if reply.get("type") == "error":
            code = reply.get("code")
            if code == "lease_expired":
                self._lease_lost.add(shard)
                self._check_membership()
            if code == "unknown_session" and self.sessions[shard] is not None:
                self._membership_error(shard, self.sessions[shard], reply)
                if self._job_gone:
                    raise JobEnded(self._job_gone)
                if shard in self._restarted and msg["type"] == "barrier":
                    raise _PSRestarted(shard)
            if code == "job_stalled":
                raise JobStalled(f"PS refused {msg['type']}: {reply.get('message')}")
            if code == "queued":
                raise Queued(reply.get("message"))
            raise ValueError(f"PS refused {msg['type']}: {reply.get('message')}")
        return reply

    def _await_reply(self, sock, msg: dict, shard: int, wait: bool) -> dict:
        """The reply to the request just sent on `sock` (see `call` for the bounds); `call`
        drops the socket when this raises."""
        start = time.monotonic()
        while not sock.poll(int(min(1.0, self._control_timeout) * 1000)):
            waited = time.monotonic() - start
            watching = self._watching()
            if watching:                # a PS silent to heartbeats too is waited for up to ps_wait_s
                self._check_ps_silence(f"{msg['type']} unanswered for {waited:.0f} s")
                if wait and self._restarted and msg["type"] == "barrier":
                    raise _PSRestarted(min(self._restarted))       # Transport.barrier resumes
                if wait and self._restarted:    # the request went to the PS process that died
                    raise PSUnavailable(f"the PS at {self._endpoints[shard]} restarted during "
                                        f"{msg['type']} {msg.get('name', '')}; a job resumes an "
                                        f"interrupted data-plane phase only".replace("  ", " "))
            if not wait or not watching:
                if shard in self._watch:        # keys that do not fit: said at once, not after the timeout
                    self._watch[shard].check(self._endpoints[shard])
                if waited < self._control_timeout or (watching and self._ps_silent[shard] > 0):
                    continue
                raise PSUnavailable(f"no reply from the PS control plane at {self._endpoints[shard]} "
                                    f"within {self._control_timeout:.0f} s ({msg['type']}): is a PS running "
                                    f"there, its control port reachable? (keys that do not fit are "
                                    f"reported at once)")
            if self._lease_lost or self._job_gone or (self.status[shard] or {}).get("stalled"):
                self._check_membership()
            missing = (self.status[shard] or {}).get("missing") or []
            never = [m for m in missing if m["why"] == "never registered"]
            if never and waited > self._control_timeout:
                raise JobStalled(f"{msg['type']} {msg.get('name', '')} not done after {waited:.0f} s: "
                                 f"waiting for {control.describe_missing(never)}".replace("  ", " "))
        return control.decode(sock.recv())

    def barrier(self, name: str) -> None:
        """Wait until every live rank of the job reached `name`; if the PS restarts meanwhile,
        resume with the other ranks (`_resume`) and wait again at the new PS."""
        while True:
            try:
                self.call({"type": "barrier", "name": name}, wait=True)
                return
            except _PSRestarted as exc:
                self._resume(exc.shard)

    def _drop_socket(self, shard: int) -> None:
        sock = self._ctl.pop(shard, None)
        if sock is not None:
            self._watch.pop(shard).close()
            sock.close(0)

    def leave(self) -> None:
        """Tell every shard this rank is done (best effort): the job ends when all have left."""
        for shard, sess in enumerate(self.sessions):
            if sess is None:
                continue
            try:
                self._control_timeout, saved = 2.0, self._control_timeout
                try:
                    self.call({"type": "leave"}, shard=shard)
                finally:
                    self._control_timeout = saved
            except (PSUnavailable, ValueError, RuntimeError, zmq.ZMQError):
                pass

    def close(self, leave: bool = True) -> None:
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        if leave:
            self.leave()
        for shard in list(self._ctl):
            self._drop_socket(shard)
        self.sock.close()
        if getattr(self, "gsock", None) is not None:
            self.gsock.close()

    # ---------------------------------------------------------------- raw I/O with faults
    def _emit(self, out: list) -> None:
        """Send [(packet, dest)] in order after fault injection; reordered packets go out
        after the rest of the batch (or of the next one)."""
        f, rng = self.faults, self._frng
        wire = []
        for pkt, dest in out:
            self.stats.add("packets_sent")
            self.stats.add("bytes_sent", len(pkt))
            if f.drop_out and rng.random() < f.drop_out:
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
            self._write(wire)

    def _flush_held(self) -> None:
        held, self._held = self._held, []
        self._write(held)

    def _write(self, wire: list) -> None:
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

    def _recv_many(self, timeout: float, limit: int = 256) -> list:
        """Every datagram waiting (up to `limit`) once one arrives within `timeout`, as
        [(shard, header, payload)]; injected drops and bad packets are counted and left out."""
        ready, _, _ = select.select(self._sockets(), [], [], max(0.0, timeout))
        raw: list = []
        for sock in ready:
            if self.batched:
                raw += _batchio.recv_many(sock.fileno(), limit, self._rx_size)
                continue
            try:
                while len(raw) < limit:
                    raw.append(sock.recvfrom(65536))
            except (BlockingIOError, ConnectionRefusedError):
                pass
        return [g for g in map(self._accept, raw) if g is not None]

    def _accept(self, item):
        data, src = item
        shard = self._by_addr.get(src)
        self.stats.add("packets_received")
        self.stats.add("bytes_received", len(data))
        if self.faults.drop_in and self._frng.random() < self.faults.drop_in:
            self.stats.add("injected_drops_in")
            return None
        try:
            h, payload = H.parse(data)
        except H.PacketError:
            self.stats.add("bad_packets")
            return None
        if shard is None or h.job_id != self.job.job_id or h.nonce != self.sessions[shard]["nonce"]:
            self.stats.add("bad_packets")
            return None
        return shard, h, bytes(payload)

    # ---------------------------------------------------------------- phases
    def run_phase(self, kind: int, chunks: list) -> list:
        """Send chunks [(offset, count, payload)], of type DATA or NORM; results in chunk order.

        Each result is (Header, payload bytes), or None when lost under the `zero` policy.
        If the PS restarts meanwhile, the phase is resumed with the other ranks (`_resume`).
        """
        while True:
            if self._phase_no < self._skip_until:      # zero policy after a PS restart
                results = [None] * len(chunks)
                self.stats.add("lost_chunks", len(chunks))
                break
            try:
                results = self._run_phase_once(kind, chunks, self._phase_no)
                break
            except _PSRestarted as exc:
                self._resume(exc.shard)
        self._last_phase = (kind, chunks, self._phase_no)
        self._phase_no += 1
        return results

    def _place(self, kind: int, nchunks: int, phase_index: int):
        """Where chunk c of a phase goes (shard and slot arrays) and its round there (each use
        of a slot is its next round, identically in every worker); advances the slot rounds."""
        shard, slot, rounds, uses = self._placement(kind, nchunks, phase_index)
        self.slot_round += uses
        return shard, slot, rounds

    def _placement(self, kind: int, nchunks: int, phase_index: int):
        """_place without advancing: (shard, slot, round) of each chunk, and the uses per
        (shard, slot) as an array shaped like the slot rounds."""
        job, nshards = self.job, len(self.shard_addrs)
        c = np.arange(max(nchunks, 0), dtype=np.int64)
        if kind == H.NORM:
            shard = np.zeros_like(c)
            slot = job.slots + (phase_index + c) % job.norm_slots
            use = c // job.norm_slots                    # earlier uses of the same slot this phase
        else:
            # runs of SHARD_RUN chunks, shorter when the phase has fewer than SHARD_RUN per shard
            length = max(1, min(SHARD_RUN, -(-nchunks // nshards)))
            run = c // length
            shard = run % nshards
            pos = (run // nshards) * length + c % length     # the chunk's place on its shard
            slot = pos % job.slots
            use = pos // job.slots
        rounds = (self.slot_round[shard, slot] + use + 1) & 0xFFFFFFFF
        uses = np.bincount(shard * self.slot_round.shape[1] + slot, minlength=self.slot_round.size)
        return (shard.astype(np.int32), slot.astype(np.int32), rounds.astype(np.uint32),
                uses.reshape(self.slot_round.shape))

    def skip_phase(self, kind: int, nchunks: int) -> None:
        """Advance the slot rounds as if a phase of `nchunks` had run (a rank that rejoins
        a running job fast-forwards to the others' round this way)."""
        self._place(kind, nchunks, self._phase_no)
        self._phase_no += 1

    def _c_phase(self) -> bool:
        """Whether phases run in C (_batchio.phase_run): batched I/O, no injected faults (they
        draw from the Python RNG per packet), and not forced off (phase_engine='python')."""
        f = self.faults
        return (self.batched and self.phase_engine == "c" and hasattr(_batchio, "phase_run")
                and not (f.drop_out or f.drop_in or f.duplicate or f.reorder))

    def _run_phase_once(self, kind: int, chunks, phase_index: int):
        shard, slot, rounds = self._place(kind, len(chunks), phase_index)
        timeouts = self.stats.counters["timeouts"]
        if self._c_phase():
            results = self._run_phase_c(kind, chunks, shard, slot, rounds)
        else:
            results = self._run_phase_python(kind, chunks, list(zip(shard.tolist(), slot.tolist())),
                                             rounds.tolist())
        self._gc_stash()
        self._adapt_window(len(chunks), self.stats.counters["timeouts"] - timeouts)
        return results

    def _adapt_window(self, nchunks: int, timeouts: int) -> None:
        """The chunks in flight, adapted once per phase as TCP adapts its congestion window:
        a phase with a timeout halves `cwnd` (a queue overflowed or filled past the timeout
        somewhere — a rate-limited link, a switch buffer under incast, a socket — or a rank
        straggled) and remembers the half as `ssthresh`; a phase that filled the window
        without one doubles it below `ssthresh` once per round trip it carried (a window-full
        of chunks: TCP's slow start doubles per round trip, not per phase) and adds
        WINDOW_STEP above, up to `window`.  On loopback the window reaches `window` after the
        first large phase and keeps the cores busy; on a slow link it stays near what the
        bottleneck queue holds, with a timeout only every (cwnd / 2) / WINDOW_STEP phases."""
        if timeouts:
            self.ssthresh = self.cwnd = max(min(MIN_WINDOW, self.window), self.cwnd // 2)
        elif nchunks > self.cwnd:
            if self.cwnd < self.ssthresh:
                grown = min(self.cwnd << min(nchunks // self.cwnd, 16), self.ssthresh)
            else:
                grown = self.cwnd + WINDOW_STEP
            self.cwnd = min(self.window, grown)

    def _run_phase_python(self, kind: int, chunks, where: list, rounds: list) -> list:
        """The phase loop in Python (injected faults, phase_engine='python', no _batchio)."""
        job = self.job
        nchunks = len(chunks)
        elem_bits, op = (32, H.OP_MAX_U32) if kind == H.NORM else (job.up_bits, job.op)
        ids = [(s["nonce"], s["token"]) for s in self.sessions]
        results: list = [None] * nchunks
        pending: dict = {}                 # (shard, slot) -> _Pending
        next_c, finished = 0, 0
        want_type = H.NORM_RESULT if kind == H.NORM else H.RESULT
        policy = _RetransmitPolicy(self)
        # first send, answer, chunks in flight at the send: RetransmitTimer's samples
        sent, done, inflight = np.zeros(nchunks), np.zeros(nchunks), np.zeros(nchunks, np.int32)

        def complete(c, value):
            nonlocal finished
            results[c] = value
            finished += 1

        while finished < nchunks:
            self._check_membership()
            # fill the window: every packet that fits goes out in one batch
            out = []
            now = time.monotonic()
            while next_c < nchunks and len(pending) < self.cwnd and where[next_c] not in pending:
                c = next_c
                next_c += 1
                sh, slot = where[c]
                key = (sh, slot, rounds[c])
                if key in self._stash:
                    self.stats.add("resynced_chunks")
                    complete(c, self._stash.pop(key))
                    continue
                off, count, payload = chunks[c]
                pkt = H.build_fast(kind, job.job_id, self.worker_id, job.num_workers, elem_bits, slot,
                                   rounds[c], off, count, op, payload, nonce=ids[sh][0], token=ids[sh][1])
                out.append((pkt, self.shard_addrs[sh]))
                sent[c], inflight[c] = now, len(pending) + 1
                pending[(sh, slot)] = policy.start(c, pkt, now, shard=sh, in_flight=inflight[c])
            self._emit(out)
            self._flush_held()
            if finished >= nchunks:
                break
            wait = min((p.deadline for p in pending.values()), default=now + self.timeout) - time.monotonic()
            for shard, h, payload in self._recv_many(wait):
                pkey = (shard, h.slot)
                entry = pending.get(pkey)
                if (h.type == want_type and h.op != H.OP_BLOB and entry is not None
                        and h.round == rounds[entry.chunk]):
                    del pending[pkey]
                    done[entry.chunk] = time.monotonic()
                    complete(entry.chunk, (h, payload))
                elif h.type in (H.RESULT, H.NORM_RESULT):
                    self._keep(shard, h, payload)      # a later round's or another phase's
                elif h.type == H.STRAGGLER:
                    self.stats.add("straggler_notices")
                    if entry is not None and h.round > rounds[entry.chunk]:
                        del pending[pkey]
                        self.stats.add("lost_chunks")
                        complete(entry.chunk, None)
                else:
                    self.stats.add("bad_packets")
            # timeouts: resends of one pass go out as one batch
            now = time.monotonic()
            resend = []
            for pkey, entry in list(pending.items()):
                if entry.deadline > now:
                    continue
                dest = self.shard_addrs[pkey[0]]
                if policy.expired(entry, now, f"slot {pkey[1]} round {rounds[entry.chunk]}", dest):
                    resend.append((H.as_retransmission(entry.packet), dest))
                else:
                    del pending[pkey]
                    self.stats.add("lost_chunks")
                    complete(entry.chunk, None)
            self._emit(resend)
        self.rtt.phase_done(np.array([w[0] for w in where], np.int64), sent, done, inflight)
        return results

    def _run_phase_c(self, kind: int, chunks, shard, slot, rounds) -> PhaseResults:
        """The same phase in C (_batchio.phase_run, GIL released): Python prepares the arrays,
        settles chunks already in the stash, and between calls (every PHASE_BUDGET_MS) looks at
        a restarted PS, keeps read-ahead results and logs a long wait."""
        job, n = self.job, len(chunks)
        packed = chunks if isinstance(chunks, PackedChunks) else PackedChunks.from_list(chunks)
        down_bits = 32 if kind == H.NORM else job.down_bits
        res = PhaseResults(packed, down_bits)
        nslots = self.slot_round.shape[1]
        if self._stash:
            for c in range(n):
                key = (int(shard[c]), int(slot[c]), int(rounds[c]))
                if key in self._stash:
                    self.stats.add("resynced_chunks")
                    res.settle(c, *self._stash.pop(key))
        elem_bits, op = (32, H.OP_MAX_U32) if kind == H.NORM else (job.up_bits, job.op)
        P = np.array([kind, H.NORM_RESULT if kind == H.NORM else H.RESULT, job.job_id, self.worker_id,
                      job.num_workers, elem_bits, op, n, self.cwnd, nslots, len(self.shard_addrs),
                      self.policy == "zero", self.max_retries, self._gso, 0, 0,
                      int(np.count_nonzero(res.state == _SETTLED)), SPIN_US,
                      -1 if self.gsock is None else self.gsock.fileno()], dtype=np.int64)
        dests = np.array([[int.from_bytes(socket.inet_aton(ip), sys.byteorder), port, s["nonce"], s["token"]]
                          for (ip, port), s in zip(self.shard_addrs, self.sessions)], dtype=np.int64)
        hdr = np.zeros(n * H.HEADER_SIZE, np.uint8)
        deadline, tmo, tries = np.zeros(n), np.zeros(n), np.zeros(n, np.int32)
        # first send, answer, chunks in flight at the send: RetransmitTimer's samples
        sent, done, inflight = np.zeros(n), np.zeros(n), np.zeros(n, np.int32)
        pend = np.full(self.slot_round.size, -1, np.int32)
        slot_round = np.ascontiguousarray(self.slot_round, dtype=np.int64).ravel()
        counters = np.zeros(len(PHASE_COUNTERS), np.int64)
        extras: list = []
        while True:
            self._check_membership()
            status, c = _batchio.phase_run(
                self.sock.fileno(), PHASE_BUDGET_MS, P, self.rtt.T, dests, shard, slot, rounds,
                packed.offsets32, packed.counts32, packed.poff, packed.buffer, hdr, res.state, deadline,
                tmo, sent, done, inflight, tries, pend, res.headers, res.lanes, res.roff, res.lengths, slot_round,
                counters, extras)
            for name, v in zip(PHASE_COUNTERS, counters.tolist()):
                if name in self.stats.counters:
                    self.stats.add(name, v)
                else:
                    self.io[name] += v
            counters[:] = 0
            for sh, data in extras:
                h, payload = H.parse(data)
                self._keep(sh, h, bytes(payload))
            extras.clear()
            self._gso = int(P[13])
            if status == 0:
                self.rtt.phase_done(shard, sent, done, inflight)
                return res
            if status == 2:
                self._give_up(f"slot {slot[c]} round {rounds[c]}", self.shard_addrs[shard[c]], int(tries[c]))
                tries[c] = self.max_retries - 1     # still waiting: the next expiry asks again
            now = time.monotonic()
            live = pend[pend >= 0]
            if now - self._last_note > 5.0 and live.size and tries[live].max() >= STALL_NOTE_TRIES:
                self._last_note = now
                c = int(live[np.argmax(tries[live])])
                log.warning("worker %d: slot %d round %d unanswered after %d retransmissions; "
                            "waiting for %s", self.worker_id, slot[c], rounds[c], tries[c], _late(self))

    def _give_up(self, what: str, dest, tries: int):
        """After max_retries: raise the error that names the real cause (missing ranks, or an
        unreachable PS), or return to go on waiting while a missing rank may still rejoin
        (the PS reports it within its rejoin grace; once it is past the grace the PS reports
        the job stalled and `_check_membership` raises JobStalled naming it), or while the PS
        answers no heartbeat either (it may be restarting or stalled: `_check_ps_silence`
        gives up after ps_wait_s)."""
        self._check_membership()
        st = self.status[0] or {}
        silent = time.monotonic() - self._hb_ok[0]
        lease = self.sessions[0]["lease_s"]
        if silent <= 2 * lease and any(m.get("rejoin_s", 0) > 0 for m in st.get("missing") or []):
            return
        if self._watching() and max(self._ps_silent) > 0:
            return
        waiting = self.waiting_for()
        if waiting and "PS control plane" not in waiting:
            raise JobStalled(f"{what} unanswered after {tries} retransmissions: the job is waiting "
                             f"for {waiting}")
        raise PSUnavailable(f"no reply from PS {dest[0]}:{dest[1]} for {what} after {tries} "
                            f"retransmissions" + (f"; {waiting}" if waiting else ""))

    def _keep(self, shard: int, h: H.Header, payload: bytes) -> None:
        """A result read ahead of its use (batched reads take whatever is queued): a slot's
        later round is stashed for the phase that will ask for it, a BLOB fragment is queued
        for run_blob; anything already consumed or out of range is ignored."""
        if h.op == H.OP_BLOB:
            if len(self._blob_q) < 4 * self.window + 1024:
                self._blob_q.append((shard, h, payload))
            return
        if h.slot >= self.slot_round.shape[1] or h.round <= self.slot_round[shard, h.slot]:
            return
        if len(self._stash) < 4 * self.slot_round.size:
            self._stash[(shard, h.slot, h.round)] = (h, payload)
            self.stats.add("stashed_results")

    def drain(self, max_s: float = 0.1, idle_s: float = 0.05) -> dict:
        """Read every result waiting on the socket and those that arrive until it has been
        quiet for `idle_s` (at most `max_s`), keeping them for their phase as a phase would;
        returns the newest round seen per (shard, slot).  A rank that rejoins a running
        quorum job reads the fan-outs it is sent again this way, to learn where the other
        ranks are (`finished_elsewhere`)."""
        self._gc_stash()
        seen: dict = {}
        deadline = time.monotonic() + max_s
        while time.monotonic() < deadline:
            batch = self._recv_many(min(idle_s, deadline - time.monotonic()))
            if not batch:
                break
            for shard, h, payload in batch:
                if h.type in (H.RESULT, H.NORM_RESULT) and h.op != H.OP_BLOB:
                    self._keep(shard, h, payload)
                    key = (shard, h.slot)
                    seen[key] = max(seen.get(key, 0), h.round)
        return seen

    def finished_elsewhere(self, seen: dict, nchunks: int) -> bool:
        """Whether the other ranks have finished this worker's next DATA phase of `nchunks`
        chunks: `seen` (drain's answer) holds a result of every chunk's slot at that chunk's
        round or later.  Only then may a rank behind skip the phase.  One finished chunk is
        not enough: a rank that skipped a phase the others are still in would send the next
        phase's round into their slots, and a slot takes a later round as a new one (THC §6,
        Pseudocode 1), so the phase would be lost for every rank."""
        if nchunks <= 0:
            return False
        uses = self._placement(H.DATA, nchunks, self._phase_no)[3]
        last = (self.slot_round + uses) & 0xFFFFFFFF          # each used slot's round at its last use
        return all(seen.get((int(sh), int(sl)), -1) >= last[sh, sl] for sh, sl in zip(*np.nonzero(uses)))

    def _gc_stash(self) -> None:
        stale = [k for k in self._stash if k[2] <= self.slot_round[k[0], k[1]]]
        for k in stale:
            del self._stash[k]

    # ---------------------------------------------------------------- BLOB payloads
    def next_blob_round(self) -> int:
        """Round number of the next variable-size payload (the same in every worker)."""
        self.blob_round += 1
        return self.blob_round

    def run_blob(self, payload: bytes, dim: int, round_no: int):
        """Send one codec payload as BLOB fragments to shard 0 and reassemble the PS's answer.

        Returns (header of the last result fragment, result bytes), or None when lost under
        the `zero` policy or after a STRAGGLER notification.
        """
        job = self.job
        dest = self.shard_addrs[0]
        frags = B.fragments(payload, dim, job.elems_per_packet + B.SUB_SIZE)
        sess = self.sessions[0]
        pkts = [H.build(H.Header(type=H.DATA, job_id=job.job_id, worker_id=self.worker_id,
                                 num_workers=job.num_workers, elem_bits=8, slot=0, round=round_no,
                                 offset=off, count=len(f) - B.SUB_SIZE, op=H.OP_BLOB,
                                 nonce=sess["nonce"], token=sess["token"]), f)
                for off, f in frags]
        result: B.Reassembly | None = None
        last = None

        self._blob_q = [g for g in self._blob_q if g[1].round >= round_no]

        def absorb(timeout) -> bool:
            """Take what is queued (or arrives within `timeout`); True if a fragment of this
            round was added. Other results are kept for their phase before a STRAGGLER for
            this round ends it."""
            nonlocal result, last
            batch, self._blob_q = (self._blob_q, []) if self._blob_q else (self._recv_many(timeout), [])
            added, straggled = False, False
            for shard, h, body in batch:
                if h.type == H.STRAGGLER and h.round > round_no:
                    straggled = True
                elif h.op != H.OP_BLOB and h.type in (H.RESULT, H.NORM_RESULT):
                    self._keep(shard, h, body)
                elif h.type == H.RESULT and h.op == H.OP_BLOB and h.round == round_no:
                    try:
                        total, d, data = B.parse_fragment(body)
                        if result is None:
                            result = B.Reassembly(total, d)
                        result.add(h.offset, data, total, d)
                    except B.BlobError:
                        self.stats.add("bad_packets")
                        continue
                    last, added = h, True
            if straggled:
                self.stats.add("straggler_notices")
                raise _Lost()
            return added

        policy = _RetransmitPolicy(self)
        try:
            for i in range(0, len(pkts), 64):      # pace: let the PS and our own socket drain
                self._emit([(pkt, dest) for pkt in pkts[i:i + 64]])
                while absorb(0):
                    pass
            self._flush_held()
            inflight = policy.start(0, pkts, time.monotonic(), datagrams=len(pkts))
            while result is None or not result.complete:
                now = time.monotonic()
                if self._restarted:         # known from the heartbeat that found a new PS
                    raise PSUnavailable(f"the PS restarted during BLOB round {round_no}; resuming is "
                                        f"supported for the data-plane codecs (thc, none)")
                if now >= inflight.deadline:
                    if not policy.expired(inflight, now, f"BLOB round {round_no}", dest):
                        raise _Lost()
                    self._emit([(H.as_retransmission(pkt), dest) for pkt in pkts])
                    self._flush_held()
                    inflight.deadline = time.monotonic() + inflight.timeout
                    continue
                if absorb(inflight.deadline - now):
                    inflight.deadline = max(inflight.deadline, time.monotonic() + inflight.timeout)
        except _Lost:
            self.stats.add("lost_chunks")
            return None
        return last, result.payload()


class _Lost(Exception):
    """Internal: the current BLOB round is lost for this worker."""
