"""Rank and world size from the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT)."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def _int(env, name, default=None):
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"${name} is not set (start the worker with torchrun or pass --rank)")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {raw!r}") from None


def from_env(environ=None) -> DistEnv:
    """Parse torchrun's variables; clear errors for missing or inconsistent values."""
    env = os.environ if environ is None else environ
    rank = _int(env, "RANK")
    world = _int(env, "WORLD_SIZE")
    local = _int(env, "LOCAL_RANK", rank)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    port = _int(env, "MASTER_PORT", 29500)
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={port} is not a port")
    return DistEnv(rank, world, local, env.get("MASTER_ADDR", "127.0.0.1"), port)
