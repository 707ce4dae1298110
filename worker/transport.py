"""The worker's transport to the PS: one object for registration, control calls and the
data-plane phases of one worker, composed of

  worker/session.py    the session with the PS (register, heartbeat, lease, rejoin, resume,
                       barrier, leave, control calls and their errors)
  worker/phases.py     the data phases (placement, window, Python and C phase loops, stash,
                       BLOB rounds); worker/chunks.py their flat buffers
  worker/rto.py        the retransmission timer and the resend / give-up rule
  worker/datagrams.py  the sockets, batched I/O and fault injection

A phase sees the session only through `phases.PhaseSession` (addresses, nonce and token
per shard, the job's geometry, and a check that raises a lapsed lease or a restarted PS).
Every name other code imported from this module is still here.
"""
from __future__ import annotations

import os

from thc_ps.proto.job import JobConfig
from thc_ps.worker.chunks import ChunkStream, PackedChunks, PhaseResults
from thc_ps.worker.datagrams import Datagrams, Faults, TransportStats, local_ip_towards
from thc_ps.worker.phases import (DEFAULT_WINDOW, MIN_WINDOW, PHASE_BUDGET_MS, PHASE_COUNTERS, SHARD_RUN, SPIN_US,
                           START_WINDOW, WINDOW_STEP, PhaseEngine, PhaseSession)
from thc_ps.worker.policies import POLICIES
from thc_ps.worker.rto import STALL_NOTE_TRIES, RetransmitPolicy, RetransmitTimer, rto_scale
from thc_ps.worker.session import (DEFAULT_PS_WAIT_S, Draining, JobEnded, JobStalled, LeaseLost, PSUnavailable, Queued,
                            Session, _PSRestarted)

__all__ = ["DEFAULT_PS_WAIT_S", "DEFAULT_WINDOW", "Draining",
           "MIN_WINDOW", "PHASE_BUDGET_MS", "PHASE_COUNTERS", "POLICIES", "SHARD_RUN",
           "SPIN_US", "STALL_NOTE_TRIES", "START_WINDOW", "WINDOW_STEP", "ChunkStream", "Datagrams", "Faults", "JobEnded",
           "JobStalled", "LeaseLost", "PSUnavailable", "PackedChunks", "PhaseEngine", "PhaseResults",
           "PhaseSession", "Queued", "RetransmitPolicy", "RetransmitTimer", "Session", "Transport",
           "TransportStats", "_PSRestarted", "local_ip_towards", "rto_scale"]


def _part(part: str, name: str, settable: bool = False) -> property:
    """Transport.<name> is <part>.<name> (read-only unless `settable`)."""
    def get(self):
        return getattr(getattr(self, part), name)

    def put(self, value):
        setattr(getattr(self, part), name, value)
    return property(get, put if settable else None, doc=f"`{part}.{name}`")


