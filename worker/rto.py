"""The worker's loss recovery: the timer that adapts each shard's timeout to the path
(RetransmitTimer, rto_scale), the order rule that finds a lost chunk without a timer, and the
one resend / backoff / give-up rule (RetransmitPolicy) that the Python phase loop and BLOB
rounds apply and _batchio.phase_run mirrors in C (docs/design.md, "Loss recovery").

Loss handling (THC §6.1 and SwitchML, docs/prior-art.md §2.1):
  retransmit  resend a chunk found lost (by the order of results, below, or by its timer)
              with exponential backoff of the timer; the PS answers a resend of a
              completed chunk with its kept result; nothing is lost (default).  After
              `max_retries` the worker names the cause (missing ranks, or a PS whose data
              plane is silent); a PS silent to heartbeats too is waited for up to
              `ps_wait_s` (it may be restarting or stalled).
  zero        no resend: a chunk found lost is reported lost (None) and the caller treats
              it as a zero update (§6.1).

A chunk is found lost without a timer in two ways:

- **The PS's notice** (software PS only): a NOTICE for a pending chunk's slot and round says
  the PS lacks this rank's packet (its next packet arrived first).  The chunk is due a
  reorder window after the notice arrived: a packet that was only overtaken on the way has
  reached the PS by then, and its result this rank.
- **The order of results**: the result of a later chunk of its phase, sent to the same shard,
  arrived first as a fan-out (a result the PS sent because the slot had just completed, flag
  RESENT clear).  Every rank sends a phase's chunks in chunk order and the PS completes slots
  in the order their last contributions arrive, so the later slot completing means every
  rank's packet for the earlier one had reached the PS (or was lost), and its result went
  out before.  The chunk is due ORDER_REORDERS reorder windows after that fan-out (RACK,
  RFC 8985, with the fan-out's order in place of the send time): long enough for the rank
  whose packet was lost to resend it on its notice and the result to come, so that the
  other ranks do not all resend a chunk the PS holds theirs of.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

#: A chunk resent this often (about 5 s with the default 50 ms doubling to 1 s) is worth a
#: warning that says what the job waits for; fewer resends are routine on a busy machine.
STALL_NOTE_TRIES = 8
#: The least first timeout the measurement may set: a path measured faster than this still
#: waits 1 ms (TCP in datacenters runs with a minimum RTO of about this, for incast).
MIN_TIMEOUT_S = 1e-3
#: The floor of the first timeout is FLOOR_RTTS times the median meeting round trip (below).
FLOOR_RTTS = 3
#: Phases whose meeting round trips the floor follows (a window of the recent ones).
MEETINGS = 16
#: The least reorder window: a chunk is lost once a later chunk's fan-out has been here this
#: long without its own (a quarter of the path's least round trip when that is longer).
REORDER_MIN_S = 1e-3
#: The order rule waits this many reorder windows after the fan-out that found a chunk lost.
ORDER_REORDERS = 4
#: Where the shards' scales start in RetransmitTimer.T (floor, cap, adaptive, reorder window,
#: the order rule's wait, the first timeout).
T_SCALES = 6
#: _Pending.fast of a chunk held by the probe rule (RetransmitPolicy.hold)
HELD = -2.0


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
    fast: float = 0.0           # the order rule's due time (0: not found lost; -1: used; HELD: held)


def quantile(values, q: float) -> float:
    """`np.quantile(values, q)` (its default, linear method) bit for bit, at a fifth of its
    cost on the timer's few dozen samples (about 2 µs against 27: the timer takes one per
    shard and one of the meetings at the end of every phase).  The same float64 steps as
    numpy's: the virtual index (n − 1)·q, the two order statistics around it (a
    partition, not a sort), and numpy's two-sided interpolation between them."""
    a = np.asarray(values, dtype=np.float64).ravel()
    n = a.size
    if n == 0:
        raise ValueError("the quantile of no samples")
    v = (n - 1) * q
    if v >= n - 1:
        return float(a.max())
    if v < 0:
        return float(a.min())
    lo = math.floor(v)
    part = np.partition(a, (lo, lo + 1))
    x, y = float(part[lo]), float(part[lo + 1])
    g, d = v - lo, y - x
    return y - d * (1 - g) if g >= 0.5 else x + d * g


