"""Co-located load a THC job should be told about at start.

With the kernel's autogroup scheduling on (Debian's default), every login session or
service is a scheduling group, the groups share the CPU equally and `nice` ranks processes
only within a group: a build at nice 19 started from another session still takes its
group's full share.  A THC round is mostly codec CPU met at sync points, so such load made
the 2^24 round 2.4-3.6x its floor on the reference machine (docs/bench.md, "A busy host";
docs/design.md, "Co-located load", says what to do).  `thc ps`, `thc worker`, `thc launch`
and `thc train` sample the host for half a second in a background thread and print one note
when processes of other sessions are CPU-bound while autogroup is on.

The parsing and the decision are pure functions of /proc snapshots; `check` is the I/O shell.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

AUTOGROUP = "/proc/sys/kernel/sched_autogroup_enabled"
#: a process counts as CPU-bound from this share of one core over the sample
MIN_SHARE = 0.5
#: a group whose autogroup nice is this or more weighs ≤ 1/10 of a nice-0 group: not reported
QUIET_GROUP_NICE = 10


@dataclass(frozen=True)
class Proc:
    pid: int
    comm: str
    session: int
    nice: int
    cpu_ticks: int          # utime + stime, in clock ticks


def parse_stat(text: str) -> Proc:
    """One /proc/PID/stat line.  The command name is in parentheses and may itself contain
    spaces and parentheses, so the fields are counted from the last ')'."""
    left, right = text.index("("), text.rindex(")")
    f = text[right + 2:].split()
    # f[0] state, f[1] ppid, f[2] pgrp, f[3] session, ..., f[11] utime, f[12] stime, f[16] nice
    return Proc(pid=int(text[:left]), comm=text[left + 1:right], session=int(f[3]), nice=int(f[16]),
                cpu_ticks=int(f[11]) + int(f[12]))


def snapshot(proc: str = "/proc") -> dict:
    """{pid: Proc} for every process readable now (processes that exit meanwhile are skipped)."""
    out = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{proc}/{entry.name}/stat") as f:
                p = parse_stat(f.read())
        except (OSError, ValueError, IndexError):
            continue
        out[p.pid] = p
    return out


def busy_elsewhere(before: dict, after: dict, seconds: float, own_session: int, ticks_per_s: int,
                   min_share: float = MIN_SHARE) -> list:
    """[(Proc, share of a core)] of processes in another session (not a kernel thread, whose
    session is 0) that used at least `min_share` of a core between the two snapshots, the
    busiest first."""
    out = []
    for pid, p in after.items():
        b = before.get(pid)
        if b is None or p.session in (0, own_session):
            continue
        share = (p.cpu_ticks - b.cpu_ticks) / ticks_per_s / seconds
        if share >= min_share:
            out.append((p, share))
    return sorted(out, key=lambda ps: -ps[1])


def group_nice(pid: int, proc: str = "/proc") -> int | None:
    """The nice of the process's autogroup (/proc/PID/autogroup: "/autogroup-N nice K")."""
    try:
        with open(f"{proc}/{pid}/autogroup") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def note(busy: list, group_nices: dict) -> str | None:
    """The note for processes of other sessions that are CPU-bound (`busy`, from
    busy_elsewhere) while autogroup is on, leaving out those whose group is niced to
    QUIET_GROUP_NICE or more; None when nothing is left."""
    shown = [(p, s) for p, s in busy if (group_nices.get(p.pid) or 0) < QUIET_GROUP_NICE]
    if not shown:
        return None
    names = ", ".join(f"pid {p.pid} {p.comm} at nice {p.nice} ({100 * s:.0f}% of a core)" for p, s in shown[:4])
    more = f" and {len(shown) - 4} more" if len(shown) > 4 else ""
    return (f"note: {len(shown)} CPU-bound process(es) of other sessions are running ({names}{more}). "
            f"With the kernel's autogroup scheduling on, each session gets an equal share of the CPU "
            f"whatever its nice, so this job's rounds run on what is left. Turn autogroup off "
            f"(sysctl kernel.sched_autogroup_enabled=0) or lower those sessions' group (echo 19 > "
            f"/proc/PID/autogroup); see docs/design.md, \"Co-located load\".")


def autogroup_on(path: str = AUTOGROUP) -> bool:
    try:
        with open(path) as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def check(seconds: float = 0.5, proc: str = "/proc") -> str | None:
    """Sample the host for `seconds` and return the note, or None (autogroup off, or no other
    session CPU-bound)."""
    if not autogroup_on():
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    before = snapshot(proc)
    time.sleep(seconds)
    busy = busy_elsewhere(before, snapshot(proc), seconds, os.getsid(0), ticks)
    return note(busy, {p.pid: group_nice(p.pid, proc) for p, _ in busy})


def warn_in_background(prefix: str, stream=None) -> threading.Thread | None:
    """Run `check` in a daemon thread and print its note (if any) to stderr after `prefix`;
    THC_HOST_CHECK=0 turns it off.  The job does not wait for it."""
    if os.environ.get("THC_HOST_CHECK", "1") == "0":
        return None

    def run():
        try:
            msg = check()
        except OSError:
            return
        if msg:
            print(f"{prefix}: {msg}", file=stream or sys.stderr, flush=True)
    t = threading.Thread(target=run, daemon=True, name="thc-host-check")
    t.start()
    return t
