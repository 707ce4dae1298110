"""The worker's session with the PS: the control plane of one rank.

Registration with every shard (the job, a nonce and token per shard, a session id), a
heartbeat thread that renews the lease and learns who the job waits for, the lease's
lapse and rejoining, a restarted PS (resume), barriers, leaving, and the control calls
with the errors that name why a job cannot go on (PSUnavailable, Queued, JobStalled,
LeaseLost, JobEnded).  The data phases (worker/phases.py) see a session through the
narrow interface `phases.PhaseSession` describes.
"""
from __future__ import annotations

import logging
import threading
import time

import zmq

from thc_ps.proto import control
from thc_ps.proto.job import JobConfig
from thc_ps.proto.keys import HandshakeWatch

#: How long a worker waits for a PS that answers nothing (no heartbeat reply, no result)
#: before it gives up: a restarted PS, or one that stalled (a VM pause, swap, a long GC),
#: comes back within it and the job goes on (`--ps-wait-s`; docs/protocol.md §7).
DEFAULT_PS_WAIT_S = 60.0
#: A PS whose latest heartbeat has gone unanswered this long is the one a worker names as
#: what it waits for (heartbeats go every lease_s / 5 and are answered within milliseconds).
PS_SILENT_NAMED_S = 1.0
#: The heartbeat thread looks at an unanswered heartbeat this often: how long the PS has been
#: silent is known to this precision, and so is when a worker gives up on it (ps_wait_s).
HB_SLICE_S = 0.1
#: Control requests a PS restart interrupts without loss: the worker resumes the data plane
#: with the other ranks and asks the new PS again (a model sync runs again from its start).
RESUMABLE = ("barrier", "sync_put", "sync_get", "status")
log = logging.getLogger(__name__)


class PSUnavailable(RuntimeError):
    """The PS did not answer within the retry budget."""


class Queued(ValueError):
    """The PS queued this rank's job: its slot space is full (the message says what holds it)."""


class Draining(RuntimeError):
    """The PS is draining (its operator is taking it out of service): it admits no new job,
    so this rank's job, new or queued, will not start there."""


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


