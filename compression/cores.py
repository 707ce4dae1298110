"""How many of the host's cores sit idle: the worker's codec spreads its RHT blocks over
threads only where there are cores to spare (docs/design.md, "Determinism": the bytes do not
depend on the count), and the pipelined round starts where the DATA phase left cores idle."""
from __future__ import annotations

import os
import threading
import time

#: The least time between two samples of /proc/stat that `idle_cores` compares.
SAMPLE_S = 0.2


def cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of the host's CPUs from /proc/stat (None where there is none)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + fields[4], sum(fields[:8])


def idle_share(before, after) -> float | None:
    """The share of the host's CPU time that was idle between two `cpu_times()`."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


_lock = threading.Lock()
_last: dict = {"at": None, "times": None, "own": None, "idle": None}


def idle_cores(cores: int | None = None, now=time.monotonic, own=time.process_time) -> int:
    """The host's cores that were idle between the last two samples of /proc/stat at least
    SAMPLE_S apart, plus those this process kept busy beyond one (its CPU time `own` over the
    same window): a worker's own codec threads do not hide the core they run on, which made a
    lone worker on two idle cores go between two threads and one every 0.2 s.  The first call
    samples and counts every core idle; where /proc/stat is missing, every core.  The
    caller's own core is busy while it asks, so a lone worker on an otherwise idle host of n
    cores sees about n − 1."""
    cores = cores or os.cpu_count() or 1
    with _lock:
        t = now()
        if _last["at"] is None or t - _last["at"] >= SAMPLE_S:
            times, mine = cpu_times(), own()
            share = idle_share(_last["times"], times)
            if share is not None:
                beyond_one = (mine - _last["own"]) / (t - _last["at"]) - 1.0
                _last["idle"] = share * cores + max(0.0, beyond_one)
            _last["at"], _last["times"], _last["own"] = t, times, mine
        idle = _last["idle"]
    return cores if idle is None else max(0, min(cores, round(idle)))


def _forget() -> None:
    _last.update(at=None, times=None, own=None, idle=None)     # a forked child samples afresh


os.register_at_fork(after_in_child=_forget)
