"""Timing helper shared by the benchmark scripts."""
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


def background_load(busy: int, memory: int = 0, nice: int = 19):
    """A context manager that keeps `busy` busy-loop processes and `memory` memory-bound
    processes running at `nice` for its duration (a shared training host: data loaders,
    monitoring, other users' jobs), and stops them afterwards."""
    import contextlib
    import multiprocessing as mp

    @contextlib.contextmanager
    def run():
        ctx = mp.get_context("fork")
        procs = []
        for target in [_busy_loop] * busy + [_memory_loop] * memory:
            p = ctx.Process(target=_niced, args=(target, nice), daemon=True)
            p.start()
            procs.append(p)
        try:
            yield procs
        finally:
            for p in procs:
                p.kill()
            for p in procs:
                p.join(5)
    return run()


def _niced(target, nice: int) -> None:
    import os
    os.nice(nice)
    target()
