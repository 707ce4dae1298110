"""The worker's data phases: chunks out through a window of slots, results back.

A *phase* sends a list of chunks (DATA or NORM) and returns one result per chunk.  Chunk c
of a phase uses a slot of a shard (`PhaseEngine._placement`); every use of a slot
increments that slot's round, identically in every worker (they all issue the same
sequence of phases), so round numbers never need agreeing on.  Results that arrive for a
later round of a slot are stashed, so a late worker catches up without resending
(resynchronization); a STRAGGLER notification for a pending chunk marks it lost.  Lost
packets are resent or given up by the rule of worker/rto.py.

A phase runs in C (_batchio.phase_run, GIL released) or in the Python loop (injected
faults, phase_engine='python', no _batchio); a batch of received packets can hold results
of later rounds or of the next phase, which are kept for their phase.  Codecs whose
payloads the PS decodes travel as BLOB rounds (`PhaseEngine.run_blob`).

What a phase needs from the worker's session with the PS is the narrow `PhaseSession`
below; the sockets are a worker/datagrams.py `Datagrams`.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import time
from typing import Protocol

import numpy as np

from thc_ps.proto import blob as B
from thc_ps.proto import headers as H
from thc_ps.proto.job import JobConfig
from thc_ps.worker.chunks import _SETTLED, ChunkStream, PackedChunks, PhaseResults
from thc_ps.worker.rto import STALL_NOTE_TRIES, RetransmitPolicy, RetransmitTimer
from thc_ps.worker.session import PSUnavailable, _PSRestarted

try:
    from thc_ps.worker import _batchio      # the C phase loop, built by `pip install`
except ImportError:                  # pragma: no cover - the Python loop serves without it
    _batchio = None

log = logging.getLogger(__name__)

#: Counters of one C phase call, in _batchio.phase_run's order; the first thirteen are
#: TransportStats counters, the rest socket batching (PhaseEngine.io).
PHASE_COUNTERS = ("packets_sent", "packets_received", "bytes_sent", "bytes_received", "retransmissions",
                  "timeouts", "lost_chunks", "straggler_notices", "bad_packets", "fast_losses", "notices",
                  "injected_drops_out", "injected_drops_in", "gso_messages", "gro_batches")
#: Busy-poll before the C phase loop sleeps in poll(): microseconds ($THC_BUSY_POLL_US, 0 = off).
SPIN_US = int(os.environ.get("THC_BUSY_POLL_US", "0") or 0)
#: The C phase loop returns to Python this often (restarted PS, read-ahead results, warnings).
PHASE_BUDGET_MS = 100.0

DEFAULT_WINDOW = 512        # most chunks in flight per worker: the default job's 512 slots
START_WINDOW = 64           # the window a transport starts with ...
MIN_WINDOW = 16             # ... the least it shrinks to (see PhaseEngine._adapt_window) ...
WINDOW_STEP = 16            # ... and its additive increase past the last halving
CONGESTED = 1 / 8           # ... which a phase that found more than this share of its chunks lost does,
CLUSTER = (10, 16)          # ... or one that found 10 of some 16 consecutive chunks lost (a queue's tail)
SHARD_RUN = 64              # consecutive chunks a shard takes in turn: a GSO message's worth


def clustered(found: np.ndarray, least: int = CLUSTER[0], span: int = CLUSTER[1]) -> bool:
    """Whether some `span` consecutive chunks of a phase hold `least` or more found lost
    (`found`: a bool per chunk): a queue's tail drop, not independent loss."""
    if found.size < least:
        return False
    hits = np.concatenate(([0], np.cumsum(found, dtype=np.int64)))
    width = min(span, found.size)
    return bool((hits[width:] - hits[:-width]).max() >= least)