def rto_scale(per_chunk: np.ndarray) -> float:
    """The timeout per chunk in flight, from samples of round trip / chunks in flight
    (seconds): three times their lower quartile (RetransmitTimer says why not a mean, nor
    a median)."""
    return 3 * quantile(per_chunk, 0.25)


class RetransmitTimer:
    """The retransmission timeout of each shard, adapted to the path, once per phase.

    A chunk's round trip through an aggregator is queueing and service there plus the wait
    for the other ranks' packets of its slot.  A fixed timeout fits one path only: on a
    software PS over loopback a result takes well under a millisecond once the ranks have
    met, through bmv2 (about a thousand THC packets/s, so a window of 64 chunks from each of
    4 workers queues for 250 ms) or behind a slow link it takes hundreds of ms, and a fixed
    50 ms timer costs a lost packet 50 ms on the first and resends a fifth of the packets on
    the others (docs/bench.md, "Retransmission timer").  Most losses are found without a
    timer (the order rule, module docstring); the timer is for the rest: a phase's last
    chunks, a NORM phase's one chunk, a lost resend.  Two measurements set it:

    - **Queueing**, which grows with the chunks in flight (the window,
      `PhaseEngine._adapt_window`, changes that number from phase to phase): every answered
      chunk of a phase gives q = round trip / chunks in flight when it was sent (round trip
      from its first send), and at the end of a phase with MIN_SAMPLES answers or more from
      a shard, that shard's scale becomes `rto_scale` of them: three times their lower
      quartile.
    - **The ranks' meeting**: no chunk is answered before every rank has sent it, so a
      phase's first chunk waits for the slowest rank to get there (its codec, a busy
      core), whatever the path.  Its round trip (answer − first send of the phase's
      first-sent answered chunk) is the phase's meeting round trip M.  The floor is
      FLOOR_RTTS × the median M of the last MEETINGS phases (`meeting_q`: another quantile,
      for NORM phases, PhaseEngine.timer), at least MIN_TIMEOUT_S (1 ms);
      before any phase has been answered it is `first` (`--timeout-ms`).

    A chunk sent to shard s with k chunks in flight waits
    min(max(scale_s · k, floor), cap) before its first resend: the timeout follows the
    window as the queue does, and never fires while the ranks are still meeting as they
    usually do.  Until shard s's scale is measured, a chunk with others in flight (k > 1)
    waits at least `first`, as TCP waits its initial RTO before the first sample: the floor
    measures the meeting, not the queue k chunks make (behind a 100 Mbit/s link the first
    data phase's round trips reached 34 ms against a 4.5 ms floor, and a rank resent 104 of
    its 733 chunks, all of which the PS held).  With `adaptive` False (`--fixed-timeout`)
    every chunk waits `first`.

    The lower quartile of a whole phase, because some answers wait for a loss to be
    recovered, the chunk's own or another rank's: at 5% loss a chunk of 4 ranks waits with
    probability 1 − 0.95^5 ≈ 23%, of 8 ranks 37%, at 10% loss 61%.  An estimate that sees
    them ratchets the timeout up phase after phase, each timeout lengthening the waits it
    measures: TCP's mean did at once, and so did median + 4·MAD once they neared half of the
    answers (8 ranks at 10% loss on loopback: rounds 27.8 s against 4.4 s with the fixed
    timer, the timeout at its 1 s cap).  The lower quartile ignores them up to three
    quarters of the answers; on a path whose round trip is queueing, the answers' q are
    close together, and three times the quartile clears them.  The median of the meetings
    for the same reason: a phase whose first chunk waited for a recovery is one sample of
    sixteen.  Timing from the first send, not only chunks never resent (Karn's rule, which
    TCP needs because its mean is not robust), keeps a path slower than the timeout
    measurable: there every chunk is resent before its answer comes, and the answer still
    tells how long the path took.

    The reorder window is max(REORDER_MIN_S, m / 4) with m the least round trip of any
    answered chunk in the last MEETINGS phases (RACK's min_RTT / 4); the order rule waits
    ORDER_REORDERS of them.

    `T` = [floor, cap, adaptive, reorder window, the order rule's wait, first, then each
    shard's scale (0: not measured yet)] is what the C phase (_batchio.phase_run) reads.
    """

    MIN_SAMPLES = 8

    def __init__(self, first_s: float, cap_s: float, shards: int, adaptive: bool = True,
                 minimum_s: float = MIN_TIMEOUT_S, meeting_q: float = 0.5):
        self.first, self.minimum, self.meeting_q = first_s, minimum_s, meeting_q
        self.T = np.zeros(T_SCALES + shards)
        self.T[:T_SCALES] = (first_s, cap_s, float(adaptive), REORDER_MIN_S, ORDER_REORDERS * REORDER_MIN_S,
                             first_s)
        self._meets: deque = deque(maxlen=MEETINGS)     # each phase's meeting round trip
        self._least: deque = deque(maxlen=MEETINGS)     # each phase's least round trip

    @property
    def adaptive(self) -> bool:
        return bool(self.T[2])

    @property
    def floor(self) -> float:
        return float(self.T[0])

    @property
    def reorder(self) -> float:
        """The reorder window (seconds): a noticed chunk is due this long after its last send."""
        return float(self.T[3])

    @property
    def order_wait(self) -> float:
        """How long after a later chunk's fan-out the order rule makes a chunk due (seconds)."""
        return float(self.T[4])

    def first_timeout(self, shard: int, in_flight: int) -> float:
        """The first timeout of a chunk sent to `shard` with `in_flight` chunks in flight."""
        floor, cap, adaptive = self.T[:3]
        if not adaptive:
            return float(floor)
        scale = self.T[T_SCALES + shard]
        if scale == 0:
            return float(max(floor, self.first) if in_flight > 1 else floor)
        return float(min(max(scale * in_flight, floor), cap))

    def phase_done(self, shard: np.ndarray, sent: np.ndarray, done: np.ndarray, inflight: np.ndarray) -> None:
        """A phase ended: chunk c went to shard[c], was first sent at sent[c] with inflight[c]
        chunks in flight (itself included), and answered at done[c] (0: not answered)."""
        ok = done > 0
        if not ok.any():
            return
        rtt = done[ok] - sent[ok]
        self._least.append(float(rtt.min()))
        self.T[3] = max(REORDER_MIN_S, min(self._least) / 4)
        self.T[4] = ORDER_REORDERS * self.T[3]
        if not self.adaptive:
            return
        first = np.flatnonzero(ok)[np.argmin(sent[ok])]
        self._meets.append(float(done[first] - sent[first]))
        self.T[0] = max(self.minimum, FLOOR_RTTS * quantile(self._meets, self.meeting_q))
        # shards with enough answered chunks (a bincount: np.unique's first call imports
        # numpy.ma, 6-16 ms inside a job's first phase)
        for s in np.flatnonzero(np.bincount(shard[ok]) >= self.MIN_SAMPLES).tolist():
            mine = ok & (shard == s)
            self.T[T_SCALES + s] = rto_scale((done[mine] - sent[mine]) / inflight[mine])


