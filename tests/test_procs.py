"""thc_ps.deploy.procs.each_report: reports from child processes, and a clear error instead of a long
wait when one of them dies or hangs."""
import multiprocessing as mp
import os
import time

import pytest

from thc_ps.deploy.procs import each_report

CTX = mp.get_context("fork")


def _report(q, rank):
    q.put((rank, os.getpid()))


def _die(q, rank):
    os._exit(3)


def _hang(q, rank):
    time.sleep(60)


def _quiet_exit(q, rank):
    pass


def _run(targets, timeout=30.0, what="worker"):
    q = CTX.Queue()
    procs = [CTX.Process(target=t, args=(q, r), daemon=True) for r, t in enumerate(targets)]
    for p in procs:
        p.start()
    try:
        return list(each_report(q, procs, timeout, what))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def test_every_report_arrives():
    got = _run([_report] * 3)
    assert sorted(r for r, _pid in got) == [0, 1, 2]


def test_a_dead_process_is_named_while_the_others_still_run():
    with pytest.raises(RuntimeError, match=r"lock-step rank process 1 \(pid \d+\) exited with code 3, "
                                           r"with 1 of 3 reports in"):
        _run([_report, _die, _hang], timeout=300, what="lock-step rank")


def test_processes_that_end_without_reporting():
    with pytest.raises(RuntimeError, match="every worker process ended, with 1 of 2 reports in"):
        _run([_report, _quiet_exit])


def test_a_hung_process_is_named_at_the_timeout():
    with pytest.raises(TimeoutError, match=r"no report from worker process 1 \(pid \d+\) after 1 s \(1 of 2"):
        _run([_report, _hang], timeout=1.0)


def test_reports_are_yielded_as_they_arrive():
    """A caller can act on the first report (sparse_lr stops at a worker's failure) before the
    others come in."""
    q = CTX.Queue()
    procs = [CTX.Process(target=t, args=(q, r), daemon=True) for r, t in enumerate([_report, _hang])]
    for p in procs:
        p.start()
    try:
        first = next(each_report(q, procs, 300))
        assert first[0] == 0
    finally:
        for p in procs:
            p.kill()
            p.join(5)


QUIET_SCRIPT = r"""
import logging, os, signal, threading, time
import numpy as np
from thc_ps.deploy.procs import leave_on_sigterm
leave_on_sigterm()
note = logging.getLogger("thc_ps.worker.phases")
assert note.isEnabledFor(logging.WARNING)
quiet_at = []
def watch():                      # when the notes went quiet
    while note.isEnabledFor(logging.WARNING):
        time.sleep(0.001)
    quiet_at.append(time.monotonic())
threading.Thread(target=watch, daemon=True).start()
data = np.random.default_rng(0).random(12_000_000)
try:
    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
    np.sort(data)                 # about a second in C (the GIL released), where no handler runs
    time.sleep(5)                 # the handler runs before this line at the latest
    print("no KeyboardInterrupt")
except KeyboardInterrupt:
    caught = time.monotonic()     # the handler ran: the main thread was back in Python
    print("interrupted", "quiet while busy" if quiet_at and quiet_at[0] < caught
          else f"not quiet while busy {quiet_at} {caught}")
"""


def test_a_stopped_worker_goes_quiet_while_its_main_thread_is_busy_in_c():
    """Reproduction: an interrupted `thc train` printed a rank's "unanswered after 8
    retransmissions" note after its one line, the rank's main thread waiting in C while its
    phase went on.  After SIGTERM (or SIGINT) the worker.* notes stop at once, before the
    main thread runs Python again; the handler still raises KeyboardInterrupt there."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", QUIET_SCRIPT], cwd=root, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(root)))
    assert out.stdout.strip() == "interrupted quiet while busy", out.stdout + out.stderr