class PhaseSession(Protocol):
    """What the data phases need from the worker's session with the PS (worker/session.py
    `Session` provides it; nothing else of the session is used):

      worker_id, job         the rank, and the job's geometry (id, workers, slots and NORM
                             slots, element bits, operation, packet size); a PS that
                             restarted may give the job another id and data slots when the
                             rank registers again (resume), and the engine fits them (fit_job)
      shard_addrs            each shard's data address (ip, port); shard_of(addr) maps a
                             source back (None: not a shard of this job)
      ids(shard)             (nonce, token) that packets to the shard carry; they change
                             when the rank registers again, so a phase asks for them anew
      check_membership()     raises what the heartbeats found: LeaseLost (a lapsed lease),
                             JobEnded, JobStalled, or _PSRestarted (the phase resumes)
      ps_restarted           whether a shard restarted (a BLOB round cannot resume)
      give_up(what, dest, tries)  after max_retries: raises the cause, or returns to wait on
      late()                 whom late results wait for (missing ranks, ranks behind, the PS)
      resume(shard, phase)   register again after a restart; {phase, max_phase} to go on at
    """

    worker_id: int
    job: JobConfig
    shard_addrs: list
    ps_restarted: bool

    def shard_of(self, addr) -> int | None: ...
    def ids(self, shard: int) -> tuple: ...
    def check_membership(self) -> None: ...
    def give_up(self, what: str, dest, tries: int) -> None: ...
    def late(self) -> str: ...
    def resume(self, shard: int, phase: int) -> dict: ...


