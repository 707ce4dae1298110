"""Shared test plumbing."""
import threading


def run_threads(target, n: int, timeout: float = 60.0) -> list:
    """Run target(rank) for rank in 0..n-1 in threads; returns the exceptions they raised."""
    errors: list = []

    def wrapped(rank):
        try:
            target(rank)
        except Exception as exc:   # surfaced to the caller
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    return errors
