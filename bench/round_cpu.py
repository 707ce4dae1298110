"""Where a THC round's CPU goes on this host, every process and the kernel counted: the PS and
N worker processes as in bench_floor.py, under `perf record -a`.  Each rank makes its test
gradient once and reuses it (the allreduce's output is the next round's input), so making
gradients is not in the rounds; the samples from the first timed round's start to the last
one's end are grouped:

  codec          the C kernels (RHT, clamp, quantize, decode) and numpy's steps of a round
                 (x = ∇ + e, the residual's subtraction, block norms, the sign draws)
  workers' socket calls and page faults (kernel), Python, libc, the C phase engine
  PS             the PS's threads (this process)
  idle           no task on the CPU

The codec's share s of the CPU bounds a round against bench_floor.py's floor (the codec CPU
of a lock-step round, divided by the cores): were the codec in a round exactly as costly as
in the floor and every core busy, the round would still be 1/s × the floor.

Needs `perf` (linux-perf) and the right to sample every CPU (root, or
kernel.perf_event_paranoid ≤ -1).  The perf data is kept in --out.

    .venv/bin/python bench/round_cpu.py --out DIR [--rounds 20] [--workers 4] [--dim-log2 24] [--result-group ADDR:PORT]
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `bench` is not installed: run from a checkout
from thc_ps.deploy.cli import result_group_arg  # noqa: E402

#: perf script -F pid,tid,time,ip,sym,dso: "  PID/TID  SECONDS:  ADDR SYMBOL (DSO)"
_LINE = re.compile(r"\s*(\d+)/(\d+)\s+([\d.]+):\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$")
_NUMPY = ("_multiarray_umath", "openblas", "_pcg64", "_bounded_integers", "bit_generator", "_generator")
CODEC = ("codec: C kernels", "codec: numpy")


def parse_perf_script(lines) -> list:
    """(pid, tid, seconds, symbol, dso file name) per sample line; other lines are skipped."""
    rows = []
    for line in lines:
        m = _LINE.match(line)
        if m:
            rows.append((int(m[1]), int(m[2]), float(m[3]), m[4], m[5].rsplit("/", 1)[-1]))
    return rows


def category(pid: int, dso: str, ps_pid: int, worker_pids) -> str:
    """The group of one sample (see the module's docstring)."""
    if pid == 0:
        return "idle"
    if pid == ps_pid:
        return "PS"
    if pid not in worker_pids:
        return "other processes"
    if "_kernels" in dso:
        return "codec: C kernels"
    if any(k in dso for k in _NUMPY):
        return "codec: numpy"
    if "kernel" in dso:
        return "workers: kernel"
    if "libpython" in dso:
        return "workers: Python"
    if dso.startswith("libc"):
        return "workers: libc"
    if "_batchio" in dso:
        return "workers: phase engine"
    return "workers: other"


def breakdown(rows, window: tuple, ps_pid: int, worker_pids) -> tuple:
    """(samples in the window, {group: samples}, {group: Counter of symbols})."""
    lo, hi = window
    groups, symbols, n = collections.Counter(), collections.defaultdict(collections.Counter), 0
    for pid, _tid, t, sym, dso in rows:
        if lo <= t <= hi:
            g = category(pid, dso, ps_pid, worker_pids)
            groups[g] += 1
            symbols[g][sym] += 1
            n += 1
    return n, groups, symbols


def report(n: int, groups, symbols) -> str:
    if not n:
        return "no samples in the rounds' window (was perf allowed to sample every CPU?)"
    lines = [f"{n} samples in the timed rounds; share of all CPU time, top symbols:"]
    for g, k in groups.most_common():
        top = ", ".join(f"{s} {100 * c / n:.1f}" for s, c in symbols[g].most_common(4))
        lines.append(f"  {100 * k / n:5.1f}%  {g:22s} {top}")
    share = sum(groups[g] for g in CODEC) / n
    lines.append(f"codec share s = {100 * share:.1f}%: with the codec as costly as in the floor and no idle "
                 f"core, a round is 1/s = {1 / share:.2f}x the floor" if share else "no codec samples")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="directory for perf.data (created)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--dim-log2", type=int, default=24)
    ap.add_argument("--freq", type=int, default=999, help="perf samples per second and CPU")
    ap.add_argument("--result-group", default="", type=result_group_arg, metavar="ADDR:PORT",
                    help="send results to this multicast group (as thc launch does on one host) instead of "
                         "once per worker (default)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.workers < 1:
        ap.error("--rounds and --workers must be at least 1")
    perf = shutil.which("perf")
    if perf is None:
        sys.exit("round_cpu.py needs perf (Debian: linux-perf) on PATH")
    from bench.bench_floor import run_rounds
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "perf.data"
    rec = subprocess.Popen([perf, "record", "-a", "-k", "mono", "-F", str(args.freq), "-o", str(data)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)
    if rec.poll() is not None:
        sys.exit(f"perf record failed: {rec.stderr.read().decode().strip()}")
    try:
        d = run_rounds("thc", 1 << args.dim_log2, args.workers, args.rounds, quiet=True, reuse_gradient=True,
                       result_group=args.result_group)
    finally:
        rec.send_signal(signal.SIGINT)
        rec.wait(timeout=60)
    print(f"d = 2^{args.dim_log2}, {args.workers} workers, {args.rounds} rounds: median round "
          f"{d['median_ms']:.1f} ms, workers' CPU {d['worker_cpu_ms']:.1f} ms and the PS's "
          f"{d['ps_cpu_ms']:.1f} ms per round")
    out = subprocess.run([perf, "script", "-i", str(data), "-F", "pid,tid,time,ip,sym,dso"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    print(report(*breakdown(parse_perf_script(out), d["window"], d["ps_pid"], set(d["worker_pids"]))))
    print(f"perf data: {data}")


if __name__ == "__main__":
    main()
