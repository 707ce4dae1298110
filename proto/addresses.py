"""Where a PS listens, as users write it: "HOST:PORT[,HOST:PORT…]", one address per shard.

A shard's data plane is UDP HOST:PORT and its control plane ZeroMQ on PORT+1 unless told
otherwise (docs/protocol.md, its opening section): both ends agree on that rule, so it lives here.
"""
from __future__ import annotations


def parse_addr(text: str) -> tuple[str, int]:
    """"HOST:PORT" → (host, port); ValueError saying what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        raise ValueError(f"{text!r} is not HOST:PORT (no ':PORT')")
    if not host:
        raise ValueError(f"{text!r} is not HOST:PORT (no host before ':')")
    if not port.isdigit():
        raise ValueError(f"{text!r} is not HOST:PORT (port {port!r} is not a number)")
    if not 0 < int(port) < 65536:
        raise ValueError(f"port {port} is out of range 1..65535 in {text!r}")
    return host, int(port)


def parse_addrs(text: str) -> list[tuple[str, int]]:
    """"HOST:PORT[,HOST:PORT…]" → [(host, port), …] (at least one)."""
    addrs = [parse_addr(v) for v in text.split(",") if v.strip()]
    if not addrs:
        raise ValueError(f"{text!r} names no HOST:PORT")
    return addrs


def parse_ps(text: str, control_port: int | None = None) -> list[tuple[str, int, int]]:
    """"HOST:PORT[,HOST:PORT…]" → [(host, data port, control port), …]: each shard's control
    plane on its data port + 1, but shard 0's on `control_port` when given."""
    shards = []
    for host, port in parse_addrs(text):
        shards.append((host, port, control_port if control_port and not shards else port + 1))
    return shards
