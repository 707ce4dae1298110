"""The worker's retransmission: the timer that adapts each shard's timeout to the path
(RetransmitTimer, rto_scale) and the one resend / backoff / give-up rule (RetransmitPolicy)
that the Python phase loop and BLOB rounds apply and _batchio.phase_run mirrors in C.

Loss handling (THC §6.1 and SwitchML, docs/prior-art.md §2.1):
  retransmit  resend after a timeout with exponential backoff; the PS answers a
              resend of a completed chunk with its kept result; nothing is lost
              (default).  After `max_retries` the worker names the cause (missing
              ranks, or a PS whose data plane is silent); a PS silent to heartbeats
              too is waited for up to `ps_wait_s` (it may be restarting or stalled).
  zero        no resend: a chunk whose result missed its timeout is reported
              lost (None) and the caller treats it as a zero update (§6.1).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: A chunk resent this often (about 5 s with the default 50 ms doubling to 1 s) is worth a
#: warning that says what the job waits for; fewer resends are routine on a busy machine.
STALL_NOTE_TRIES = 8


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
    grows with the chunks in flight, and the window (`PhaseEngine._adapt_window`) changes
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


class RetransmitPolicy:
    """The one timeout / backoff / give-up rule of phases and BLOB rounds (`retransmit`:
    resend with the timeout doubled up to max_timeout, give up after max_retries naming the
    cause; `zero`: the first timeout loses the chunk).  _batchio.phase_run implements the
    same rule in C.

    `engine` is the phase engine (worker/phases.py) whose parameters it applies: `policy`,
    `timeout`, `max_timeout`, `max_retries`, `rtt` (a RetransmitTimer), `stats`, and
    `give_up` / `note_stall` for a chunk unanswered too long."""

    def __init__(self, engine):
        self.t = engine

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
            t.give_up(what, dest, p.tries)
        t.note_stall(what, p.tries, now)
        t.stats.add("retransmissions", p.datagrams)
        p.tries += 1
        p.timeout = min(p.timeout * 2, t.max_timeout)
        p.deadline = now + p.timeout
        return True
