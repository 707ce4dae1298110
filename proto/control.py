"""Control-plane messages: msgpack maps over ZeroMQ (REQ at the worker, ROUTER at the PS).

Every message is a map with a "type" key; every request is checked against SCHEMA
(field types and ranges) before the PS acts on it, and the PS caps message size with
ZMQ_MAXMSGSIZE.  Requests and their replies:

  register   {worker_id, data_addr: [ip, port], job_name?, launch?, expect?, job?, rejoin?, session?}
             -> config {job, nonce, token, session, job_number, job_name, lease_s, data_port,
             rejoin}
             `job_name` (default "default") names the job, one name, one job: a name no
             running or queued job has starts a new job beside the running ones (admission
             gives it a region of the PS's slot space and a job id, both in the reply's
             `job`: its `slots` and `job_id`), or queues it while the space is full; the
             name of a running (or queued) job joins it, and a stated configuration that
             disagrees with it is refused, naming each differing field.
             `launch` is a token every rank of one launch shares (the library API draws it
             on rank 0 and broadcasts it over the process group): the registration that
             starts a job records it, and one under the job's name with another token is
             refused, so two torchrun jobs given one name never share a PS job.
             `expect` lists the job fields the worker insists on (`job_id` and `slots` are
             the PS's to assign); `job` proposes a whole job to a PS that has none
             configured, needed only by the registration that starts the job.  A rank held
             by another live registration is refused unless the request carries that
             registration's session (the same worker registering again); `rejoin` (a
             restarted rank) is refused unless a job in which the rank held a place is still
             running.
  heartbeat  {worker_id, session, progress?}  -> status (below); renews the lease
  status     {worker_id?, session?}            -> status {job_number, live, missing, progress,
             barriers, stalled?, region, ..., jobs?, queued?, slot_space?, slots_free?}: to a
             rank (its session given) its job; to anyone else the only running job's fields
             (if one runs), every running job under `jobs`, the queued ones under `queued`
  leave      {worker_id, session}             -> ok; the job ends when every rank left or died
  barrier    {name, worker_id, session}       -> ok, once every live rank arrived
  sync_put   {round, worker_id, session, blob} -> ok   (model sync: the sync source's state)
  sync_get   {round, worker_id, session}      -> sync {blob} once it arrived
  resume     {worker_id, session, phase}      -> resume {phase, max_phase}: after a PS
             restart, the least and the greatest phase any rank reached (retransmit replays
             from the least, zero skips to the greatest)
  stats      {}                               -> stats {stats}
  shutdown   {}                               -> ok, then the PS stops
  drain      {}                               -> ok; the PS admits no new job (queued and new
             ones are refused with code `draining`) and stops once its running jobs end
Anything else, a field of the wrong type or range, or undecodable bytes, gets
{type: error, message, code} (ERROR_CODES below says what each code asks of a worker).
`session` is the secret the registration handed out: every request made for a rank must
carry it (docs/design.md, "What is protected").
"""
from __future__ import annotations

import msgpack

from thc_ps.proto import headers

#: Largest control message the PS accepts (ZMQ_MAXMSGSIZE); model sync blobs are the large ones.
DEFAULT_MAX_MESSAGE = 64 << 20
SESSION_BYTES = 16
MAX_NAME = 128


class ControlError(ValueError):
    """A malformed or unknown control message."""


