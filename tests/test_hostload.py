"""The co-located-load note: /proc parsing, the decision on two snapshots, and a real
CPU-bound process in another session found by the sampler."""
from __future__ import annotations

import os
import subprocess
import sys


from thc_ps.deploy import hostload as HL


def _stat(pid, comm, session, nice, utime, stime):
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    # cutime cstime priority nice ...
    return (f"{pid} ({comm}) R 1 {pid} {session} 0 -1 4194304 10 0 0 0 {utime} {stime} 0 0 20 {nice} 1 0 "
            f"100 1000 200 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0")


def test_parse_stat_counts_fields_from_the_last_parenthesis():
    p = HL.parse_stat(_stat(4242, "cc1 (x) y)", 77, 19, 300, 45))
    assert p == HL.Proc(pid=4242, comm="cc1 (x) y)", session=77, nice=19, cpu_ticks=345)
    with open("/proc/self/stat") as f:
        me = HL.parse_stat(f.read())
    assert me.pid == os.getpid() and me.session == os.getsid(0) and me.nice == os.nice(0)


def test_busy_elsewhere_keeps_other_sessions_cpu_bound_processes_only():
    before = {1: HL.Proc(1, "hog", 50, 19, 1000), 2: HL.Proc(2, "mine", 9, 0, 0),
              3: HL.Proc(3, "kworker", 0, 0, 0), 4: HL.Proc(4, "idle", 51, 0, 500),
              5: HL.Proc(5, "half", 52, 0, 0)}
    after = {1: HL.Proc(1, "hog", 50, 19, 1050), 2: HL.Proc(2, "mine", 9, 0, 50),
             3: HL.Proc(3, "kworker", 0, 0, 50), 4: HL.Proc(4, "idle", 51, 0, 505),
             5: HL.Proc(5, "half", 52, 0, 24), 6: HL.Proc(6, "new", 53, 0, 50)}
    busy = HL.busy_elsewhere(before, after, 0.5, own_session=9, ticks_per_s=100)
    # hog: 50 ticks in 0.5 s = a whole core; half: 24 ticks = 0.48 < MIN_SHARE; mine: own
    # session; kworker: a kernel thread; new: not in the first snapshot
    assert [(p.pid, round(s, 2)) for p, s in busy] == [(1, 1.0)]


def test_note_names_the_processes_and_the_fix_and_skips_niced_groups():
    hog, other = HL.Proc(1234, "cc1", 50, 19, 0), HL.Proc(99, "stress", 51, 0, 0)
    msg = HL.note([(hog, 0.97), (other, 0.6)], {1234: 0, 99: 19})
    assert msg is not None and "1 CPU-bound process(es)" in msg
    assert "pid 1234 cc1 at nice 19 (97% of a core)" in msg and "stress" not in msg
    assert "sched_autogroup_enabled=0" in msg and "/proc/PID/autogroup" in msg
    assert HL.note([(other, 0.6)], {99: 19}) is None
    assert HL.note([], {}) is None


def test_the_sampler_finds_a_busy_loop_started_in_another_session(monkeypatch):
    """A real busy loop in a new session (its own autogroup) shows up in check(); with
    autogroup off, check() says nothing."""
    hog = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: pass"],
                           start_new_session=True)
    try:
        monkeypatch.setattr(HL, "autogroup_on", lambda path=HL.AUTOGROUP: True)
        msg = None
        for _ in range(5):                  # bounded: a loaded CI host may starve one sample
            msg = HL.check(0.5)
            if msg and f"pid {hog.pid} " in msg:
                break
        assert msg is not None and f"pid {hog.pid} python" in msg
        monkeypatch.setattr(HL, "autogroup_on", lambda path=HL.AUTOGROUP: False)
        assert HL.check(0.1) is None
    finally:
        hog.kill()
        hog.wait(timeout=10)


def test_warn_in_background_prints_the_note_after_its_prefix_or_is_off(monkeypatch):
    import io
    out = io.StringIO()
    monkeypatch.setattr(HL, "check", lambda seconds=0.5, proc="/proc": "note: busy")
    monkeypatch.delenv("THC_HOST_CHECK", raising=False)
    t = HL.warn_in_background("thc ps", stream=out)
    t.join(timeout=10)
    assert out.getvalue() == "thc ps: note: busy\n"
    monkeypatch.setattr(HL, "check", lambda seconds=0.5, proc="/proc": None)
    t = HL.warn_in_background("thc ps", stream=out)
    t.join(timeout=10)
    assert out.getvalue() == "thc ps: note: busy\n"      # nothing more
    monkeypatch.setenv("THC_HOST_CHECK", "0")
    assert HL.warn_in_background("thc ps", stream=out) is None
