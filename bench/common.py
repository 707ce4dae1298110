"""Timing helper and result writer shared by the benchmark scripts."""
import time


def best(fn, repeat: int) -> float:
    """Best wall time of `repeat` calls (the least disturbed run on a shared machine)."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _busy_loop() -> None:           # a CPU hog: never touches memory beyond its registers
    while True:
        pass


def _memory_loop() -> None:         # a memory-bound hog: streams 64 MB copies
    import numpy as np
    a, b = np.ones(1 << 24, np.float32), np.empty(1 << 24, np.float32)
    while True:
        np.copyto(b, a)


def _compile_loop() -> None:      # a compiler: short-lived cc1 processes, as a build
    import os
    import subprocess
    import sysconfig
    from pathlib import Path
    src = Path(__file__).resolve().parents[1] / "ps_server" / "_fastpath.c"
    out = f"/tmp/thc-bg-{os.getpid()}.o"
    while True:
        subprocess.run(["cc", "-O2", "-c", str(src), "-I", sysconfig.get_paths()["include"], "-o", out],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def background_load(busy: int, memory: int = 0, nice: int = 19, compile: int = 0, session: bool = False):
    """A context manager that keeps `busy` busy-loop processes, `memory` memory-bound ones
    and `compile` compiler loops (cc -O2 of a C file, again and again) running at `nice` for
    its duration (a shared training host: data loaders, monitoring, builds, other users'
    jobs), and stops them afterwards.  `session`: each in a session of its own, as a job
    started from another login or by a service is — with the kernel's autogroup scheduling
    (/proc/sys/kernel/sched_autogroup_enabled) a session is a scheduling group of its own,
    whose share of the CPU its processes' nice does not reduce (docs/bench.md, "A busy
    host")."""
    import contextlib
    import multiprocessing as mp
    import os

    @contextlib.contextmanager
    def run():
        ctx = mp.get_context("fork")
        procs = []
        for target in [_busy_loop] * busy + [_memory_loop] * memory + [_compile_loop] * compile:
            p = ctx.Process(target=_niced, args=(target, nice, session), daemon=True)
            p.start()
            procs.append(p)
        try:
            yield procs
        finally:
            for p in procs:                 # each in its own group: its cc children go too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 9)
            for p in procs:
                p.join(5)
    return run()


def _niced(target, nice: int, session: bool = False) -> None:
    import os
    if session:
        os.setsid()                     # its own session (and autogroup) and process group
    else:
        os.setpgid(0, 0)                # its own group: stopping it stops its children too
    os.nice(nice)
    target()


def add_background_args(ap) -> None:
    """The --background* options of the round benchmarks (a busy host, docs/bench.md)."""
    ap.add_argument("--background", type=int, default=0, metavar="N",
                    help="run N busy-loop processes at nice 19 for the whole run (a busy host)")
    ap.add_argument("--background-memory", type=int, default=0, metavar="M",
                    help="and M memory-bound ones (64 MB copies) at nice 19")
    ap.add_argument("--background-compile", type=int, default=0, metavar="C",
                    help="and C compiler loops (cc -O2 of a C file, again and again) at nice 19")
    ap.add_argument("--background-session", action="store_true",
                    help="start each background process in a session of its own (as another login's "
                         "or a service's jobs are): under autogroup scheduling nice 19 then no longer "
                         "lowers its share")


def background_from_args(args):
    """background_load() as the --background* options ask."""
    return background_load(args.background, args.background_memory, compile=args.background_compile,
                           session=args.background_session)


def write_results(out, name: str, doc: dict, md: str, failed: list) -> int:
    """A benchmark's end: `doc` as OUT/NAME.json, the table `md` as OUT/NAME.md and on stdout,
    and the exit status: 1 when a run was not exact (`failed` says which), else 0."""
    import json
    import sys
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{name}.md").write_text(md + "\n")
    print(md)
    if failed:
        print(f"bench_{name}: not every round exact: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0