def encode(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def decode(raw: bytes) -> dict:
    try:
        msg = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ControlError(f"undecodable control message: {type(exc).__name__}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ControlError("control message must be a map with a string 'type'")
    return msg


#: Error reply codes: what a worker must do about an error, without parsing its message.
#:   refused          a refusal or a malformed request (the message says which)
#:   unknown_session  the PS does not know the session: compare the reply's `incarnation`
#:                    with the config reply's — different: the PS restarted (register again,
#:                    then `resume`); the same: the rank's job ended while it was away
#:   lease_expired    the rank's lease ran out while it was silent (paused, descheduled,
#:                    partitioned): register again with `rejoin` and catch up; never `resume`
#:   job_stalled      the job cannot complete: a rank it needs is dead past the rejoin grace
ERROR_CODES = {
    "refused": "a refusal or a malformed request; the message says which (a configuration "
               "conflict names every differing field)",
    "unknown_session": "the PS does not know the session; the reply carries the PS's `incarnation`: "
                       "if it differs from the config reply's, the PS restarted (register again, then "
                       "`resume`); if it is the same, the rank's job ended while it was away (stop)",
    "lease_expired": "the rank's lease ran out while it was silent (paused, descheduled, partitioned); "
                     "the reply carries `job_number`: register again with `rejoin: true` and catch up "
                     "(never `resume`)",
    "job_stalled": "the job cannot complete: a rank it needs is dead past the rejoin grace; the message "
                   "names the ranks",
    "queued": "the job waits for slots (the PS's slot space is full, or an older queued job goes first); "
              "the message says what holds the space and `position` the place in the queue: register "
              "again in a moment (a job whose workers stop asking for 5 s leaves the queue)",
    "draining": "the PS is draining (an operator's `thc status --drain` or SIGUSR1): it admits no new job "
                "and stops once its running jobs end; a registration that would start or queue a job is "
                "refused (a rank of a running job is not): stop, or use another PS",
}


class CodedError(ControlError):
    """A refusal with a code from ERROR_CODES and extra reply fields."""

    def __init__(self, message: str, code: str, **extra):
        super().__init__(message)
        if code not in ERROR_CODES:
            raise ValueError(f"unknown error code {code!r}")
        self.code, self.extra = code, extra


def error(message: str, code: str = "refused", **extra) -> dict:
    return {"type": "error", "message": message, "code": code, **extra}


def error_from(exc: Exception) -> dict:
    """The error reply for an exception (a CodedError keeps its code and fields)."""
    if isinstance(exc, CodedError):
        return error(str(exc), exc.code, **exc.extra)
    return error(str(exc) or type(exc).__name__)


def describe_missing(missing: list) -> str:
    """A status reply's `missing` list as text: 'ranks 1, 3 (1: never registered; 3: no
    heartbeat for 5.2 s)' — the PS's barrier errors and the workers' stall messages."""
    if not missing:
        return "no ranks"
    ranks = ", ".join(str(m["rank"]) for m in missing)
    why = "; ".join(f"{m['rank']}: {m['why']}" for m in missing)
    return f"rank{'s' if len(missing) > 1 else ''} {ranks} ({why})"


def describe_behind(status: dict | None, rank: int, step: int) -> str:
    """The live ranks a status reply shows behind `rank`'s `step` (their `progress`), as
    text: 'rank 1 (at step 3; rank 0 is at 7: restarted and catching up, or slow)'; '' when
    none is.  What a worker whose results are late names when no rank is missing."""
    progress = (status or {}).get("progress") or {}
    behind = sorted((int(r), p) for r, p in progress.items() if int(r) != rank and p < step)
    if step < 0 or not behind:
        return ""
    at = "; ".join(f"{r}: {'not started' if p < 0 else f'step {p}'}" for r, p in behind)
    return (f"rank{'s' if len(behind) > 1 else ''} {', '.join(str(r) for r, _ in behind)} ({at}; "
            f"rank {rank} is at step {step}: restarted or rejoined and catching up, or slow)")


# ---------------------------------------------------------------------- validation
def _described(text: str):
    """Attach the msgpack type a check accepts, as docs/protocol.md states it."""
    def mark(check):
        check.describe = text
        return check
    return mark


def _bound(v: int) -> str:
    return f"2^{v.bit_length() - 1}" if v > 1 << 20 and v & (v - 1) == 0 else \
        f"2^{v.bit_length()}−1" if v > 1 << 20 and v & (v + 1) == 0 else str(v)


def _int(lo: int, hi: int):
    @_described(f"int {_bound(lo)}..{_bound(hi)}")
    def check(name, v):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ControlError(f"{name} must be an integer in {lo}..{hi}, got {v!r:.40}")
    return check


def _str(max_len: int):
    @_described(f"str, 1..{max_len} characters")
    def check(name, v):
        if not isinstance(v, str) or not 0 < len(v) <= max_len:
            raise ControlError(f"{name} must be a string of 1..{max_len} characters")
    return check


def _bytes(exact: int | None = None):
    @_described(f"bin, {exact} bytes" if exact is not None else "bin, any length (up to the message cap)")
    def check(name, v):
        if not isinstance(v, bytes) or (exact is not None and len(v) != exact):
            raise ControlError(f"{name} must be {exact or 'some'} bytes")
    return check


@_described("array [str (dotted IPv4), int 0..65535]")
def _addr(name, v):
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ControlError(f"{name} must be [ip, port]")
    _str(64)(name, v[0])
    _int(0, 65535)(f"{name} port", v[1])


@_described("str, 1..64 of A-Z a-z 0-9 . _ -")
def _name(name, v):
    if not isinstance(v, str) or not 0 < len(v) <= 64 or not all(c.isascii() and (c.isalnum() or c in "._-")
                                                                  for c in v):
        raise ControlError(f"{name} must be 1..64 characters of letters, digits, '.', '_' and '-'")


@_described("bool")
def _bool(name, v):
    if not isinstance(v, bool):
        raise ControlError(f"{name} must be true or false")


@_described("map, str keys")
def _map(name, v):
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise ControlError(f"{name} must be a map with string keys")


_RANK = _int(0, headers.MAX_WORKERS - 1)
_SESSION = _bytes(SESSION_BYTES)
_ROUND = _int(0, (1 << 31) - 1)

#: type -> {field: (required, check)}
SCHEMA = {
    "register": {"worker_id": (True, _RANK), "data_addr": (True, _addr), "job_name": (False, _name),
                 "launch": (False, _name), "expect": (False, _map),
                 "job": (False, _map), "rejoin": (False, _bool), "session": (False, _SESSION)},
    "heartbeat": {"worker_id": (True, _RANK), "session": (True, _SESSION),
                  "progress": (False, _int(0, 1 << 62))},
    "status": {"worker_id": (False, _RANK), "session": (False, _SESSION)},
    "leave": {"worker_id": (True, _RANK), "session": (True, _SESSION)},
    "barrier": {"name": (True, _str(MAX_NAME)), "worker_id": (True, _RANK), "session": (True, _SESSION)},
    "sync_put": {"round": (True, _ROUND), "worker_id": (True, _RANK), "session": (True, _SESSION),
                 "blob": (True, _bytes())},
    "sync_get": {"round": (True, _ROUND), "worker_id": (True, _RANK), "session": (True, _SESSION)},
    "resume": {"worker_id": (True, _RANK), "session": (True, _SESSION), "phase": (True, _int(0, 1 << 62))},
    "stats": {},
    "shutdown": {},
    "drain": {},
}
REQUEST_TYPES = tuple(SCHEMA)


def validate(msg: dict) -> dict:
    """Check a request's type, fields, their types and ranges; returns it or raises ControlError."""
    kind = msg.get("type")
    spec = SCHEMA.get(kind)
    if spec is None:
        raise ControlError(f"unknown control message type {kind!r:.40}")
    unknown = set(msg) - set(spec) - {"type"}
    if unknown:
        raise ControlError(f"{kind} message has unknown fields {sorted(map(str, unknown))[:5]}")
    for name, (required, check) in spec.items():
        if name not in msg:
            if required:
                raise ControlError(f"{kind} message lacks {name}")
            continue
        check(name, msg[name])
    return msg


def require(msg: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in msg]
    if missing:
        raise ControlError(f"{msg.get('type')} message lacks {', '.join(missing)}")