class Session:
    """One rank's membership of a job on one PS or on S shards.

    `shards` is [(host, data_port, control_port[, control_host]), ...]: the control plane of
    shard i answers at control_host (default host) : control_port; its data plane at
    (host, data_port).  `data_addr` is where this rank's data socket receives (sent with
    the registration, so the PS knows where results go).  See `Transport` for the other
    arguments.  Registration happens here; the heartbeat starts with `start_heartbeat`.

    State the heartbeat thread writes (`status`, the membership flags) is read by the
    thread that runs phases and control calls; registration replaces a shard's session
    under a lock, so a heartbeat answered for the old session is not taken for the new."""

    def __init__(self, shards: list, worker_id: int, data_addr: tuple, *, control_timeout_s: float = 30.0,
                 keys=None, expect: dict | None = None, propose: JobConfig | None = None,
                 job_name: str | None = None, queue_s: float = 600.0, rejoin: bool = False,
                 ps_wait_s: float = DEFAULT_PS_WAIT_S, launch: str | None = None):
        self.worker_id = worker_id
        self.launch = launch
        self.data_addr = tuple(data_addr)
        self.shard_addrs = [(sh[0], int(sh[1])) for sh in shards]
        self._ctx = zmq.Context.instance()
        self._ctl: dict = {}
        self._watch: dict = {}              # shard -> HandshakeWatch of its control socket
        self._endpoints = [f"tcp://{sh[3] if len(sh) > 3 else sh[0]}:{sh[2] or sh[1] + 1}" for sh in shards]
        self._control_timeout = control_timeout_s
        self._curve = None
        if keys is not None:
            from thc_ps.proto.keys import client_keys
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
        self._ps_silent = [0.0] * len(shards)   # how long it has been silent, while a heartbeat is unanswered
        self._hb_pending = [False] * len(shards)    # a heartbeat to the shard awaits its reply
        self._restarted: set = set()
        self._lease_lost: set = set()       # shards that answered lease_expired
        self._job_gone: str | None = None   # why the PS no longer knows our job (it ended)
        self._session_lock = threading.Lock()
        self._hb_stop = threading.Event()
        self._hb_thread = None
        jobs = [self.register(i) for i in range(len(shards))]
        self.job = _common_job(jobs)
        self.rejoined = any(s["rejoin"] for s in self.sessions)

    @property
    def shard_addrs(self) -> list:
        """The data address (ip, port) of each shard."""
        return self._shard_addrs

    @shard_addrs.setter
    def shard_addrs(self, addrs: list) -> None:
        self._shard_addrs = list(addrs)
        self._by_addr = {a: i for i, a in enumerate(self._shard_addrs)}

    def shard_of(self, addr) -> int | None:
        """The shard whose data address `addr` is (None: not a shard of this job)."""
        return self._by_addr.get(addr)

    def ids(self, shard: int) -> tuple:
        """(nonce, token) this rank's packets to `shard` carry (they change when it registers again)."""
        sess = self.sessions[shard]
        return sess["nonce"], sess["token"]

    @property
    def ps_restarted(self) -> bool:
        """Whether the heartbeats found a shard restarted (`check_membership` raises it)."""
        return bool(self._restarted)

    def start_heartbeat(self) -> None:
        """Renew this rank's lease from a thread of its own until `close`."""
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                           name=f"thc-heartbeat-{self.worker_id}")
        self._hb_thread.start()

    # ---------------------------------------------------------------- membership
    def register(self, shard: int, rejoin: bool = False) -> JobConfig:
        """Register (again) with one shard; keeps its nonce, token and session.  `rejoin`:
        as a rank whose lease expired, into the running job it held a place in."""
        msg = {"type": "register", "worker_id": self.worker_id, "data_addr": list(self.data_addr)}
        if self.job_name is not None:
            msg["job_name"] = self.job_name
        if self.launch:
            msg["launch"] = self.launch
        if self._expect:
            msg["expect"] = self._expect
        if self._propose is not None or self.job is not None:
            # the job again after a PS restart: a PS started without job options knows it from
            # whichever rank registers first (docs/protocol.md §7)
            msg["job"] = (self._propose or self.job).to_msg()
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
            self._hb_pending[shard] = False
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
        packet header (the Python and the C phase alike) takes the id from `job` when it is
        built, and a received packet is checked against it; the phase engine sizes its slot
        rounds to the new region when it goes on (`PhaseEngine.fit_job`)."""
        log.warning("worker %d: job %r is job id %d on the PS now (was %d)", self.worker_id,
                    self.job_name or "default", job.job_id, self.job.job_id)
        self.job = job

    def _heartbeat_loop(self) -> None:
        """Renew the lease of every shard a few times per lease; keep the status replies."""
        socks: dict = {}
        clock = [time.monotonic()]           # the latest silence tick (_tick)
        while not self._pause(max(0.05, min(s["lease_s"] for s in self.sessions) / 5), clock):
            for shard, sess in enumerate(self.sessions):
                msg = {"type": "heartbeat", "worker_id": self.worker_id, "session": sess["session"]}
                if self.progress >= 0:
                    msg["progress"] = int(self.progress)
                sock = socks.get(shard)
                if sock is None:
                    sock = socks[shard] = self._socket(shard)
                self._hb_pending[shard] = True
                try:
                    sock.send(control.encode(msg))
                    reply = control.decode(sock.recv()) if self._await_heartbeat(sock, sess["lease_s"], clock) \
                        else None
                except zmq.ZMQError:
                    reply = None
                if reply is None:               # unanswered: the next heartbeat asks on a new socket
                    sock.close(0)
                    del socks[shard]
                    continue
                self._hb_pending[shard] = False
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

    def _tick(self, clock: list) -> None:
        """Bring `_ps_silent` up to date: how long each shard with an unanswered heartbeat has
        been silent (since its latest reply of any kind), to HB_SLICE_S, so a worker gives up
        on a silent PS after ps_wait_s to the slice.  A tick that comes far later than the
        slice means this process was stopped (SIGSTOP, swap), not the PS silent: the time it
        overran is not counted against any shard."""
        now = time.monotonic()
        if now - clock[0] > HB_SLICE_S + 1.0:
            for shard in range(len(self._ps_heard)):
                self._ps_heard[shard] += now - clock[0] - HB_SLICE_S
        clock[0] = now
        for shard, pending in enumerate(self._hb_pending):
            if pending:
                self._ps_silent[shard] = max(0.0, now - self._ps_heard[shard])

    def _pause(self, seconds: float, clock: list) -> bool:
        """Wait `seconds` between heartbeats, ticking the silence; True once the heartbeat stops."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self._hb_stop.wait(min(HB_SLICE_S, left)):
                return True
            self._tick(clock)
        return self._hb_stop.is_set()

    def _await_heartbeat(self, sock, lease_s: float, clock: list) -> bool:
        """Whether the heartbeat just sent on `sock` is answered within lease_s; polled in slices
        of HB_SLICE_S, ticking the silence (`_tick`) meanwhile."""
        end = time.monotonic() + lease_s
        while not self._hb_stop.is_set():
            if sock.poll(int(HB_SLICE_S * 1000)):
                return True
            self._tick(clock)
            if time.monotonic() >= end:
                return False
        return False

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
        raise PSUnavailable(f"the PS at {self._endpoints[shard]} answered nothing for {silent:.1f} s "
                            f"(no heartbeat reply{', ' + during if during else ''}); a worker waits "
                            f"ps_wait_s = {self.ps_wait_s:g} s for a restarted or stalled PS to come "
                            f"back (--ps-wait-s)")

    def _membership_error(self, shard: int, sess: dict, reply: dict) -> None:
        """A heartbeat refused: note what happened to this rank's membership (the data-plane
        and control waits act on it: `check_membership`)."""
        code = reply.get("code")
        if code == "lease_expired":
            self._lease_lost.add(shard)
        elif code == "unknown_session":
            if reply.get("incarnation") != sess.get("incarnation"):
                self._restarted.add(shard)          # a new PS process: resume
            else:
                self._job_gone = (f"job {sess.get('job_number')} ended while rank "
                                  f"{self.worker_id} was away: {reply.get('message')}")

    def check_membership(self) -> None:
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
        """After `LeaseLost`: register again with every shard as a rejoining rank (new token
        and session).  Raises JobEnded when the job ended meanwhile.  (`Transport.rejoin`
        also starts the data plane afresh.)"""
        for shard in range(len(self.sessions)):
            try:
                self.register(shard, rejoin=True)
            except ValueError as exc:
                if "no running job to rejoin" in str(exc):
                    raise JobEnded(f"rank {self.worker_id}'s job ended while it was away") from None
                raise
        self._lease_lost.clear()
        self.status = [None] * len(self.sessions)
        self.rejoined = True

    def silent_ps(self) -> str:
        """The PS (shard) that has left a heartbeat unanswered for PS_SILENT_NAMED_S or more,
        as text naming it and how long; '' when every shard answers."""
        silent = max(self._ps_silent)
        if not self._watching() or silent < PS_SILENT_NAMED_S:
            return ""
        shard = self._ps_silent.index(silent)
        return (f"the PS at {self._endpoints[shard]} (no reply to heartbeats for {silent:.1f} s: stopped, "
                f"restarting or cut off; a worker waits ps_wait_s = {self.ps_wait_s:g} s for it)")

    def waiting_for(self) -> str:
        """What the job waits for: a silent PS, else the ranks the latest heartbeat reply shows
        missing; '' if nothing is known missing.  A silent PS comes first: the status it sent
        before it fell silent is stale, and its ranks wait for it as this one does."""
        silent_ps = self.silent_ps()
        if silent_ps:
            return silent_ps
        st = self.status[0]
        silent = time.monotonic() - self._hb_ok[0]
        if self.sessions[0] and silent > 2 * self.sessions[0]["lease_s"]:
            return f"the PS control plane at {self._endpoints[0]} (no heartbeat reply for {silent:.0f} s)"
        if st and st.get("missing"):
            return control.describe_missing(st["missing"])
        return ""

    def late(self) -> str:
        """Whom a worker whose results are late waits for: missing ranks, live ranks behind it,
        or the PS (a rank that died is reported missing once its lease runs out)."""
        return self.waiting_for() or control.describe_behind(self.status[0], self.worker_id, self.progress) or \
            "the PS (no rank is reported missing or behind; a rank that died is, once its lease runs out)"

    def is_sync_source(self) -> bool:
        """Whether this rank publishes model-sync state (the lowest live rank)."""
        return self.call({"type": "status"}).get("sync_source") == self.worker_id

    def resume(self, shard: int, phase: int) -> dict:
        """After a PS restart (`check_membership` raised for `shard`): register with it again
        and tell it the phase this rank is at; the reply (once every rank asked) says where
        the ranks go on: `phase`, the least any rank reached, and `max_phase`, the greatest."""
        self._restarted.discard(shard)
        self.register(shard)
        return self.call({"type": "resume", "phase": int(phase)}, shard=shard, wait=True)

    def others_step(self) -> int:
        """The step the other live ranks of the job are on (the PS's status), for a rank that
        joins late: a restarted one, or one whose lease expired while it was paused."""
        status = self.call({"type": "status"})
        others = [v for k, v in status.get("progress", {}).items() if int(k) != self.worker_id and v >= 0]
        return max(others, default=0)

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
                self.check_membership()
            if code == "unknown_session" and self.sessions[shard] is not None:
                self._membership_error(shard, self.sessions[shard], reply)
                if self._job_gone:
                    raise JobEnded(self._job_gone)
                if shard in self._restarted and msg["type"] in RESUMABLE:
                    raise _PSRestarted(shard)
            if code == "job_stalled":
                raise JobStalled(f"PS refused {msg['type']}: {reply.get('message')}")
            if code == "queued":
                raise Queued(reply.get("message"))
            if code == "draining":
                raise Draining(f"PS refused {msg['type']}: {reply.get('message')}")
            raise ValueError(f"PS refused {msg['type']}: {reply.get('message')}")
        return reply

    def _await_reply(self, sock, msg: dict, shard: int, wait: bool) -> dict:
        """The reply to the request just sent on `sock` (see `call` for the bounds); `call`
        drops the socket when this raises."""
        start = time.monotonic()
        while not sock.poll(int(min(HB_SLICE_S * 2, self._control_timeout) * 1000)):
            waited = time.monotonic() - start
            watching = self._watching()
            if watching:                # a PS silent to heartbeats too is waited for up to ps_wait_s
                self._check_ps_silence(f"{msg['type']} unanswered for {waited:.0f} s")
                if shard in self._restarted:        # the request went to the PS process that died
                    if msg["type"] in RESUMABLE:
                        raise _PSRestarted(shard)   # the caller resumes and asks the new PS
                    if wait:
                        raise PSUnavailable(f"the PS at {self._endpoints[shard]} restarted during "
                                            f"{msg['type']}; a job resumes its data-plane phases, barriers "
                                            f"and model syncs only")
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
                self.check_membership()
            missing = (self.status[shard] or {}).get("missing") or []
            never = [m for m in missing if m["why"] == "never registered"]
            if never and waited > self._control_timeout:
                raise JobStalled(f"{msg['type']} {msg.get('name', '')} not done after {waited:.0f} s: "
                                 f"waiting for {control.describe_missing(never)}".replace("  ", " "))
        return control.decode(sock.recv())

    def barrier(self, name: str) -> None:
        """Wait until every live rank of the job reached `name` (a PS that restarts meanwhile
        raises _PSRestarted: `Transport.barrier` resumes the data plane and asks again)."""
        self.call({"type": "barrier", "name": name}, wait=True)

    def _drop_socket(self, shard: int) -> None:
        sock = self._ctl.pop(shard, None)
        if sock is not None:
            self._watch.pop(shard).close()
            sock.close(0)

    def leave(self) -> None:
        """Tell every shard this rank is done (best effort; not a shard given up as silent past
        ps_wait_s: the worker does not wait on it again): the job ends when all have left."""
        for shard, sess in enumerate(self.sessions):
            if sess is None or self._ps_silent[shard] > self.ps_wait_s:
                continue            # given up as silent: it would not answer either; the lease runs out
            try:
                self._control_timeout, saved = 2.0, self._control_timeout
                try:
                    self.call({"type": "leave"}, shard=shard)
                finally:
                    self._control_timeout = saved
            except (PSUnavailable, ValueError, RuntimeError, zmq.ZMQError):
                pass

    def close(self, leave: bool = True) -> None:
        """Stop the heartbeat, leave the job (`leave`), close the control sockets."""
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        if leave:
            self.leave()
        for shard in list(self._ctl):
            self._drop_socket(shard)

    def give_up(self, what: str, dest, tries: int) -> None:
        """After max_retries: raise the error that names the real cause (missing ranks, or an
        unreachable PS), or return to go on waiting while a missing rank may still rejoin
        (the PS reports it within its rejoin grace; once it is past the grace the PS reports
        the job stalled and `check_membership` raises JobStalled naming it), or while the PS
        answers no heartbeat either (it may be restarting or stalled: `_check_ps_silence`
        gives up after ps_wait_s)."""
        self.check_membership()
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
