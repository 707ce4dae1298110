"""The software PS process: a UDP data plane (C engine by default) and a ZeroMQ control plane.

Python only does control; the data thread spends its time inside `Engine.serve`, which
releases the GIL.  One process serves many jobs, one after the other:

* A **job** starts when the first worker registers while none is running.  Its
  configuration is the one the PS was started with (`thc ps --workers …`), or, for a PS
  started without one, the job the first worker proposes.  It gets a fresh engine (clean
  slots), a random 32-bit nonce that every data packet must carry, and its own barriers and
  model-sync state.  It ends when every rank has left or lost its lease; nothing of it
  reaches the next job.
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

import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from proto import control
from proto import headers as H
from proto import udpio
from proto.job import JobConfig
from proto.sockets import set_buffer
from ps_server.engine import Engine, ExternalEngine
from ps_server.reference import DROP_REASONS, ReferencePS

log = logging.getLogger(__name__)

RCVBUF = 8 << 20
DEFAULT_LEASE_S = 5.0
#: A dead rank may be claimed again this long before barriers give up on it.
DEFAULT_REJOIN_GRACE_S = 30.0
JOIN_ROUND = (1 << 31) - 1


def make_engine(job: JobConfig, kind: str | ExternalEngine = "c", nonce: int = 0) -> Engine:
    """A fresh aggregation engine for one job: 'c' (hot path), 'python' (reference), or an
    ExternalEngine (e.g. p4.control.SwitchEngine) that is told about the new job."""
    if not isinstance(kind, str):
        kind.start_job(job, nonce)
        return kind
    if kind == "python" or job.blob:   # decode–sum–re-encode codecs run in Python
        return ReferencePS(job, nonce)
    if kind != "c":
        raise ValueError(f"engine must be 'c' or 'python', got {kind!r}")
    from ps_server._fastpath import Engine
    return Engine(job_id=job.job_id, num_workers=job.num_workers, slots=job.slots,
                  norm_slots=job.norm_slots, elems_per_packet=job.elems_per_packet,
                  bits=job.bits, lane_bits=job.lane_bits, op=job.op,
                  quorum_count=job.quorum_count, table=list(job.table) or [0], nonce=nonce)


def udp_socket(bind: tuple) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    set_buffer(sock, RCVBUF)
    set_buffer(sock, RCVBUF, send=True)
    udpio.set_gro(sock, udpio.offload_enabled())   # before traffic: batches coalesce from the start
    sock.bind(bind)
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
    members: dict = field(default_factory=dict)          # rank -> Member
    barriers: dict = field(default_factory=dict)         # name -> {rank: ident}
    released: list = field(default_factory=list)         # recent released barrier names
    sync: dict = field(default_factory=dict)             # round -> blob
    sync_waiters: dict = field(default_factory=dict)     # round -> [ident]
    resume: dict = field(default_factory=dict)           # rank -> phase (after a PS restart)
    resume_waiters: dict = field(default_factory=dict)   # rank -> ident
    started: float = field(default_factory=time.monotonic)

    def live(self) -> list:
        return sorted(r for r, m in self.members.items() if m.state == "live")

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


class PSServer:
    """One PS shard: `start()` returns once both planes listen; `stop()` joins everything.

    `job` fixes the job configuration every job on this PS must have (workers that expect
    otherwise are refused); None lets the first worker of each job propose it.
    """

    def __init__(self, job: JobConfig | None, bind: tuple = ("127.0.0.1", 9000),
                 control_port: int | None = None, engine="c", log=None, keys: str | Path | None = None,
                 lease_s: float = DEFAULT_LEASE_S, rejoin_grace_s: float = DEFAULT_REJOIN_GRACE_S,
                 max_message: int = control.DEFAULT_MAX_MESSAGE):
        self.fixed_job = job
        self.engine_kind = engine
        self._external = None if isinstance(engine, str) else engine    # an ExternalEngine
        self.lease_s = lease_s
        self.rejoin_grace_s = rejoin_grace_s
        self.sock = udp_socket(bind)
        self.data_addr = self.sock.getsockname()
        self._ctx = zmq.Context.instance()
        self._auth = None
        self.ctl = self._ctx.socket(zmq.ROUTER)
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.ctl.setsockopt(zmq.MAXMSGSIZE, max_message)
        if keys is not None:
            self._auth = _curve_server(self._ctx, self.ctl, Path(keys))
        cport = control_port if control_port is not None else self.data_addr[1] + 1
        self.ctl.bind(f"tcp://{bind[0]}:{cport}")
        self.control_port = int(self.ctl.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.RLock()
        self.job: Job | None = None
        self._jobs_started = 0
        self._totals: dict = {"drops": dict.fromkeys(DROP_REASONS, 0)}
        self._control = {"jobs_started": 0, "jobs_ended": 0, "registrations": 0,
                         "registrations_refused": 0, "control_errors": 0, "leases_expired": 0,
                         "rejoins": 0}
        self.incarnation = secrets.randbits(32)
        # event lines: to `log` when given (thc ps prints them), else this module's logger
        self.log = log or _log_event
        if keys is None and bind[0] in ("0.0.0.0", "::", ""):
            self.log("WARNING: control plane bound to every interface WITHOUT keys: anyone who "
                     "reaches it can join or stop jobs. Use --keys DIR (make them with `thc keys DIR`) "
                     "or bind a private address.")

    # ---------------------------------------------------------------- jobs
    @property
    def engine(self):
        return self.job.engine if self.job else None

    def _start_job(self, config: JobConfig) -> Job:
        self._jobs_started += 1
        # a switch programmed in advance (p4/harness/static_control.py) carries its own nonce
        nonce = self._external.fixed_nonce if self._external else None
        nonce = nonce or secrets.randbits(32)
        job = Job(self._jobs_started, config, nonce, make_engine(config, self.engine_kind, nonce))
        self._control["jobs_started"] += 1
        self.job = job
        self.log(f"job {job.number} started: n={config.num_workers}, codec={config.codec}, "
                 f"quorum={config.quorum}")
        return job

    def _end_job(self, why: str) -> None:
        job = self.job
        if job is None:
            return
        _add_stats(self._totals, job.engine.stats())
        for r in list(job.members):
            self._unregister(job, r)
        for waiters in ([[w for w, _ in ws] for ws in job.sync_waiters.values()]
                        + [list(b.values()) for b in job.barriers.values()]
                        + [list(job.resume_waiters.values())]):
            for ident in waiters:
                self._reply(ident, control.error(f"job {job.number} ended ({why})"))
        self._control["jobs_ended"] += 1
        self.log(f"job {job.number} ended: {why}")
        self.job = None

    def _unregister(self, job: Job, rank: int) -> None:
        job.engine.unregister(rank)

    def _check_leases(self) -> None:
        job = self.job
        if job is None:
            return
        now = time.monotonic()
        for m in job.members.values():
            if m.state == "live" and now - m.last_seen > self.lease_s:
                m.state, m.died = "dead", now
                self._control["leases_expired"] += 1
                self._unregister(job, m.rank)
                self.log(f"job {job.number}: rank {m.rank} lost its lease (no heartbeat for "
                         f"{now - m.last_seen:.1f} s)")
        if job.members and not job.live():
            self._end_job("every rank left or lost its lease")
            return
        for name in list(job.barriers):
            self._try_release(job, name, now)

    # ---------------------------------------------------------------- data plane
    def _data_loop(self):
        fd = self.sock.fileno()
        self.sock.settimeout(0.1)
        offload = udpio.offload_enabled()
        while not self._stop.is_set():
            job = self.job
            if job is not None:
                job.engine.serve(fd, 100, offload, offload)
                continue
            try:
                datagrams, addr = udpio.recv_datagrams(self.sock)
            except (TimeoutError, BlockingIOError, ConnectionRefusedError):
                continue
            except OSError:
                if self._stop.is_set():
                    return
                raise
            for data in datagrams:      # a GRO batch left queued by the C engine's socket option
                self._process_python(data, addr)

    def _process_python(self, data: bytes, addr) -> None:
        job = self.job                  # a job may have started while recvmsg waited
        engine = job.engine if job else None
        if engine is None:
            self._count_idle(data)
            return
        for pkt, dest in engine.process(data, addr):
            try:
                self.sock.sendto(pkt, dest)
            except OSError:
                pass

    def _count_idle(self, data: bytes) -> None:
        """A datagram while no job runs: counted under the reason a job would have dropped it."""
        try:
            H.parse(data)
            reason = "unknown_job"
        except H.PacketError as exc:
            reason = exc.reason
        with self._lock:
            t = self._totals
            t["packets_in"] = t.get("packets_in", 0) + 1
            t["bytes_in"] = t.get("bytes_in", 0) + len(data)
            t["drops"][reason] += 1

    # ---------------------------------------------------------------- control plane
    def _reply(self, ident, msg):
        self.ctl.send_multipart([ident, b"", control.encode(msg)])

    def _member(self, msg: dict) -> tuple[Job, Member]:
        """The job and member a request speaks for; refuses a wrong or stale session."""
        job = self.job
        rank = msg["worker_id"]
        m = job.members.get(rank) if job else None
        if m is None or not secrets.compare_digest(m.session, msg["session"]):
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
        job = self.job
        if msg.get("rejoin") and (job is None or rank not in job.members):
            raise control.ControlError(f"no running job to rejoin as rank {rank} (it ended, or the "
                                       f"rank never joined it)")
        if job is None:
            if self.fixed_job is not None:
                config = self.fixed_job
            elif "job" in msg:
                config = JobConfig.from_msg(msg["job"])
            else:
                raise control.ControlError("this PS has no job configured and the worker proposed none "
                                           "(pass the job's options to the worker, or start the PS with "
                                           "--workers and the job options)")
            diffs = config.differences(expect)
            if diffs:
                raise control.ControlError("job configuration differs: " + "; ".join(diffs))
            if not 0 <= rank < config.num_workers:
                raise control.ControlError(f"rank {rank} out of range 0..{config.num_workers - 1}")
            job = self._start_job(config)
        else:
            diffs = job.config.differences(expect)     # a proposal matters only to start a job
            if diffs:
                raise control.ControlError(f"job {job.number} is running with another configuration: "
                                           + "; ".join(diffs))
            if not 0 <= rank < job.config.num_workers:
                raise control.ControlError(f"rank {rank} out of range 0..{job.config.num_workers - 1}")
        now = time.monotonic()
        old = job.members.get(rank)
        # the same live registration again (a lost reply); a dead one's session rejoins
        same = old is not None and old.state == "live" and "session" in msg \
            and secrets.compare_digest(old.session, msg["session"])
        if old is not None and old.state == "live" and not same:
            raise control.ControlError(f"rank {rank} is held by a live worker in job {job.number} "
                                       f"(heard from {now - old.last_seen:.1f} s ago); pick another "
                                       f"rank, or wait {self.lease_s:g} s after that worker stopped")
        rejoin = old is not None and not same
        token = self._external.fixed_tokens.get(rank) if self._external else None
        token = secrets.randbits(32) if token is None else token
        session = secrets.token_bytes(control.SESSION_BYTES)
        m = Member(rank, (ip, port), token, session, now, joining=rejoin)
        job.members[rank] = m
        job.engine.register(rank, ip, port, token)
        self._control["registrations"] += 1
        if rejoin:
            self._control["rejoins"] += 1
        self.log(f"job {job.number}: {'re' if rejoin else ''}registered rank {rank} at {ip}:{port}"
                 f" (control peer {peer or '?'})")
        return {"type": "config", "job": job.config.to_msg(), "nonce": job.nonce, "token": token,
                "session": session, "job_number": job.number, "lease_s": self.lease_s,
                "data_port": self.data_addr[1], "rejoin": rejoin, "incarnation": self.incarnation}

    def status(self) -> dict:
        job = self.job
        now = time.monotonic()
        if job is None:
            return {"type": "status", "job_number": None, "incarnation": self.incarnation}
        live = job.live()
        doc = {"type": "status", "job_number": job.number, "incarnation": self.incarnation,
               "num_workers": job.config.num_workers, "live": live,
               "missing": job.missing(now, self.rejoin_grace_s),
               "progress": {str(r): m.progress for r, m in job.members.items() if m.state == "live"},
               "barriers": {name: sorted(arrived) for name, arrived in job.barriers.items()},
               "sync_source": job.sync_source(), "rejoin_grace_s": self.rejoin_grace_s,
               "age_s": now - job.started}
        stalled = job.stalled(now, self.rejoin_grace_s)
        if stalled:
            doc["stalled"] = stalled
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
            except Exception:
                self._control["registrations_refused"] += 1
                raise
            return reply
        if kind == "status":
            return self.status()
        if kind == "stats":
            return {"type": "stats", "stats": self.stats()}
        if kind == "shutdown":
            if self._auth is None and not peer.startswith("127."):
                raise control.ControlError("shutdown is accepted only from this host when the PS "
                                           "runs without keys")
            self._stop.set()
            return {"type": "ok"}
        job, m = self._member(msg)
        m.last_seen = time.monotonic()
        if kind == "heartbeat":
            m.progress = msg.get("progress", m.progress)
            return self.status()
        if kind == "leave":
            m.state = "left"
            self._unregister(job, m.rank)
            if not job.live():
                self._end_job("every rank left")
            else:
                for name in list(job.barriers):
                    self._try_release(job, name, time.monotonic())
            return {"type": "ok"}
        if kind == "barrier":
            if msg["name"] in job.released:         # a rank that rejoined after it was released
                return {"type": "ok"}
            job.barriers.setdefault(msg["name"], {})[m.rank] = ident
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
            if len(job.resume) == job.config.num_workers:
                reply = {"type": "resume", "phase": min(job.resume.values()),
                         "max_phase": max(job.resume.values())}
                for w in job.resume_waiters.values():
                    self._reply(w, reply)
                job.resume.clear()
                job.resume_waiters.clear()
            return None
        raise control.ControlError(f"unhandled control message type {kind!r}")

    def _control_loop(self):
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        last_check = 0.0
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            with self._lock:
                if time.monotonic() - last_check > 0.1:
                    last_check = time.monotonic()
                    self._check_leases()
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
        """Lifetime counters (every job so far, the current one included) and control counters."""
        with self._lock:
            total = {"drops": dict(self._totals["drops"])}
            _add_stats(total, {k: v for k, v in self._totals.items() if k != "drops"})
            if self.job is not None:
                _add_stats(total, self.job.engine.stats())
                total["job_number"] = self.job.number
            total.update(self._control)
            return total

    def wait(self, timeout: float | None = None) -> bool:
        return self._stop.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self.ctl.close(0)
        self.sock.close()
        if self._auth is not None:
            self._auth.stop()


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