class Transport:
    """Registration, control calls and data-plane phases for one worker: a `Session`, a
    `PhaseEngine` and their `Datagrams`, with the methods and attributes of each that
    callers use.  `session`, `phases` and `net` are the parts."""

    def __init__(self, ps_host: str, data_port: int, worker_id: int, *, control_port: int | None = None,
                 policy: str = "retransmit", timeout_ms: float = 50.0, max_timeout_ms: float = 1000.0,
                 max_retries: int = 60, window: int = DEFAULT_WINDOW, faults: Faults | None = None,
                 control_timeout_s: float = 30.0, shards: list | None = None, bind_port: int = 0,
                 batched: bool = True, expect: dict | None = None, propose: JobConfig | None = None,
                 keys=None, heartbeat: bool = True, rejoin: bool = False, phase_engine: str | None = None,
                 job_name: str | None = None, queue_s: float = 600.0, adaptive_timeout: bool = True,
                 ps_wait_s: float = DEFAULT_PS_WAIT_S, launch: str | None = None):
        """Connect to one PS, or to S shards given as [(host, data_port, control_port), ...].

        `job_name` names the job on the PS (None: the PS's "default"): workers of one name
        form one job, other names run beside it; `launch`, a token every rank of one launch
        shares, keeps two launches given one name apart (the PS refuses the second).  A job
        the PS queues (its slot space is full) waits up to `queue_s`, asking again twice a
        second.

        `expect` is the part of the job configuration this worker insists on (the PS refuses
        the registration naming every differing field); `propose` is a whole job for a PS
        started without one.  `keys` is a key directory (`thc keys`): the control plane
        then runs ZeroMQ CURVE.  A heartbeat thread renews this rank's lease, learns who the
        job is waiting for, and notices a restarted PS (the worker then registers again and
        resumes the interrupted phase with the other ranks).  A PS that answers nothing
        for `ps_wait_s` seconds is given up (PSUnavailable, saying how long it waited).

        `window` is the most chunks this worker keeps in flight, at most the job's slots ×
        shards (a switch job's 64 slots bound it there); the window in use starts at 64 and
        adapts per phase (`PhaseEngine._adapt_window`): a small window leaves the cores idle
        between round trips, a large one overflows a slow link's queue (docs/bench-history.md,
        "Packet rate against the GSO/GRO blaster").
        `timeout_ms` is the first retransmission timeout until the path is measured: with
        `adaptive_timeout` (the default) and the retransmit policy each shard's timeout then
        follows the measured round trips, at least 1 ms (worker/rto.py, RetransmitTimer);
        otherwise every chunk starts at `timeout_ms` (under the `zero` policy a timer's expiry
        loses the chunk).  Most losses are found without a timer: by the PS's notice, or by
        the order of results (worker/rto.py).
        `batched` sends a window's packets with one sendmmsg and takes every waiting result
        with one recvmmsg (worker/_batchio.c); False is the one-call-per-datagram loop,
        kept for comparison (bench/bench_e2e.py) and for platforms without the extension.
        `phase_engine` 'c' (default, or $THC_PHASE_ENGINE) runs a whole phase — window,
        retransmit timers, results — in C with the GIL released (_batchio.phase_run);
        'python' is the Python loop, also used when faults other than random drops are
        injected (duplicates, reordering, drops by sequence; the C loop draws drops).  With
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
        phase_engine = phase_engine or os.environ.get("THC_PHASE_ENGINE", "c")
        if phase_engine not in ("c", "python"):
            raise ValueError(f"phase_engine must be 'c' or 'python', got {phase_engine!r}")
        self.worker_id = worker_id
        self.stats = TransportStats()
        shards = shards or [(ps_host, data_port, control_port or data_port + 1)]
        self.net = Datagrams(worker_id, (shards[0][0], int(shards[0][1])), bind_port=bind_port,
                             batched=batched, faults=faults, stats=self.stats)
        try:
            self.session = Session(shards, worker_id, self.net.address, control_timeout_s=control_timeout_s,
                                   keys=keys, expect=expect, propose=propose, job_name=job_name,
                                   queue_s=queue_s, rejoin=rejoin, ps_wait_s=ps_wait_s, launch=launch)
        except BaseException:           # not registered: nothing to leave, the socket to close
            self.net.close()
            raise
        try:
            self.net.join_group(worker_id, self.session.job)
        except RuntimeError:
            self.close()
            raise
        self.phases = PhaseEngine(self.session, self.net, policy=policy, timeout_ms=timeout_ms,
                                  max_timeout_ms=max_timeout_ms, max_retries=max_retries, window=window,
                                  phase_engine=phase_engine, adaptive_timeout=adaptive_timeout)
        if heartbeat:
            self.session.start_heartbeat()

    # the session's
    job = _part("session", "job")
    sessions = _part("session", "sessions")
    status = _part("session", "status")
    progress = _part("session", "progress", settable=True)
    rejoined = _part("session", "rejoined")
    ps_wait_s = _part("session", "ps_wait_s", settable=True)
    job_name = _part("session", "job_name")
    shard_addrs = _part("session", "shard_addrs", settable=True)
    # the data plane's
    policy = _part("phases", "policy")
    timeout = _part("phases", "timeout")
    max_timeout = _part("phases", "max_timeout")
    max_retries = _part("phases", "max_retries")
    phase_engine = _part("phases", "phase_engine")
    rtt = _part("phases", "rtt")
    norm_rtt = _part("phases", "norm_rtt")
    io = _part("phases", "io")
    window = _part("phases", "window")
    cwnd = _part("phases", "cwnd")
    ssthresh = _part("phases", "ssthresh")
    slot_round = _part("phases", "slot_round")
    blob_round = _part("phases", "blob_round")
    resumes = _part("phases", "resumes")
    faults = _part("net", "faults")
    batched = _part("net", "batched")
    sock = _part("net", "sock")
    gsock = _part("net", "gsock", settable=True)

    @property
    def ps(self) -> tuple:
        """The data address of shard 0."""
        return self.session.shard_addrs[0]

    # ---------------------------------------------------------------- session
    def call(self, msg: dict, shard: int = 0, wait: bool = False) -> dict:
        """One control request (`Session.call`)."""
        return self.session.call(msg, shard=shard, wait=wait)

    def barrier(self, name: str) -> None:
        """Wait until every live rank of the job reached `name`; if the PS restarts meanwhile,
        resume with the other ranks (`PhaseEngine.resume`) and wait again at the new PS."""
        while True:
            try:
                self.session.barrier(name)
                return
            except _PSRestarted as exc:
                self.phases.resume(exc.shard)

    def sync_state(self, round_no: int, state: bytes) -> tuple[bytes, bool]:
        """Model sync round `round_no` (docs/protocol.md §7, "Model sync"): every rank gives its
        own `state`; returns (the sync source's state, whether this rank is the source), once
        every live rank passed barrier sync-<round>.  A PS restart at any step (the source's
        `sync_put`, a rank's `sync_get`, the barrier) resumes the data plane with the other
        ranks, which are all in this sync too, and runs the whole sync again at the new PS: a
        restarted PS holds none of the old one's state, so the source puts it again."""
        while True:
            try:
                if self.session.is_sync_source():
                    self.call({"type": "sync_put", "round": round_no, "blob": state})
                    got, source = state, True
                else:
                    got, source = self.call({"type": "sync_get", "round": round_no}, wait=True)["blob"], False
                self.session.barrier(f"sync-{round_no}")
                return got, source
            except _PSRestarted as exc:
                self.phases.resume(exc.shard)

    def waiting_for(self) -> str:
        """What the job waits for, from the latest heartbeat: '' if nothing is known missing."""
        return self.session.waiting_for()

    def is_sync_source(self) -> bool:
        """Whether this rank publishes model-sync state (the lowest live rank)."""
        return self.session.is_sync_source()

    def others_step(self) -> int:
        """The step the other live ranks of the job are on (`Session.others_step`)."""
        return self.session.others_step()

    def rejoin(self) -> None:
        """After `LeaseLost`: register again as a rejoining rank (new token and session) and
        start the data plane afresh, as a restarted rank would; the caller then fast-forwards
        the slot rounds to the other ranks' step (`Worker.skip_rounds`).  Raises JobEnded
        when the job ended meanwhile."""
        self.session.rejoin()
        self.phases.restart()

    def leave(self) -> None:
        """Tell every shard this rank is done (best effort): the job ends when all have left."""
        self.session.leave()

    def close(self, leave: bool = True) -> None:
        self.session.close(leave)
        self.net.close()

    # ---------------------------------------------------------------- data plane
    def run_phase(self, kind: int, chunks: list, stream=None) -> list:
        """Send chunks [(offset, count, payload)], of type DATA or NORM; results in chunk order
        (`PhaseEngine.run_phase`; `stream`: a ChunkStream, the chunks are still being made)."""
        return self.phases.run_phase(kind, chunks, stream)

    def streams(self) -> bool:
        """Whether a phase sends chunks as a ChunkStream makes them (the C phase), rather
        than waiting for all of them."""
        return self.phases.streams()

    def skip_phase(self, kind: int, nchunks: int) -> None:
        """Advance the slot rounds as if a phase of `nchunks` had run."""
        self.phases.skip_phase(kind, nchunks)

    def drain(self, max_s: float = 0.1, idle_s: float = 0.05) -> dict:
        """Read and keep the results waiting (`PhaseEngine.drain`)."""
        return self.phases.drain(max_s, idle_s)

    def finished_elsewhere(self, seen: dict, nchunks: int) -> bool:
        """Whether the other ranks finished this worker's next DATA phase (`PhaseEngine.finished_elsewhere`)."""
        return self.phases.finished_elsewhere(seen, nchunks)

    def next_blob_round(self) -> int:
        """Round number of the next variable-size payload (the same in every worker)."""
        return self.phases.next_blob_round()

    def run_blob(self, payload: bytes, dim: int, round_no: int):
        """One codec payload as a BLOB round (`PhaseEngine.run_blob`)."""
        return self.phases.run_blob(payload, dim, round_no)
