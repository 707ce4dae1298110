"""Control-plane messages: msgpack maps over ZeroMQ (REQ at the worker, ROUTER at the PS).

Every message is a map with a "type" key.  Requests and their replies:

  register   {worker_id, data_addr: [ip, port]}       -> config {job, data_port}
  stats      {}                                       -> stats {stats}
  barrier    {name, worker_id}                        -> ok (once all n workers arrived)
  sync_put   {round, worker_id, blob}                 -> ok     (model sync: a worker's state)
  sync_get   {round}                                  -> sync {blob} once the reference arrived
  shutdown   {}                                       -> ok, then the PS stops
Anything else, or undecodable bytes, gets {type: error, message}.
"""
from __future__ import annotations

import msgpack

REQUEST_TYPES = ("register", "stats", "barrier", "sync_put", "sync_get", "shutdown")


class ControlError(ValueError):
    """A malformed or unknown control message."""


def encode(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def decode(raw: bytes) -> dict:
    try:
        msg = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ControlError(f"undecodable control message: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ControlError("control message must be a map with a string 'type'")
    return msg


def error(message: str) -> dict:
    return {"type": "error", "message": message}


def require(msg: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in msg]
    if missing:
        raise ControlError(f"{msg.get('type')} message lacks {', '.join(missing)}")
