"""The software PS process: a UDP data plane (C engine by default) and a ZeroMQ control plane.

Python only does control; the data thread spends its time inside `Mux.serve`, which
releases the GIL and hands each datagram to its job's C engine.  One process serves many
jobs at once, and one after another:

* A **job** has a name (`--job NAME`; workers without one share the name "default").  It
  starts when a worker registers under a name no running job has.  Its configuration is the
  one the PS was started with (`thc ps --workers …`), or, for a PS started without one, the
  job that worker proposes.  Admission (ps_server/admission.py) gives it a region of the
  PS's slot space, or queues it while the space is full; the PS gives it a job id no other
  running job has, a fresh engine on its region (clean slots), a random 32-bit nonce that
  every data packet must carry, and its own barriers and model-sync state.  Workers of the
  same name join it while it is assembled.  It ends when every rank has left or lost its
  lease; its region is cleared and nothing of it reaches another job.
* **Membership**: a registration binds a rank to a source address, a random data-plane
  token and a random session secret that every later request for that rank must carry.
  A second claim for a live rank is refused.  Workers renew a lease with heartbeats; a rank
  that misses it is reported as missing (status, barriers, the workers' stall messages),
  unregistered from the data plane, and may be claimed again (rejoin).
* **Authentication**: with `keys` the control plane runs ZeroMQ CURVE (encrypted, and only
  holders of an authorized client key connect); see docs/design.md, "What is protected".
  Every request is validated (proto/control.py SCHEMA) and every failure is answered with
  an error reply; the control loop never dies of a message.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from thc_ps.proto import control
from thc_ps.proto import udpio
from thc_ps.proto.job import JobConfig, parse_group
from thc_ps.proto.keys import HandshakeWatch
from thc_ps.proto.sockets import multicast_from, multicast_unreachable, set_buffer
from thc_ps.ps_server.engine import Engine, ExternalEngine
from thc_ps.ps_server import admission
from thc_ps.ps_server.engine import JobTable
from thc_ps.ps_server.reference import DROP_REASONS, ReferencePS, SlotSpace

log = logging.getLogger(__name__)

RCVBUF = 8 << 20
DEFAULT_LEASE_S = 5.0
#: A dead rank may be claimed again this long before barriers give up on it.
DEFAULT_REJOIN_GRACE_S = 30.0
JOIN_ROUND = (1 << 31) - 1
#: The name of a job whose workers gave none (`thc worker` without --job).
DEFAULT_JOB_NAME = "default"
#: A queued job whose workers stopped asking for this long leaves the queue.
QUEUE_FORGET_S = 5.0
#: A job's own control counters (beside its engine's data-plane ones): what the status listing
#: and the metrics (ps_server/metrics.py) show per job.
JOB_COUNTERS = ("registrations", "rejoins", "leases_expired", "stall_s_excused")
#: A control step (a request, a lease check) that kept the control plane busy at least this
#: long — programming a switch takes seconds — does not count against any rank's lease.
DEAF_EXCUSE_S = 0.5
#: The control loop's longest sleep (ZeroMQ poll).  A loop that wakes later than this plus
#: DEAF_EXCUSE_S was itself stopped (SIGSTOP, a VM pause, swap): the PS stalled, not its ranks.
#: Any other step of the loop that took that long is excused the same way (`_account`).
POLL_S = 0.1


def make_engine(job: JobConfig, kind: str | ExternalEngine = "c", nonce: int = 0, space=None,
                base: int = 0) -> Engine:
    """A fresh aggregation engine for one job: 'c' (hot path), 'python' (reference), or an
    ExternalEngine (e.g. thc_ps.p4.control.SwitchEngine), which programs the job in its slots base..
    and returns its engine.  `space`: the PS's SlotSpace (the C one for 'c',
    reference.SlotSpace for 'python'), the engine's slots being its slots base..; None gives
    the engine slots of its own."""
    if not isinstance(kind, str):
        return kind.start_job(job, nonce, base)
    if kind == "python" or job.blob:   # decode–sum–re-encode codecs run in Python
        if space is not None and not isinstance(space, SlotSpace):
            space, base = None, 0      # a Python engine beside C ones: slots of its own
        return ReferencePS(job, nonce, space, base)
    if kind != "c":
        raise ValueError(f"engine must be 'c' or 'python', got {kind!r}")
    from thc_ps.ps_server._fastpath import Engine
    return Engine(job_id=job.job_id, num_workers=job.num_workers, slots=job.slots,
                  norm_slots=job.norm_slots, elems_per_packet=job.elems_per_packet,
                  bits=job.bits, lane_bits=job.lane_bits, op=job.op,
                  quorum_count=job.quorum_count, table=list(job.table) or [0], nonce=nonce,
                  space=space, base=base, **_group_kwargs(job))


def _group_kwargs(job: JobConfig) -> dict:
    group = parse_group(job.result_group)
    return {} if group is None else {"group_ip": group[0], "group_port": group[1]}


def udp_socket(bind: tuple) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    set_buffer(sock, RCVBUF)
    set_buffer(sock, RCVBUF, send=True)
    udpio.set_gro(sock, udpio.offload_enabled())   # before traffic: batches coalesce from the start
    sock.bind(bind)
    multicast_from(sock, sock.getsockname()[0])     # a job's group gets results where the PS listens
    return sock


def _add_stats(total: dict, part: dict) -> None:
    for k, v in part.items():
        if k == "drops":
            for r, n in v.items():
                total["drops"][r] = total["drops"].get(r, 0) + n
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            total[k] = total.get(k, 0) + v


@dataclass
class Member:
    rank: int
    addr: tuple
    token: int
    session: bytes
    last_seen: float
    state: str = "live"            # live | left | dead
    died: float = 0.0
    progress: int = -1             # the worker's own step counter (heartbeats carry it)
    joining: bool = False          # rejoined, and not yet synchronized (never the sync source)


@dataclass
class Job:
    """One job's whole state on this PS; dropped when the job ends."""

    number: int
    config: JobConfig
    nonce: int
    engine: object
    name: str = DEFAULT_JOB_NAME
    region: admission.Region | None = None
    members: dict = field(default_factory=dict)          # rank -> Member
    barriers: dict = field(default_factory=dict)         # name -> {rank: ident}
    released: list = field(default_factory=list)         # recent released barrier names
    sync: dict = field(default_factory=dict)             # round -> blob
    sync_waiters: dict = field(default_factory=dict)     # round -> [ident]
    resume: dict = field(default_factory=dict)           # rank -> phase (after a PS restart)
    resume_waiters: dict = field(default_factory=dict)   # rank -> ident
    started: float = field(default_factory=time.monotonic)
    launch: str = ""                                     # the launch token of its ranks ("": none given)
    counters: dict = field(default_factory=lambda: dict.fromkeys(JOB_COUNTERS, 0))

    def live(self) -> list:
        return sorted(r for r, m in self.members.items() if m.state == "live")

    def label(self) -> str:
        return f"job {self.number} ({self.name!r})"

    def member(self, rank: int, session) -> Member | None:
        """The member holding `rank` with this session secret, or None."""
        m = self.members.get(rank)
        if m is None or not isinstance(session, bytes) or not secrets.compare_digest(m.session, session):
            return None
        return m

    def sync_source(self):
        """The rank whose state model sync distributes: the lowest live rank that is not
        rejoining (a rejoining rank is the one that needs the state)."""
        return next((r for r in self.live() if not self.members[r].joining), None)

    def missing(self, now: float, grace: float) -> list:
        """Ranks the job is waiting for: never registered, or dead, with how long they are
        silent and `rejoin_s`, the seconds left of their rejoin grace (0: past it)."""
        out = []
        for r in range(self.config.num_workers):
            m = self.members.get(r)
            if m is None:
                out.append({"rank": r, "why": "never registered"})
            elif m.state == "dead":
                left = max(0.0, grace - (now - m.died))
                why = f"no heartbeat for {now - m.last_seen:.1f} s" + \
                    ("" if left else f", past the {grace:g} s rejoin grace")
                out.append({"rank": r, "why": why, "rejoin_s": round(left, 3)})
        return out

    def stalled(self, now: float, grace: float) -> str | None:
        """Why the job can no longer complete, or None: fewer than ⌈q·n⌉ ranks are live and a
        dead rank is past its rejoin grace (a rank within it may still come back)."""
        if len(self.live()) >= self.config.quorum_count:
            return None
        if not any(m.state == "dead" and now - m.died > grace for m in self.members.values()):
            return None
        return (f"job {self.number} needs {self.config.quorum_count} live ranks and is missing "
                f"{control.describe_missing(self.missing(now, grace))}")


