"""Control-plane keys: ZeroMQ CURVE key pairs in a directory both ends are given.

`thc keys DIR` writes
  DIR/server.key, DIR/server.key_secret    the PS's pair (the PS reads the secret one)
  DIR/client.key, DIR/client.key_secret    the workers' pair (workers read the secret one
                                           and DIR/server.key, the PS's public key)
  DIR/authorized/client.key                the public keys the PS accepts
Give the PS host the whole directory and worker hosts client.key_secret and server.key;
more client pairs can be added to authorized/ (one per team or host).
"""
from __future__ import annotations

import os
from pathlib import Path


def create_keys(directory: str | Path) -> Path:
    """Make a key directory (refuses to overwrite one)."""
    import zmq.auth
    d = Path(directory)
    if (d / "server.key_secret").exists():
        raise ValueError(f"{d} already holds keys; remove it first or choose another directory")
    (d / "authorized").mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    zmq.auth.create_certificates(str(d), "server")
    client_public, _ = zmq.auth.create_certificates(str(d), "client")
    (d / "authorized" / "client.key").write_bytes(Path(client_public).read_bytes())
    for secret in d.glob("*.key_secret"):
        os.chmod(secret, 0o600)
    return d


def client_keys(directory: str | Path) -> tuple[bytes, bytes, bytes]:
    """(client secret, client public, server public) for a worker's CURVE socket."""
    import zmq.auth
    d = Path(directory)
    for name in ("client.key_secret", "server.key"):
        if not (d / name).is_file():
            raise ValueError(f"{d / name} is missing: a worker needs client.key_secret and server.key "
                             f"from the PS's key directory (`thc keys`)")
    public, secret = zmq.auth.load_certificate(str(d / "client.key_secret"))
    server_public, _ = zmq.auth.load_certificate(str(d / "server.key"))
    if secret is None:
        raise ValueError(f"{d / 'client.key_secret'} holds no secret key")
    return secret, public, server_public


class HandshakeFailed(ValueError):
    """The control plane's CURVE handshake failed: the keys of the two ends do not fit (a
    refused configuration, like a refused job: nothing was exchanged)."""


def handshake_problem(event: int, value: int, *, server: bool, curve: bool = True) -> str:
    """What a failed ZeroMQ handshake (a socket monitor's HANDSHAKE_FAILED_* event and its
    value) says about the keys, from the PS's side (`server`) or a client's (`curve`: the
    client has keys)."""
    import zmq
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return ("a client's public key is not among this PS's authorized keys (keys/authorized/)" if server
                else "the PS refused this client's key: its public key is not in the PS's keys/authorized/ "
                     "(use the client.key_secret of the PS's key directory, or add client.key there)")
    no_keys = "the PS runs with --keys (CURVE) and this client has no keys: pass --keys DIR"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        if server:
            return "a client without keys tried to connect (this PS runs CURVE: the client needs --keys DIR)"
        return no_keys if not curve else "this client uses CURVE keys (--keys) and the PS runs without them"
    if server:
        return ("a client's CURVE handshake failed (it holds another PS's server.key, or its keys do not "
                "belong together)")
    # the PS dropped the connection without saying why (ZeroMQ reports no detail, or the
    # PS's reply did not decrypt): the likeliest cause for this client
    if not curve:
        return f"the PS ended the handshake; most likely {no_keys}"
    return ("the PS ended the CURVE handshake: this client's server.key is not that PS's public key "
            "(keys from another `thc keys` directory?), or the PS runs without --keys")


#: A client gives up on a handshake that failed without an explicit cause (the PS dropped the
#: connection: keys that do not fit, or a PS that died in the middle of it) only when this many
#: fail in a row: keys that do not fit fail every reconnection (ZeroMQ retries every 0.1 s),
#: a PS killed and restarted fails one.
AMBIGUOUS_FAILURES = 3


def definite(event: int, value: int) -> bool:
    """Whether a failed handshake says its cause (the PS refused the key, or one end runs
    without CURVE) rather than a dropped connection, which a dying PS also causes."""
    import zmq
    return event == zmq.EVENT_HANDSHAKE_FAILED_AUTH or (
        event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)


class HandshakeWatch:
    """A monitor of one ZeroMQ socket's handshakes, set before it connects or binds.

    A CURVE server drops a client whose keys do not fit without a word on the socket: a
    request then waits out its timeout.  The monitor's HANDSHAKE_FAILED_* events tell the
    cause at once.  A client's watch (`server=False`) ends at its first successful
    handshake; `check()` raises HandshakeFailed once one failed with its cause said, or
    AMBIGUOUS_FAILURES failed in a row without one.  The PS's (`server=True`)
    stays: `problems()` returns a line per cause seen, at most one per cause every
    `every_s` seconds, with the count since the last."""

    EVENTS = ("EVENT_HANDSHAKE_FAILED_NO_DETAIL", "EVENT_HANDSHAKE_FAILED_PROTOCOL",
              "EVENT_HANDSHAKE_FAILED_AUTH", "EVENT_HANDSHAKE_SUCCEEDED")

    def __init__(self, sock, *, server: bool, curve: bool = True, every_s: float = 10.0):
        import zmq
        self._sock, self.server, self.curve, self.every_s = sock, server, curve, every_s
        self._mon = sock.get_monitor_socket(events=sum(getattr(zmq, e) for e in self.EVENTS))
        self.failed: str | None = None
        self._ambiguous = 0              # failures in a row that said no cause (a client's)
        self._seen: dict = {}            # cause -> [last said (monotonic), count since]

    def _events(self) -> list:
        """[(problem, whether its cause is definite)] of the handshakes failed since the last call."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message
        out = []
        while self._mon is not None and self._mon.poll(0):
            try:
                m = recv_monitor_message(self._mon, zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            if m["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if not self.server:
                    self.close()                # the keys fit: nothing more to watch
                    break
                continue
            out.append((handshake_problem(m["event"], m["value"], server=self.server, curve=self.curve),
                        definite(m["event"], m["value"])))
        return out

    def check(self, where: str) -> None:
        """Raise HandshakeFailed naming `where` and the cause once a handshake failed."""
        for problem, sure in self._events():
            self._ambiguous += not sure
            if sure or self._ambiguous >= AMBIGUOUS_FAILURES:
                self.failed = self.failed or problem
        if self.failed:
            raise HandshakeFailed(f"the control plane at {where} refused the connection: {self.failed}")

    def problems(self, now: float | None = None) -> list[str]:
        """The PS's lines about failed handshakes since the last call (rate-limited per cause)."""
        import time
        now = time.monotonic() if now is None else now
        for problem, _ in self._events():
            self._seen.setdefault(problem, [float("-inf"), 0])[1] += 1
        lines = []
        for problem, seen in self._seen.items():
            if seen[1] and now - seen[0] >= self.every_s:
                lines.append(f"control plane: CURVE handshake refused: {problem}"
                             + (f" ({seen[1]} times)" if seen[1] > 1 else ""))
                seen[0], seen[1] = now, 0
        return lines

    def close(self) -> None:
        if self._mon is not None:
            try:
                self._sock.disable_monitor()
            except Exception:           # the socket is closed already
                pass
            self._mon.close(0)
            self._mon = None
