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
