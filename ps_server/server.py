"""The software PS process: a UDP data plane (C engine by default) and a ZeroMQ control plane.

Python only does control: registration binds a worker id to the source address
its data packets must come from, stats, barriers, model-sync relay, shutdown.
The data thread spends its time inside `Engine.serve`, which releases the GIL.
"""
from __future__ import annotations

import socket
import threading
import time

import zmq

from proto import control
from proto.job import JobConfig
from ps_server.reference import ReferencePS

RCVBUF = 8 << 20


def make_engine(job: JobConfig, kind="c"):
    """The aggregation engine: 'c' (hot path), 'python' (reference), or an engine object
    (e.g. p4.control.SwitchEngine, when a switch aggregates and this process only controls)."""
    if not isinstance(kind, str):
        return kind
    if kind == "python" or job.blob:   # decode–sum–re-encode codecs run in Python
        return ReferencePS(job)
    if kind != "c":
        raise ValueError(f"engine must be 'c' or 'python', got {kind!r}")
    from ps_server._fastpath import Engine
    return Engine(job_id=job.job_id, num_workers=job.num_workers, slots=job.slots,
                  norm_slots=job.norm_slots, elems_per_packet=job.elems_per_packet,
                  bits=job.bits, lane_bits=job.lane_bits, op=job.op,
                  quorum_count=job.quorum_count, table=list(job.table) or [0])


def _stats(engine) -> dict:
    return engine.stats() if hasattr(engine, "stats") and callable(engine.stats) else engine.stats.as_dict()


def udp_socket(bind: tuple) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt, force in ((socket.SO_RCVBUF, 33), (socket.SO_SNDBUF, 32)):   # *BUFFORCE when root
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, RCVBUF)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, opt, RCVBUF)
    sock.bind(bind)
    return sock


class PSServer:
    """One PS shard: `start()` returns once both planes listen; `stop()` joins everything."""

    def __init__(self, job: JobConfig, bind: tuple = ("127.0.0.1", 9000), control_port: int | None = None,
                 engine: str = "c", log=None):
        self.job = job
        self.engine_kind = engine if isinstance(engine, str) else "external"
        if job.blob:
            self.engine_kind = "python"
        self.engine = make_engine(job, engine)
        self.sock = udp_socket(bind)
        self.data_addr = self.sock.getsockname()
        self._ctx = zmq.Context.instance()
        self.ctl = self._ctx.socket(zmq.ROUTER)
        self.ctl.setsockopt(zmq.LINGER, 0)
        cport = control_port if control_port is not None else self.data_addr[1] + 1
        self.ctl.bind(f"tcp://{bind[0]}:{cport}")
        self.control_port = int(self.ctl.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._barriers: dict = {}
        self._sync: dict = {}
        self._sync_waiters: dict = {}
        self.log = log or (lambda *a: None)

    # ---------------------------------------------------------------- data plane
    def _data_loop(self):
        fd = self.sock.fileno()
        if self.engine_kind in ("c", "external"):
            while not self._stop.is_set():
                self.engine.serve(fd, 100)
            return
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                data, addr = self.sock.recvfrom(65536)
            except (socket.timeout, BlockingIOError):
                continue
            except ConnectionRefusedError:
                continue
            for pkt, dest in self.engine.process(data, addr):
                try:
                    self.sock.sendto(pkt, dest)
                except OSError:
                    pass

    # ---------------------------------------------------------------- control plane
    def _reply(self, ident, msg):
        self.ctl.send_multipart([ident, b"", control.encode(msg)])

    def _handle(self, ident, msg: dict):
        kind = msg["type"]
        if kind == "register":
            control.require(msg, "worker_id", "data_addr")
            wid, addr = int(msg["worker_id"]), msg["data_addr"]
            if self.engine_kind == "python":
                self.engine.register(wid, (addr[0], int(addr[1])))
            else:
                self.engine.register(wid, addr[0], int(addr[1]))
            self.log(f"registered worker {wid} at {addr[0]}:{addr[1]}")
            return {"type": "config", "job": self.job.to_msg(), "data_port": self.data_addr[1]}
        if kind == "stats":
            return {"type": "stats", "stats": _stats(self.engine)}
        if kind == "barrier":
            control.require(msg, "name", "worker_id")
            waiting = self._barriers.setdefault(msg["name"], [])
            waiting.append(ident)
            if len(waiting) >= self.job.num_workers:
                for w in self._barriers.pop(msg["name"]):
                    self._reply(w, {"type": "ok"})
            return None
        if kind == "sync_put":
            control.require(msg, "round", "worker_id", "blob")
            self._sync = {msg["round"]: msg["blob"]}
            for w in self._sync_waiters.pop(msg["round"], []):
                self._reply(w, {"type": "sync", "blob": msg["blob"]})
            return {"type": "ok"}
        if kind == "sync_get":
            control.require(msg, "round")
            if msg["round"] in self._sync:
                return {"type": "sync", "blob": self._sync[msg["round"]]}
            self._sync_waiters.setdefault(msg["round"], []).append(ident)
            return None
        if kind == "shutdown":
            self._stop.set()
            return {"type": "ok"}
        raise control.ControlError(f"unknown control message type {kind!r}")

    def _control_loop(self):
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            frames = self.ctl.recv_multipart()
            ident, body = frames[0], frames[-1]
            try:
                msg = control.decode(body)
                reply = self._handle(ident, msg)
            except (control.ControlError, ValueError, TypeError, KeyError, IndexError) as exc:
                reply = control.error(str(exc))
            if reply is not None:
                self._reply(ident, reply)
        time.sleep(0.05)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> "PSServer":
        for fn in (self._data_loop, self._control_loop):
            t = threading.Thread(target=fn, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stats(self) -> dict:
        return _stats(self.engine)

    def wait(self, timeout: float | None = None) -> bool:
        return self._stop.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self.ctl.close(0)
        self.sock.close()
