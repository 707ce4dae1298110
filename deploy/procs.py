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


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Make the kernel send `sig` to this process when its parent dies (Linux
    PR_SET_PDEATHSIG), so a worker never outlives a launcher that was killed; exits at once
    if the parent is already gone.  A no-op where prctl is not available."""
    import ctypes
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)        # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent or parent == 1:   # it died before the call took effect
        os._exit(1)


def process_state(pid: int) -> str:
    """The kernel's one-letter state of a process ('R', 'S', 'T' stopped, 'Z', ...), '' if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def free_tcp_port() -> int:
    """A TCP port free on 127.0.0.1 now (a rendezvous for torch.distributed's gloo)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