class PhaseEngine:
    """The data plane of one worker: slot rounds, window, stash, and the phase loops.

    `session` is a PhaseSession, `net` a worker/datagrams.py `Datagrams` (its `stats` are
    this engine's counters too).  The other arguments are `Transport`'s.  The engine keeps
    no state outside itself and holds no thread: one phase (or BLOB round) at a time, from
    any one thread."""

    def __init__(self, session: PhaseSession, net, *, policy: str = "retransmit", timeout_ms: float = 50.0,
                 max_timeout_ms: float = 1000.0, max_retries: int = 60, window: int = DEFAULT_WINDOW,
                 phase_engine: str = "c", adaptive_timeout: bool = True):
        self.session, self.net, self.stats = session, net, net.stats
        self.worker_id = session.worker_id
        self.policy = policy
        self.timeout = timeout_ms / 1e3
        self.max_timeout = max_timeout_ms / 1e3
        self.max_retries = max_retries
        self.phase_engine = phase_engine
        self.io = dict.fromkeys(PHASE_COUNTERS[13:], 0)      # socket batching, beside the stats
        self._last_note = time.monotonic()
        nshards = len(session.shard_addrs)
        adaptive = adaptive_timeout and policy == "retransmit"
        job = session.job
        self.rtt = RetransmitTimer(self.timeout, self.max_timeout, nshards, adaptive)
        self.norm_rtt = RetransmitTimer(self.timeout, self.max_timeout, nshards, adaptive,
                                        meeting_q=max(0.5, 1 - 1 / job.num_workers))
        self.window = min(window, job.slots * nshards)
        self.cwnd = min(START_WINDOW, self.window)
        self.ssthresh = self.window
        self._found_lost: np.ndarray | None = None     # the last phase's chunks resent
        self.slot_round = np.zeros((nshards, job.slots + job.norm_slots), dtype=np.int64)
        self._stash: dict = {}
        self._blob_q: list = []
        self._phase_no = 0
        self._last_phase = None             # (kind, chunks, phase index) of the last completed phase
        self.blob_round = 0
        self.resumes = 0
        self._skip_until = 0

    @property
    def job(self) -> JobConfig:
        return self.session.job

    @property
    def shard_addrs(self) -> list:
        return self.session.shard_addrs

    def restart(self) -> None:
        """Start afresh (a rank that rejoined): slot rounds, stash, phase and BLOB counts at 0."""
        self.fit_job()
        self.slot_round[:] = 0
        self._stash.clear()
        self._blob_q = []
        self._phase_no, self._last_phase, self.blob_round, self._skip_until = 0, None, 0, 0

    def fit_job(self) -> None:
        """The session registered again and the PS gave the job other data slots: the slot
        rounds take the new region's shape (the caller restarts them) and the window fits in it."""
        job, nshards = self.job, len(self.shard_addrs)
        if self.slot_round.shape[1] != job.slots + job.norm_slots:
            self.slot_round = np.zeros((nshards, job.slots + job.norm_slots), dtype=np.int64)
            self.window = min(self.window, job.slots * nshards)
            self.cwnd, self.ssthresh = min(self.cwnd, self.window), min(self.ssthresh, self.window)

    def give_up(self, what: str, dest, tries: int) -> None:
        """After max_retries: the session raises the cause or returns to go on waiting."""
        self.session.give_up(what, dest, tries)

    def note_stall(self, what: str, tries: int, now: float) -> None:
        """Warn (at most every 5 s) that `what` is still unanswered, and what the job waits for."""
        if now - self._last_note > 5.0 and tries >= STALL_NOTE_TRIES:
            self._last_note = now
            log.warning("worker %d: %s unanswered after %d retransmissions; waiting for %s",
                        self.worker_id, what, tries, self.session.late())

    def _recv(self, timeout: float) -> list:
        """What arrives within `timeout` (Datagrams.recv_many) from this job's shards with this
        session's nonce, as [(shard, header, payload)]; anything else is a bad packet."""
        out = []
        for src, h, payload in self.net.recv_many(timeout):
            shard = self.session.shard_of(src)
            if shard is None or h.job_id != self.job.job_id or h.nonce != self.session.ids(shard)[0]:
                self.stats.add("bad_packets")
                continue
            out.append((shard, h, payload))
        return out

    def run_phase(self, kind: int, chunks: list, stream: ChunkStream | None = None) -> list:
        """Send chunks [(offset, count, payload)], of type DATA or NORM; results in chunk order.

        Each result is (Header, payload bytes), or None when lost under the `zero` policy.
        If the PS restarts meanwhile, the phase is resumed with the other ranks (`resume`).
        `stream`: the chunks (a PackedChunks) are still being made; the C phase sends each as
        soon as the stream says it is ready (the Python phase and a resumed one wait for all).
        """
        while True:
            if self._phase_no < self._skip_until:      # zero policy after a PS restart
                if stream is not None:
                    stream.wait()
                results = [None] * len(chunks)
                self.stats.add("lost_chunks", len(chunks))
                break
            try:
                results = self._run_phase_once(kind, chunks, self._phase_no, stream)
                break
            except _PSRestarted as exc:
                if stream is not None:
                    stream.wait()
                    stream = None               # again whole, with new results
                self.resume(exc.shard)
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

    def streams(self) -> bool:
        """Whether a phase sends a ChunkStream's chunks as they are made (the C phase)."""
        return self._c_phase()

    def _c_phase(self) -> bool:
        """Whether phases run in C (_batchio.phase_run): batched I/O, no injected fault the C
        loop does not draw itself (it drops; duplicates, reordering and drops by sequence are
        the Python loop's), and not forced off (phase_engine='python')."""
        return (self.net.batched and self.phase_engine == "c" and hasattr(_batchio, "phase_run")
                and not self.net.faults.python_only)

    def _run_phase_once(self, kind: int, chunks, phase_index: int, stream: ChunkStream | None = None):
        shard, slot, rounds = self._place(kind, len(chunks), phase_index)
        found = self.stats.counters["timeouts"] + self.stats.counters["fast_losses"]
        self._found_lost = None          # this phase's loop sets it: never an earlier phase's
        if self._c_phase():
            results = self._run_phase_c(kind, chunks, shard, slot, rounds, stream)
        else:
            if stream is not None:
                stream.wait()
            results = self._run_phase_python(kind, chunks, list(zip(shard.tolist(), slot.tolist())),
                                             rounds.tolist())
        self._gc_stash()
        c = self.stats.counters
        # chunks found lost, at most each once (a late rank's chunk may be probed again and again)
        self._adapt_window(len(chunks), min(len(chunks), c["timeouts"] + c["fast_losses"] - found),
                           self._found_lost)
        return results

    def _adapt_window(self, nchunks: int, lost: int, found: np.ndarray | None = None) -> None:
        """The chunks in flight, adapted once per phase as TCP adapts its congestion window:
        a phase that found more than a CONGESTED share of its chunks lost (by a timer or by the
        order of results, at least two) halves `cwnd` (a queue overflowed somewhere — a
        rate-limited link, a switch buffer under incast, a socket — and dropped a window's
        tail) and remembers the half as `ssthresh`; a phase that filled the window without
        that doubles it below `ssthresh` once per round trip it carried (a window-full of
        chunks: TCP's slow start doubles per round trip, not per phase), at most twice a
        phase (a phase is one look at the queue: from 64 straight to 512 behind a 100 Mbit/s
        link, the next phase lost a quarter of its chunks), and adds WINDOW_STEP above, up to
        `window`.  On loopback the window reaches `window` after the first large
        phase and keeps the cores busy; on a slow link it stays near what the bottleneck queue
        holds.  Random loss is not congestion: at 1% loss each way a rank of 4 finds about 5%
        of its chunks lost, of 8 about 9%, and halving for it (TCP Reno's rule) kept the
        window at its least and made the phase window-bound (docs/bench.md, "Loss
        recovery"); nor is a timer's probe while a rank is late.  But a queue that overflows
        drops runs of consecutive chunks, and a window that overflows it by less than a
        CONGESTED share did so phase after phase (behind a 100 Mbit/s link, 4 ranks at a
        256-chunk window lost 2–10% of each phase in runs of 10–20): a phase whose `found`
        (a bool per chunk: resent, the `retransmit` policy's losses) is `clustered` halves
        too.  Independent loss rarely is: at 9% a chunk, some 16 consecutive chunks hold 10
        lost in about one phase of 10,000 (733 chunks)."""
        if lost > max(1, nchunks * CONGESTED) or (found is not None and clustered(found)):
            self.ssthresh = self.cwnd = max(min(MIN_WINDOW, self.window), self.cwnd // 2)
        elif nchunks > self.cwnd:
            if self.cwnd < self.ssthresh:
                grown = min(self.cwnd << min(nchunks // self.cwnd, 2), self.ssthresh)
            else:
                grown = self.cwnd + WINDOW_STEP
            self.cwnd = min(self.window, grown)

    def timer(self, kind: int) -> RetransmitTimer:
        """The retransmission timer of a phase of `kind`: NORM phases keep their own.  A NORM
        phase's one chunk is answered when the slowest rank has transformed its vector and
        taken its norms, so its round trip is the ranks' codec skew (5–67 ms with four
        ranks on two cores); the DATA phase after it starts with the ranks just lined up by
        it (first chunks 4–12 ms).  One floor for both, three median meetings of the two
        mixed, timed out the NORM chunk in 34 of 120 rank-rounds of a lossless run
        (docs/bench.md, "Loss recovery").  A rank that comes to the NORM phase last is
        answered at once, one that comes first waits longest, each about one phase in n: the
        NORM floor is from the 1 − 1/n quantile of its NORM round trips (at least the
        median), the upper quartile with four ranks."""
        return self.norm_rtt if kind == H.NORM else self.rtt

    def _run_phase_python(self, kind: int, chunks, where: list, rounds: list) -> list:
        """The phase loop in Python (injected faults, phase_engine='python', no _batchio)."""
        job = self.job
        nchunks = len(chunks)
        elem_bits, op = (32, H.OP_MAX_U32) if kind == H.NORM else (job.up_bits, job.op)
        ids = [self.session.ids(s) for s in range(len(self.shard_addrs))]
        results: list = [None] * nchunks
        pending: dict = {}                 # (shard, slot) -> _Pending
        next_c, finished = 0, 0
        want_type = H.NORM_RESULT if kind == H.NORM else H.RESULT
        timer = self.timer(kind)
        policy = RetransmitPolicy(self, timer)
        # first send, answer, chunks in flight at the send: RetransmitTimer's samples
        sent, done, inflight = np.zeros(nchunks), np.zeros(nchunks), np.zeros(nchunks, np.int32)
        fanned = [-1] * len(self.shard_addrs)      # per shard: the latest chunk answered by a fan-out
        reorder, order_wait = timer.reorder, timer.order_wait
        self._found_lost = found = np.zeros(nchunks, bool)     # resent

        def complete(c, value):
            nonlocal finished
            results[c] = value
            finished += 1

        while finished < nchunks:
            self.session.check_membership()
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
            self.net.emit(out)
            self.net.flush_held()
            if finished >= nchunks:
                break
            wait = min(min((min(p.deadline, p.fast if p.fast > 0 else p.deadline) for p in pending.values()),
                           default=now + self.timeout) - time.monotonic(), self.max_timeout)
            answered: dict = {}                     # per shard: the latest chunk answered in this pass
            for shard, h, payload in self._recv(wait):
                pkey = (shard, h.slot)
                entry = pending.get(pkey)
                if (h.type == want_type and h.op != H.OP_BLOB and entry is not None
                        and h.round == rounds[entry.chunk]):
                    del pending[pkey]
                    done[entry.chunk] = time.monotonic()
                    answered[shard] = max(answered.get(shard, -1), entry.chunk)
                    if not h.flags & H.F_RESENT:
                        fanned[shard] = max(fanned[shard], entry.chunk)
                    complete(entry.chunk, (h, payload))
                elif h.type in (H.RESULT, H.NORM_RESULT):
                    self._keep(shard, h, payload)      # a later round's or another phase's
                elif h.type == H.STRAGGLER:
                    self.stats.add("straggler_notices")
                    if entry is not None and h.round > rounds[entry.chunk]:
                        del pending[pkey]
                        self.stats.add("lost_chunks")
                        complete(entry.chunk, None)
                elif h.type == H.NOTICE:
                    if entry is not None and h.round == rounds[entry.chunk]:
                        self.stats.add("notices")
                        policy.noticed(entry, time.monotonic(), reorder)
                else:
                    self.stats.add("bad_packets")
            # losses, by the order of results (worker/rto.py) or by a timer: resends of one pass
            # go out as one batch
            now = time.monotonic()
            resend = []
            oldest: dict = {}
            for (sh, _), entry in pending.items():
                oldest[sh] = min(oldest.get(sh, entry.chunk), entry.chunk)
            for pkey, entry in list(pending.items()):
                sh = pkey[0]
                if sh in answered:
                    policy.release(entry, answered[sh], sh, now)
                if entry.chunk < fanned[sh]:
                    policy.found_lost(entry, now + order_wait)
                if not policy.due(entry, now) or policy.hold(entry, now, entry.chunk == oldest[sh]):
                    continue
                dest = self.shard_addrs[pkey[0]]
                if policy.expired(entry, now, f"slot {pkey[1]} round {rounds[entry.chunk]}", dest):
                    found[entry.chunk] = True
                    resend.append((H.as_retransmission(entry.packet), dest))
                else:
                    del pending[pkey]
                    self.stats.add("lost_chunks")
                    complete(entry.chunk, None)
            self.net.emit(resend)
        timer.phase_done(np.array([w[0] for w in where], np.int64), sent, done, inflight)
        return results

    def _run_phase_c(self, kind: int, chunks, shard, slot, rounds, stream: ChunkStream | None = None) -> PhaseResults:
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
                      self.policy == "zero", self.max_retries, self.net.gso, 0, 0,
                      int(np.count_nonzero(res.state == _SETTLED)), SPIN_US,
                      -1 if self.net.gsock is None else self.net.gsock.fileno(),
                      *([n, -1, 0, 0, 0, -1] if stream is None else stream.p_fields()),
                      *self.net.faults.thresholds(), self.net.drop_state], dtype=np.int64)
        if stream is not None:
            stream.attach(P, res)
        dests = np.array([[int.from_bytes(socket.inet_aton(ip), sys.byteorder), port, *self.session.ids(s)]
                          for s, (ip, port) in enumerate(self.shard_addrs)], dtype=np.int64)
        hdr = np.zeros(n * H.HEADER_SIZE, np.uint8)
        deadline, tmo, tries = np.zeros(n), np.zeros(n), np.zeros(n, np.int32)
        # first send, answer, chunks in flight at the send: RetransmitTimer's samples
        sent, done, inflight = np.zeros(n), np.zeros(n), np.zeros(n, np.int32)
        # the order rule (worker/rto.py): when each chunk is due, each shard's latest fan-out
        fast, fanned = np.zeros(n), np.full(len(self.shard_addrs), -1, np.int64)
        pend = np.full(self.slot_round.size, -1, np.int32)
        slot_round = np.ascontiguousarray(self.slot_round, dtype=np.int64).ravel()
        counters = np.zeros(len(PHASE_COUNTERS), np.int64)
        extras: list = []
        timer = self.timer(kind)
        while True:
            self.session.check_membership()
            if stream is not None:
                stream.check()
            status, c = _batchio.phase_run(
                self.net.sock.fileno(), PHASE_BUDGET_MS, P, timer.T, dests, shard, slot, rounds,
                packed.offsets32, packed.counts32, packed.poff, packed.buffer, hdr, res.state, deadline,
                tmo, sent, done, inflight, tries, fast, fanned, pend, res.headers, res.lanes, res.roff, res.lengths,
                slot_round, counters, extras)
            for name, v in zip(PHASE_COUNTERS, counters.tolist()):
                if name in self.stats.counters:
                    self.stats.add(name, v)
                else:
                    self.io[name] += v
            counters[:] = 0
            self.net.drop_state = int(P[-1])
            for sh, data in extras:
                h, payload = H.parse(data)
                self._keep(sh, h, bytes(payload))
            extras.clear()
            self.net.gso = int(P[13])
            if status == 0:
                timer.phase_done(shard, sent, done, inflight)
                self._found_lost = tries > 0
                return res
            if status == 2:
                self.give_up(f"slot {slot[c]} round {rounds[c]}", self.shard_addrs[shard[c]], int(tries[c]))
                tries[c] = self.max_retries - 1     # still waiting: the next expiry asks again
            now = time.monotonic()
            live = pend[pend >= 0]
            if now - self._last_note > 5.0 and live.size:
                c = int(live[np.argmax(tries[live])])
                self.note_stall(f"slot {slot[c]} round {rounds[c]}", int(tries[c]), now)

    def resume(self, shard: int) -> None:
        """After a PS restart: register again and agree with every rank where to go on.

        retransmit: from the least phase any rank reached — slot rounds reset there, a rank
        that had finished that phase replays it (from the packets it kept), and the
        interrupted phase runs again; nothing is lost.  zero: from the greatest phase —
        ranks behind report the phases in between as lost."""
        if len(self.shard_addrs) > 1:
            raise PSUnavailable(f"PS shard {shard} restarted; resuming is supported with one shard only")
        if self.job.blob:
            raise PSUnavailable(f"the PS restarted during a {self.job.codec} job; resuming is supported "
                                f"for the data-plane codecs (thc, none)")
        self.resumes += 1
        log.warning("worker %d: the PS restarted; registering again and resuming at phase %d",
                    self.worker_id, self._phase_no)
        reply = self.session.resume(shard, self._phase_no)
        self.fit_job()
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
            batch = self._recv(min(idle_s, deadline - time.monotonic()))
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
        nonce, token = self.session.ids(0)
        pkts = [H.build(H.Header(type=H.DATA, job_id=job.job_id, worker_id=self.worker_id,
                                 num_workers=job.num_workers, elem_bits=8, slot=0, round=round_no,
                                 offset=off, count=len(f) - B.SUB_SIZE, op=H.OP_BLOB,
                                 nonce=nonce, token=token), f)
                for off, f in frags]
        result: B.Reassembly | None = None
        last = None

        self._blob_q = [g for g in self._blob_q if g[1].round >= round_no]

        def absorb(timeout) -> bool:
            """Take what is queued (or arrives within `timeout`); True if a fragment of this
            round was added. Other results are kept for their phase before a STRAGGLER for
            this round ends it."""
            nonlocal result, last
            batch, self._blob_q = (self._blob_q, []) if self._blob_q else (self._recv(timeout), [])
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

        policy = RetransmitPolicy(self)
        try:
            for i in range(0, len(pkts), 64):      # pace: let the PS and our own socket drain
                self.net.emit([(pkt, dest) for pkt in pkts[i:i + 64]])
                while absorb(0):
                    pass
            self.net.flush_held()
            inflight = policy.start(0, pkts, time.monotonic(), datagrams=len(pkts))
            while result is None or not result.complete:
                now = time.monotonic()
                if self.session.ps_restarted:       # known from the heartbeat that found a new PS
                    raise PSUnavailable(f"the PS restarted during BLOB round {round_no}; resuming is "
                                        f"supported for the data-plane codecs (thc, none)")
                if now >= inflight.deadline:
                    if not policy.expired(inflight, now, f"BLOB round {round_no}", dest):
                        raise _Lost()
                    self.net.emit([(H.as_retransmission(pkt), dest) for pkt in pkts])
                    self.net.flush_held()
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
