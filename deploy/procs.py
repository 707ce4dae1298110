"""Process hygiene for local clusters on a small machine."""
from __future__ import annotations

import os
import signal
import subprocess

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def single_threaded_children() -> None:
    """Make spawned workers use one BLAS/OpenMP thread each.

    N workers on 2 cores with a multi-threaded BLAS each oversubscribe the CPU and the
    spinning BLAS threads slow every round by an order of magnitude.  Set before
    spawning; an explicit user setting wins.
    """
    for var in _THREAD_VARS:
        os.environ.setdefault(var, "1")


def stop_gracefully(proc: subprocess.Popen, timeout: float = 20.0) -> str:
    """SIGINT (a PS prints its counters and exits), then SIGKILL after `timeout` seconds;
    returns what the process wrote to a piped stdout."""
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out or ""