#: The refusal of a registration that neither finds a job nor can start one: what to send.
NO_JOB_PROPOSED = ("this PS has no job configured and this worker proposed none: the worker that starts a "
                   "job must propose it: thc_ps.connect() always does; `thc worker` does when given "
                   "--workers N (and the job options); from Python, Transport(..., propose=JobConfig("
                   "num_workers=N, ...)); or start the PS with --workers N and the job options "
                   "(on the wire: the register request's `job` field)")


@dataclass
class Queued:
    """A job waiting for slots: its workers keep asking (register) until it is admitted."""

    name: str
    data: int
    norm: int
    since: float
    last_asked: float
    ranks: set = field(default_factory=set)
    config: JobConfig | None = None     # what it will start with (one name, one job)
    launch: str = ""                    # the launch token of the registration that queued it


class PSServer:
    """One PS shard: `start()` returns once both planes listen; `stop()` joins everything.

    `job` fixes the job configuration every job on this PS must have (workers that expect
    otherwise are refused); None lets the first worker of each job propose it.
    `slot_space`: the slots all running jobs share (admission gives each a region).
    """

    def __init__(self, job: JobConfig | None, bind: tuple = ("127.0.0.1", 9000),
                 control_port: int | None = None, engine="c", log=None, keys: str | Path | None = None,
                 lease_s: float = DEFAULT_LEASE_S, rejoin_grace_s: float = DEFAULT_REJOIN_GRACE_S,
                 max_message: int = control.DEFAULT_MAX_MESSAGE,
                 slot_space: int = admission.DEFAULT_SLOT_SPACE):
        self.fixed_job = job
        self.engine_kind = engine
        self._external = None if isinstance(engine, str) else engine    # an ExternalEngine
        if self._external is not None:          # the switch's registers are the slot space
            slot_space = self._external.slot_space
        if job is not None and job.result_group and self._external is not None:
            raise ValueError("result_group: a switch multicasts results itself; the PS's job must not name one")
        if job is not None and job.slots + job.norm_slots > slot_space:
            raise ValueError(f"the job's {job.slots} + {job.norm_slots} slots exceed the slot space "
                             f"of {slot_space}")
        self.space_size = slot_space
        if self._external is not None:
            self.space, self.mux = None, self._external
        elif engine == "c":
            from thc_ps.ps_server._fastpath import Mux
            from thc_ps.ps_server._fastpath import SlotSpace as CSlotSpace
            self.space, self.mux = CSlotSpace(slot_space), Mux()
        else:
            self.space, self.mux = SlotSpace(slot_space), JobTable()
        self.lease_s = lease_s
        self.rejoin_grace_s = rejoin_grace_s
        self.sock = udp_socket(bind)
        self.data_addr = self.sock.getsockname()
        self._ctx = zmq.Context.instance()
        self._auth = None
        self.ctl = self._ctx.socket(zmq.ROUTER)
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.ctl.setsockopt(zmq.MAXMSGSIZE, max_message)
        self._watch = None                         # keys: failed handshakes are logged
        if keys is not None:
            self._auth = _curve_server(self._ctx, self.ctl, Path(keys))
            self._watch = HandshakeWatch(self.ctl, server=True)
        cport = control_port if control_port is not None else self.data_addr[1] + 1
        self.ctl.bind(f"tcp://{bind[0]}:{cport}")
        self.control_port = int(self.ctl.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        self._stop = threading.Event()
        self._mark = time.monotonic()              # the control loop's last accounting point
        self._threads: list[threading.Thread] = []
        self._lock = threading.RLock()
        self.jobs: dict = {}                       # number -> Job, the running ones
        self.queue: dict = {}                      # name -> Queued, oldest first
        self._jobs_started = 0
        self._totals: dict = {"drops": dict.fromkeys(DROP_REASONS, 0)}
        self._control = {"jobs_started": 0, "jobs_ended": 0, "registrations": 0,
                         "registrations_refused": 0, "registrations_queued": 0, "control_errors": 0,
                         "leases_expired": 0, "rejoins": 0, "stall_s_excused": 0.0, "engine_errors": 0}
        self._io: dict = {}                        # the C engines' socket counters of ended jobs
        # draining (`drain`): no new job is admitted, the PS stops once the running ones end;
        # the jobs queued when it began are told so when their workers ask again
        self.draining = False
        self._drain_queued: dict = {}              # queued job name -> told yet
        self._drain_since = 0.0
        self.incarnation = secrets.randbits(32)
        # event lines: to `log` when given (thc ps prints them), else this module's logger
        self.log = log or _log_event
        if keys is None and bind[0] in ("0.0.0.0", "::", ""):
            self.log("WARNING: control plane bound to every interface WITHOUT keys: anyone who "
                     "reaches it can join or stop jobs. Use --keys DIR (make them with `thc keys DIR`) "
                     "or bind a private address.")

    # ---------------------------------------------------------------- jobs
    @property
    def job(self) -> Job | None:
        """The most recently started running job (None when none runs): a one-job view."""
        return self.jobs[max(self.jobs)] if self.jobs else None

    @property
    def engine(self):
        return self.job.engine if self.job else None

    def _job_id(self, wanted: int) -> int:
        """The job's configured id when no running job has it, else the lowest free one."""
        used = {j.config.job_id for j in self.jobs.values()}
        if wanted not in used:
            return wanted
        return next(i for i in range(1, 1 << 16) if i not in used)

    def _check_group(self, config: JobConfig) -> None:
        """Refuse a result group this PS cannot serve: a switch multicasts results itself, and
        two running jobs on one group would each deliver every result to the other's workers."""
        if not config.result_group:
            return
        if self._external is not None:
            raise control.ControlError(f"result_group {config.result_group}: this PS aggregates in a "
                                       f"switch, which multicasts results itself; drop result_group")
        other = next((j for j in self.jobs.values() if j.config.result_group == config.result_group), None)
        if other is not None:
            raise control.ControlError(f"result_group {config.result_group} is in use by {other.label()}; "
                                       f"give this job another group or port")
        problem = multicast_unreachable(self.sock.getsockname()[0], parse_group(config.result_group))
        if problem:
            raise control.ControlError(f"result_group {config.result_group}: this PS cannot send to it "
                                       f"({problem}); bind the PS to an address of the workers' network")

    def _admit(self, name: str, config: JobConfig, rank: int, launch: str = "") -> Job:
        """Start job `name`: a region of the slot space, a job id and an engine; or raise
        `queued` (CodedError) saying why it waits and what runs."""
        now = time.monotonic()
        held = {j.label(): j.region for j in self.jobs.values()}
        full = self._external is not None and len(self.jobs) >= self._external.max_jobs
        if full:                                           # the switch's job table is full
            region = None
            why = (f"the switch holds {self._external.max_jobs} job(s) at once and "
                   f"{', '.join(held)} run(s); it waits until one ends")
        else:
            region = admission.grant(config.slots, config.norm_slots, list(held.values()), self.space_size)
            why = admission.why_waiting(config.slots, config.norm_slots, held, self.space_size)
        mine = self.queue.get(name)
        since = mine.since if mine else now
        # first come, first served: an older queued job that fits now goes first
        first = next((q for q in self.queue.values() if q.since < since and q.name != name and not full
                      and admission.grant(q.data, q.norm, list(held.values()), self.space_size)), None)
        if region is None or first is not None:
            q = self.queue.setdefault(name, Queued(name, config.slots, config.norm_slots, now, now, config=config,
                                                   launch=launch))
            q.last_asked = now
            q.ranks.add(rank)
            self._control["registrations_queued"] += 1
            if region is not None:
                why = f"job {first.name!r} has waited longer and goes first"
            raise control.CodedError(f"job {name!r} is queued: {why}", "queued",
                                     position=1 + sum(o.since < q.since for o in self.queue.values()))
        self.queue.pop(name, None)
        config = dataclasses.replace(config, job_id=self._job_id(config.job_id), slots=region.data)
        self._jobs_started += 1
        # a switch programmed in advance (p4/harness/static_control.py) carries its own nonce
        nonce = self._external.fixed_nonce if self._external else None
        used = {j.nonce for j in self.jobs.values()}
        while not nonce or nonce in used:
            nonce = secrets.randbits(32)
        engine = make_engine(config, self.engine_kind if self._external is None else self._external,
                             nonce, self.space, region.base)
        job = Job(self._jobs_started, config, nonce, engine, name, region, launch=launch)
        if self._external is None:
            self.mux.add(config.job_id, engine)
        self._control["jobs_started"] += 1
        self.jobs[job.number] = job
        self.log(f"{job.label()} started: n={config.num_workers}, codec={config.codec}, "
                 f"quorum={config.quorum}, job id {config.job_id}, slots {region.base}.."
                 f"{region.end - 1} ({region.data} data + {region.norm} norm)")
        return job

    def _end_job(self, job: Job, why: str) -> None:
        if self.jobs.pop(job.number, None) is None:
            return
        if self._external is None:
            self.mux.remove(job.config.job_id)
        _add_stats(self._totals, job.engine.stats())
        _add_stats(self._io, _io_stats(job.engine))
        for r in list(job.members):
            self._unregister(job, r)
        job.engine.close()                 # the region is free (and clear) for the next job
        for waiters in ([[w for w, _ in ws] for ws in job.sync_waiters.values()]
                        + [list(b.values()) for b in job.barriers.values()]
                        + [list(job.resume_waiters.values())]):
            for ident in waiters:
                self._reply(ident, control.error(f"job {job.number} ended ({why})"))
        self._control["jobs_ended"] += 1
        self.log(f"{job.label()} ended: {why}")

    def _unregister(self, job: Job, rank: int) -> None:
        job.engine.unregister(rank)

    def _excuse(self, busy: float, least: float = DEAF_EXCUSE_S) -> None:
        """The control plane heard no one for `busy` seconds (it was programming a switch, or
        the PS process itself was stopped): that time does not count against anyone.  Live
        ranks' leases, dead ranks' rejoin grace and queued jobs' patience are all moved on by
        it; their heartbeats and requests wait in the queue meanwhile."""
        if busy < least or busy <= 0:
            return
        now = time.monotonic()
        self._control["stall_s_excused"] += busy
        for job in self.jobs.values():
            job.counters["stall_s_excused"] += busy
            for m in job.members.values():
                if m.state == "live":
                    m.last_seen = min(now, m.last_seen + busy)
                elif m.state == "dead":
                    m.died, m.last_seen = min(now, m.died + busy), m.last_seen + busy
        for q in self.queue.values():
            q.last_asked = min(now, q.last_asked + busy)

    def _account(self, stalled: bool = True, behind: bool = False) -> None:
        """Excuse the time since the control loop's last accounting point beyond POLL_S (its
        poll): a stretch of DEAF_EXCUSE_S or more in which nothing of the control loop ran
        means this process stalled (SIGSTOP, a VM pause, swap: `stalled`, logged) or a
        request kept it busy (programming a switch).  Either is the PS's own, never a rank's:
        every lease is extended by it.  Accounting before every lease check, and after every
        request, leaves no stretch of the loop unaccounted, wherever a stop lands.
        `behind`: the request just answered had others queued behind it, so the loop is
        working through a backlog (a starved or overloaded host): all of its time is the PS's
        own, since a rank's heartbeat may be waiting in that queue, sent in time."""
        now = time.monotonic()
        gap, self._mark = now - self._mark, now
        if behind:
            self._excuse(gap, least=0.0)
            return
        stall = gap - POLL_S
        if stall >= DEAF_EXCUSE_S:
            self._excuse(stall)
            if stalled and self.jobs:
                self.log(f"the PS stalled for {stall:.1f} s (its control loop ran nothing for that long); "
                         f"every lease is extended by that, no rank is blamed")

    def _check_leases(self) -> None:
        self._account()                     # a stall up to now is excused before any lease is judged
        now = self._mark
        for name in [n for n, q in self.queue.items() if now - q.last_asked > QUEUE_FORGET_S]:
            del self.queue[name]
        for job in list(self.jobs.values()):
            for m in job.members.values():
                if m.state == "live" and now - m.last_seen > self.lease_s:
                    m.state, m.died = "dead", now
                    self._control["leases_expired"] += 1
                    job.counters["leases_expired"] += 1
                    self._unregister(job, m.rank)
                    self.log(f"job {job.number}: rank {m.rank} lost its lease (no heartbeat for "
                             f"{now - m.last_seen:.1f} s)")
            if job.members and not job.live():
                self._end_job(job, "every rank left or lost its lease")
                continue
            for name in list(job.barriers):
                self._try_release(job, name, now)

    # ---------------------------------------------------------------- data plane
    def _data_loop(self):
        fd = self.sock.fileno()
        offload = udpio.offload_enabled()
        while not self._stop.is_set():
            if self._external is not None:
                self._external.serve(fd, 100, offload, offload)
                continue
            try:
                _, pending = self.mux.serve(fd, 100, offload, offload)
            except OSError:
                if self._stop.is_set():
                    return
                raise
            for job_id, data, addr in pending:      # datagrams of jobs a Python engine serves
                self._process_python(job_id, data, addr)

    def _process_python(self, job_id: int, data: bytes, addr) -> None:
        with self._lock:
            job = next((j for j in self.jobs.values() if j.config.job_id == job_id), None)
        try:
            out = job.engine.process(data, addr) if job is not None else []
        except Exception as exc:            # a bug must not end the data plane: counted and logged
            self._control["engine_errors"] += 1
            if self._control["engine_errors"] & (self._control["engine_errors"] - 1) == 0:   # 1, 2, 4, …
                log.exception("job %s: a datagram's handling failed (%d so far): %s", job_id,
                              self._control["engine_errors"], exc)
            return
        for pkt, dest in out:
            try:
                self.sock.sendto(pkt, dest)
            except OSError:
                pass

    # ---------------------------------------------------------------- control plane
    def _reply(self, ident, msg):
        self.ctl.send_multipart([ident, b"", control.encode(msg)])

    def _find_session(self, rank: int, session) -> tuple:
        """(job, member) holding `rank` with this session secret, or (None, None)."""
        for job in self.jobs.values():
            m = job.member(rank, session)
            if m is not None:
                return job, m
        return None, None

    def _member(self, msg: dict) -> tuple[Job, Member]:
        """The job and member a request speaks for; refuses a wrong or stale session."""
        rank = msg["worker_id"]
        job, m = self._find_session(rank, msg["session"])
        if m is None:
            raise control.CodedError(f"unknown session for rank {rank}: the job it belonged to has "
                                     f"ended or this PS restarted", "unknown_session",
                                     incarnation=self.incarnation)
        if m.state == "dead":
            raise control.CodedError(
                f"rank {rank} lost its lease in job {job.number} (no heartbeat for "
                f"{m.died - m.last_seen:.1f} s, lease {self.lease_s:g} s); register again with "
                f"rejoin and catch up", "lease_expired", job_number=job.number)
        if m.state != "live":
            raise control.ControlError(f"rank {rank} is {m.state} in job {job.number}")
        return job, m

    def _register(self, ident, msg: dict, peer: str) -> dict:
        rank, (ip, port) = msg["worker_id"], msg["data_addr"]
        socket.inet_aton(ip)                       # a dotted IPv4 address, or OSError → error reply
        expect = msg.get("expect", {})
        name = msg.get("job_name", DEFAULT_JOB_NAME)
        # the same worker again (a lost reply, a rejoin after its lease ran out), else the job
        # of that name: one name, one job (a stated configuration that disagrees is refused
        # below, naming the fields); else a new job
        job, _ = self._find_session(rank, msg.get("session"))
        job = job or next((j for j in self.jobs.values() if j.name == name), None)
        launch = msg.get("launch", "")
        queued = self.queue.get(name) if job is None else None
        held = job.launch if job is not None else (queued.launch if queued is not None else "")
        if launch and held and launch != held:
            raise control.ControlError(
                f"job {name!r} on this PS belongs to another launch (its ranks registered with launch "
                f"token {held!r}, this rank with {launch!r}): two torchrun jobs cannot share one job "
                f"name; give this one another job_name")
        if msg.get("rejoin") and (job is None or rank not in job.members):
            raise control.ControlError(f"no running job to rejoin as rank {rank} (job {name!r} ended, "
                                       f"or the rank never joined it)")
        if job is None:
            if self.draining:
                if name in self._drain_queued:
                    self._drain_queued[name] = True
                raise control.CodedError(
                    f"this PS is draining (it admits no new job and stops once its running jobs end), "
                    f"so job {name!r} cannot start{' (it was queued)' if name in self._drain_queued else ''}: "
                    f"use another PS, or this one once it is back", "draining")
            if self.fixed_job is not None:
                config = self.fixed_job
            elif queued is not None and queued.config is not None:
                config = queued.config          # the queued job of that name starts as first proposed
            elif "job" in msg:
                config = JobConfig.from_msg(msg["job"])
            else:
                raise control.ControlError(NO_JOB_PROPOSED)
            diffs = config.differences(expect)
            if diffs:
                raise control.ControlError(
                    (f"job {name!r} is queued with another configuration (one name, one job): "
                     if queued is not None and self.fixed_job is None else "job configuration differs: ")
                    + "; ".join(diffs))
            if not 0 <= rank < config.num_workers:
                raise control.ControlError(f"rank {rank} out of range 0..{config.num_workers - 1}")
            self._check_group(config)
            job = self._admit(name, config, rank, launch)
        else:
            diffs = job.config.differences(expect)     # a proposal matters only to start a job
            if diffs:
                raise control.ControlError(f"{job.label()} is running with another configuration (one name, "
                                           f"one job: pick another job name, or state its configuration): "
                                           + "; ".join(diffs))
            if not 0 <= rank < job.config.num_workers:
                raise control.ControlError(f"rank {rank} out of range 0..{job.config.num_workers - 1}")
        now = time.monotonic()
        old = job.members.get(rank)
        # the same live registration again (a lost reply); a dead one's session rejoins
        same = old is not None and old.state == "live" and job.member(rank, msg.get("session")) is old
        if old is not None and old.state == "live" and not same:
            raise control.ControlError(f"rank {rank} is held by a live worker in {job.label()} "
                                       f"(heard from {now - old.last_seen:.1f} s ago); pick another "
                                       f"rank or job name, or wait {self.lease_s:g} s after that "
                                       f"worker stopped")
        rejoin = old is not None and not same
        token = self._external.fixed_tokens.get(rank) if self._external else None
        token = secrets.randbits(32) if token is None else token
        session = secrets.token_bytes(control.SESSION_BYTES)
        m = Member(rank, (ip, port), token, session, now, joining=rejoin)
        job.members[rank] = m
        job.engine.register(rank, ip, port, token)
        self._control["registrations"] += 1
        job.counters["registrations"] += 1
        if rejoin:
            self._control["rejoins"] += 1
            job.counters["rejoins"] += 1
        self.log(f"job {job.number}: {'re' if rejoin else ''}registered rank {rank} at {ip}:{port}"
                 f" (control peer {peer or '?'})")
        return {"type": "config", "job": job.config.to_msg(), "nonce": job.nonce, "token": token,
                "session": session, "job_number": job.number, "job_name": job.name,
                "lease_s": self.lease_s, "data_port": self.data_addr[1], "rejoin": rejoin,
                "incarnation": self.incarnation}

    def job_status(self, job: Job, now: float) -> dict:
        """One job as the status reply shows it (its workers, region, rounds, counters)."""
        doc = {"job_number": job.number, "job_name": job.name, "job_id": job.config.job_id,
               "codec": job.config.codec, "num_workers": job.config.num_workers, "live": job.live(),
               "missing": job.missing(now, self.rejoin_grace_s),
               "progress": {str(r): m.progress for r, m in job.members.items() if m.state == "live"},
               "barriers": {name: sorted(arrived) for name, arrived in job.barriers.items()},
               "sync_source": job.sync_source(), "age_s": now - job.started,
               "region": {"base": job.region.base, "data": job.region.data, "norm": job.region.norm}}
        stalled = job.stalled(now, self.rejoin_grace_s)
        if stalled:
            doc["stalled"] = stalled
        return doc

    def status(self, job: Job | None = None) -> dict:
        """The status reply.  To a rank (heartbeat, or status with its session): its job.
        To anyone else: the only running job's fields at the top level, if one runs, and every
        running and queued job under `jobs` / `queued` (with each job's counters)."""
        now = time.monotonic()
        with self._lock:
            jobs = sorted(self.jobs.values(), key=lambda j: j.number)
            doc = {"type": "status", "job_number": None, "incarnation": self.incarnation,
                   "rejoin_grace_s": self.rejoin_grace_s}
            if job is not None:             # a rank asking: its job, nothing of the others
                doc.update(self.job_status(job, now))
                return doc
            if len(jobs) == 1:
                doc.update(self.job_status(jobs[0], now))
            doc["slot_space"] = self.space_size
            doc["slots_free"] = self.space_size - sum(j.region.size for j in jobs)
            doc["jobs"] = [{**self.job_status(j, now), "stats": j.engine.stats()} for j in jobs]
            doc["queued"] = [{"job_name": q.name, "slots": q.data + q.norm, "waiting_s": now - q.since,
                              "ranks": sorted(q.ranks)} for q in self.queue.values()]
            doc["draining"] = self.draining
            return doc

    def _try_release(self, job: Job, name: str, now: float) -> None:
        arrived = job.barriers.get(name, {})
        live = job.live()
        everyone = len(job.members) == job.config.num_workers
        if everyone and live and set(live) <= set(arrived) and len(live) >= job.config.quorum_count:
            for ident in job.barriers.pop(name).values():
                self._reply(ident, {"type": "ok"})
            job.released = (job.released + [name])[-64:]
            return
        stalled = job.stalled(now, self.rejoin_grace_s)
        if stalled:
            why = f"barrier {name!r} cannot complete: {stalled}"
            for ident in job.barriers.pop(name).values():
                self._reply(ident, control.error(why, "job_stalled"))

    def _handle(self, ident, msg: dict, peer: str):
        kind = control.validate(msg)["type"]
        if kind == "register":
            try:
                reply = self._register(ident, msg, peer)
            except control.CodedError as exc:
                if exc.code != "queued":
                    self._control["registrations_refused"] += 1
                raise
            except Exception:
                self._control["registrations_refused"] += 1
                raise
            return reply
        if kind in ("status", "stats", "shutdown", "drain"):
            return self._handle_ps(kind, msg, peer)
        job, m = self._member(msg)
        m.last_seen = time.monotonic()
        if kind == "heartbeat":
            m.progress = msg.get("progress", m.progress)
            return self.status(job)
        if kind == "leave":
            m.state = "left"
            self._unregister(job, m.rank)
            if not job.live():
                self._end_job(job, "every rank left")
            else:
                for name in list(job.barriers):
                    self._try_release(job, name, time.monotonic())
            return {"type": "ok"}
        if kind == "barrier":
            if msg["name"] in job.released:         # a rank that rejoined after it was released
                return {"type": "ok"}
            job.barriers.setdefault(msg["name"], {})[m.rank] = ident
            self._try_resume(job)           # a rank that never saw the old PS: at phase 0
            self._try_release(job, msg["name"], time.monotonic())
            return None
        if kind == "sync_put":
            source = job.sync_source()
            if m.rank != source:
                raise control.ControlError(f"rank {m.rank} is not the model-sync source (rank {source} is)")
            job.sync = {msg["round"]: msg["blob"]}
            for w, rank in job.sync_waiters.pop(msg["round"], []):
                job.members[rank].joining = False
                self._reply(w, {"type": "sync", "blob": msg["blob"]})
            return {"type": "ok"}
        if kind == "sync_get":
            if msg["round"] in job.sync:
                m.joining = False
                return {"type": "sync", "blob": job.sync[msg["round"]]}
            job.sync_waiters.setdefault(msg["round"], []).append((ident, m.rank))
            return None
        if kind == "resume":
            job.resume[m.rank] = msg["phase"]
            job.resume_waiters[m.rank] = ident
            self._try_resume(job)
            return None
        raise control.ControlError(f"unhandled control message type {kind!r}")

    def _try_resume(self, job: Job) -> None:
        """Answer the ranks' `resume` {phase, max_phase} once every rank of the job asked, or
        waits in barrier "start": a rank whose first registration reached this PS only (it
        crossed the restart) knows of no restart and has completed no phase (phase 0)."""
        if not job.resume:
            return
        starting = [r for r in job.barriers.get("start", {}) if r not in job.resume]
        if len(job.resume) + len(starting) < job.config.num_workers:
            return
        phases = list(job.resume.values()) + [0] * len(starting)
        reply = {"type": "resume", "phase": min(phases), "max_phase": max(phases)}
        for w in job.resume_waiters.values():
            self._reply(w, reply)
        job.resume.clear()
        job.resume_waiters.clear()

    def _handle_ps(self, kind: str, msg: dict, peer: str) -> dict:
        """The requests about the PS rather than a rank's job: status, stats, shutdown, drain."""
        if kind == "status":
            if "session" in msg:            # a worker asking about its own job
                control.require(msg, "worker_id")
                job, _ = self._member(msg)
                return self.status(job)
            return self.status()
        if kind == "stats":
            return {"type": "stats", "stats": self.stats()}
        if self._auth is None and not peer.startswith("127."):
            raise control.ControlError(f"{kind} is accepted only from this host when the PS runs without keys")
        if kind == "drain":
            self.drain(f"a drain request from {peer or 'a control peer'}")
        else:
            self._stop.set()
        return {"type": "ok"}

    def _control_loop(self):
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        last_check = 0.0
        self._mark = time.monotonic()
        while not self._stop.is_set():
            events = dict(poller.poll(int(POLL_S * 1000)))
            for line in self._watch.problems() if self._watch is not None else ():
                self.log(f"WARNING: {line}")
            with self._lock:
                self._account()                 # the poll, and the previous request's reply
                if time.monotonic() - last_check > 0.1:
                    last_check = time.monotonic()
                    self._check_leases()
                    self._drained()                 # after the drain request's reply
                if not events:
                    continue
                try:
                    frames = self.ctl.recv_multipart(copy=False)
                except zmq.ZMQError:
                    continue
                ident, body = frames[0].bytes, frames[-1]
                try:
                    peer = body.get("Peer-Address") or ""
                except (zmq.ZMQError, AttributeError):
                    peer = ""
                try:
                    reply = self._handle(ident, control.decode(body.bytes), peer)
                except Exception as exc:        # every failure is answered; the loop goes on
                    self._control["control_errors"] += 1
                    reply = control.error_from(exc)
                # a request that kept the loop busy (a switch), or one of a backlog
                self._account(stalled=False, behind=bool(self.ctl.getsockopt(zmq.EVENTS) & zmq.POLLIN))
                if reply is not None:
                    try:
                        self._reply(ident, reply)
                    except zmq.ZMQError:
                        pass
        time.sleep(0.05)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> PSServer:
        for fn in (self._data_loop, self._control_loop):
            t = threading.Thread(target=fn, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stats(self) -> dict:
        """Lifetime counters (every job so far, the running ones included, and the datagrams no
        job received) and control counters."""
        with self._lock:
            total = {"drops": dict(self._totals["drops"])}
            _add_stats(total, {k: v for k, v in self._totals.items() if k != "drops"})
            _add_stats(total, self.mux.stats())         # what no job owns
            for job in self.jobs.values():
                _add_stats(total, job.engine.stats())
            if self.jobs:
                total["job_number"] = max(self.jobs)
            total["jobs_running"] = len(self.jobs)
            total["jobs_queued"] = len(self.queue)
            total.update(self._control)
            return total

    def drain(self, why: str = "drain") -> None:
        """Stop admitting jobs: a registration that would start or queue one is refused with
        code `draining` (the jobs queued now are told so when their workers ask again); the
        running jobs go on, and once the last one ends (and the queued ones were told, or
        stopped asking) the PS stops (`wait` returns)."""
        with self._lock:
            if self.draining:
                return
            self.draining, self._drain_since = True, time.monotonic()
            self._drain_queued = dict.fromkeys(self.queue, False)
            self.queue.clear()
            self.log(f"draining ({why}): no new job is admitted; {len(self.jobs)} running job(s) go on"
                     + (f", queued job(s) {', '.join(map(repr, self._drain_queued))} are told to stop"
                        if self._drain_queued else "") + "; the PS stops when they end")
        self._drained()

    def _drained(self) -> None:
        """While draining: stop once no job runs and every job queued at the drain was told so
        (its workers ask every half second; one that stopped asking leaves after QUEUE_FORGET_S)."""
        if not self.draining or self._stop.is_set():
            return
        with self._lock:
            told = all(self._drain_queued.values()) or \
                time.monotonic() - self._drain_since > QUEUE_FORGET_S
            if not self.jobs and told:
                self.log("drained: every job has ended; the PS stops")
                self._stop.set()

    def serving(self) -> bool:
        """Whether both planes are up: started, not stopped, and their threads alive."""
        return bool(self._threads) and not self._stop.is_set() and all(t.is_alive() for t in self._threads)

    def snapshot(self) -> dict:
        """Everything the metrics show, read at once: the lifetime `stats`, the C engines'
        socket counters (`io`: ended jobs', the running ones' and what no job received), and
        each running job's name, counters, socket counters and ranks."""
        with self._lock:
            io = dict(self._io)
            _add_stats(io, _io_stats(self.mux))
            jobs = []
            for job in sorted(self.jobs.values(), key=lambda j: j.number):
                jio = _io_stats(job.engine)
                _add_stats(io, jio)
                jobs.append({"name": job.name, "number": job.number, "stats": job.engine.stats(),
                             "control": dict(job.counters), "io": jio, "live": len(job.live()),
                             "num_workers": job.config.num_workers})
            return {"stats": self.stats(), "io": io, "jobs": jobs, "draining": self.draining,
                    "serving": self.serving()}

    def wait(self, timeout: float | None = None) -> bool:
        return self._stop.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        if self._watch is not None:
            self._watch.close()
        self.ctl.close(0)
        self.sock.close()
        if self._auth is not None:
            self._auth.stop()


def _io_stats(engine) -> dict:
    """The C engine's (or Mux's) socket batching counters; {} for engines without them."""
    io_stats = getattr(engine, "io_stats", None)
    return {k: v for k, v in io_stats().items() if not isinstance(v, bool)} if io_stats else {}


def _log_event(message: str) -> None:
    """The default sink of PSServer's event lines: the module logger, WARNING lines as warnings."""
    if message.startswith("WARNING: "):
        log.warning(message[len("WARNING: "):])
    else:
        log.info(message)


# -------------------------------------------------------------------- keys (CURVE)
def _curve_server(ctx, sock, keys: Path):
    """Make `sock` a CURVE server with keys/server.key_secret; accept the client public keys
    in keys/authorized/ (ZeroMQ's ZAP handler in a thread)."""
    import zmq.auth
    from zmq.auth.thread import ThreadAuthenticator
    secret = keys / "server.key_secret"
    authorized = keys / "authorized"
    if not secret.is_file() or not authorized.is_dir():
        raise ValueError(f"{keys} is not a key directory (no server.key_secret or authorized/); "
                         f"make one with `thc keys {keys}`")
    public, private = zmq.auth.load_certificate(str(secret))
    if private is None:
        raise ValueError(f"{secret} holds no secret key")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(authorized))
    sock.curve_secretkey = private
    sock.curve_publickey = public
    sock.curve_server = True
    return auth
