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


def each_report(q, procs, timeout: float, what: str = "worker"):
    """Yields one item from `q` per process of `procs` (multiprocessing processes that each put
    one report and exit), as they arrive.  A process that exits with a non-zero code while
    reports are missing raises at once, naming it (its traceback is on stderr) instead of
    the caller waiting out `timeout`; past `timeout` seconds the error names the processes
    still running."""
    import queue
    import time
    got, deadline = 0, time.monotonic() + timeout
    while got < len(procs):
        ended = all(p.exitcode is not None for p in procs)
        try:           # once all have ended, a report may still be in flight from a feeder thread
            item = q.get(timeout=5 if ended else 0.5)
        except queue.Empty:
            pass
        else:
            got += 1
            yield item
            continue
        dead = [f"{i} (pid {p.pid}) exited with code {p.exitcode}" for i, p in enumerate(procs)
                if p.exitcode not in (None, 0)]
        if dead or ended:
            raise RuntimeError((f"{what} process {'; '.join(dead)}" if dead else f"every {what} process ended")
                               + f", with {got} of {len(procs)} reports in")
        if time.monotonic() > deadline:
            alive = [f"{i} (pid {p.pid})" for i, p in enumerate(procs) if p.exitcode is None]
            raise TimeoutError(f"no report from {what} process {', '.join(alive)} after {timeout:g} s "
                               f"({got} of {len(procs)} reports)")



def start_shielded(proc) -> None:
    """Start a multiprocessing process that ignores SIGINT.  Ctrl-C at a terminal reaches
    the whole foreground process group: every worker would print its own traceback.  A
    child started while SIGINT is ignored keeps ignoring it (Python installs its
    KeyboardInterrupt handler only when the parent left SIGINT alone), so the parent alone
    hears Ctrl-C and stops its children itself (SIGTERM; `leave_on_sigterm`)."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        proc.start()                    # signal dispositions are the main thread's to change
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc.start()
    finally:
        signal.signal(signal.SIGINT, old)


def leave_on_sigterm() -> None:
    """In a worker process: SIGTERM raises KeyboardInterrupt once (its `finally` blocks run:
    the worker leaves its job), and any later SIGTERM or SIGINT is ignored so that the
    leaving is not cut short.  Call it from the main thread."""
    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    quiet_once_stopped()


def quiet_once_stopped() -> None:
    """Once SIGINT or SIGTERM arrives, the worker's notes (`thc_ps.worker.*` loggers) say only errors.

    Python runs a signal's handler in the main thread only when that thread runs Python
    again; a worker whose main thread waits in a C call (a phase, DDP's future) goes on
    retransmitting to peers that already left on the same Ctrl-C, and its "unanswered
    after N retransmissions" notes would follow the one line an interrupted `thc train`
    prints.  The signal module's wakeup fd is written by the C-level handler at once,
    whatever thread runs: a daemon thread waiting on it quiets the notes.  Call it from
    the main thread."""
    import logging
    import threading
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def watch():
        os.read(r, 1)
        logging.getLogger("thc_ps.worker").setLevel(logging.ERROR)
    threading.Thread(target=watch, daemon=True, name="thc-stop-watch").start()


def stop_children(procs, timeout: float = 5.0) -> None:
    """SIGTERM every live process of `procs`, wait up to `timeout` seconds in all for them to
    exit, then SIGKILL the rest."""
    import time
    live = [p for p in procs if p.exitcode is None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + timeout
    for p in live:
        p.join(timeout=max(0.05, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join(timeout=5)