class RetransmitPolicy:
    """The one loss / backoff / give-up rule of phases and BLOB rounds (`retransmit`: resend a
    chunk found lost — by its timer, the timer then doubling up to max_timeout, or by the
    order of results, once — and give up after max_retries naming the cause; `zero`: a
    chunk found lost is lost).  _batchio.phase_run implements the same rule in C.

    `engine` is the phase engine (worker/phases.py) whose parameters it applies: `policy`,
    `timeout`, `max_timeout`, `max_retries`, `stats`, and `give_up` / `note_stall` for a
    chunk unanswered too long; `timer` is the phase's RetransmitTimer (`engine.rtt` unless
    given: a NORM phase has its own, PhaseEngine.timer)."""

    def __init__(self, engine, timer: RetransmitTimer | None = None):
        self.t = engine
        self.rtt = engine.rtt if timer is None else timer

    def start(self, chunk: int, packet, now: float, datagrams: int = 1, shard: int | None = None,
              in_flight: int = 1) -> _Pending:
        """A packet enters flight with `in_flight` chunks in flight (itself included): its
        first timeout is RetransmitTimer's for the shard (`shard` None: the fixed first
        timeout, for BLOB rounds, whose round trip includes decoding)."""
        tmo = self.t.timeout if shard is None else self.rtt.first_timeout(shard, in_flight)
        return _Pending(chunk, packet, now + tmo, tmo, 0, datagrams, now)

    @staticmethod
    def found_lost(p: _Pending, at: float) -> None:
        """The order of results says p is lost: it is due at `at` (a later chunk's fan-out's
        arrival plus the reorder window), unless it was found so before or resent since."""
        if p.fast in (0, HELD):
            p.fast = at

    def hold(self, p: _Pending, now: float, oldest: bool) -> bool:
        """The probe rule: p's timer expired, but under `retransmit` only the oldest pending
        chunk of a shard is resent on a timer (TCP resends the first unacknowledged segment
        on its RTO).  A whole window times out together when a rank is late (its codec, a
        busy core, or paused halfway through sending its window): then one probe per shard
        goes out, not a window of resends the PS drops as duplicates.  True: p is held (no
        resend, no timer) until the shard answers again (`release`)."""
        if oldest or self.t.policy == "zero" or p.deadline > now or 0 < p.fast <= now:
            return False
        p.fast, p.deadline = HELD, math.inf
        return True

    def release(self, p: _Pending, answered: int, shard: int, now: float) -> None:
        """The shard answered chunk `answered`: a held p is in flight again with a fresh
        timer, a first timeout for its place behind the answered chunk, so that answers still
        coming in order (a late rank's window) are not resent.  When it expires, the probe
        rule applies again: a tail lost whole is resent a chunk per timeout (random loss
        rarely loses two; the order rule takes every chunk a later result passed)."""
        if p.fast == HELD:
            p.fast = 0.0
            p.deadline = now + self.rtt.first_timeout(shard, max(1, p.chunk - answered))

    @staticmethod
    def noticed(p: _Pending, now: float, reorder: float) -> None:
        """The PS's NOTICE (arrived `now`) says it lacks p: p is due a reorder window later,
        unless it was found lost sooner, or the order rule already resent it (its timer goes
        on)."""
        if p.fast == -1:
            return
        p.fast = now + reorder if p.fast <= 0 else min(p.fast, now + reorder)

    @staticmethod
    def due(p: _Pending, now: float) -> bool:
        return p.deadline <= now or 0 < p.fast <= now

    def expired(self, p: _Pending, now: float, what: str, dest) -> bool:
        """p is due: True = resend it (counted; a timer's expiry doubles the timeout); False =
        it is lost (zero policy).  Raises JobStalled / PSUnavailable after max_retries."""
        t = self.t
        timer = p.deadline <= now
        t.stats.add("timeouts" if timer else "fast_losses")
        p.fast = -1                     # the order rule finds a chunk lost once
        if t.policy == "zero":
            return False
        if p.tries >= t.max_retries:
            t.give_up(what, dest, p.tries)
        t.note_stall(what, p.tries, now)
        t.stats.add("retransmissions", p.datagrams)
        p.tries += 1
        if timer:
            p.timeout = min(p.timeout * 2, t.max_timeout)
        p.deadline = now + p.timeout
        return True
