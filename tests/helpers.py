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


def ranks_against_ps(job, n: int, body, engine: str = "c", timeout_ms: int = 200, timeout: float = 120.0) -> None:
    """A PS of `job` on loopback and n ranks in threads, each running body(rank, transport)
    with a transport of its own (closed after); raises the first error a rank raised."""
    from thc_ps.ps_server.server import PSServer
    from thc_ps.worker.transport import Transport
    server = PSServer(job, ("127.0.0.1", 0), control_port=0, engine=engine).start()

    def rank(r):
        t = Transport("127.0.0.1", server.data_addr[1], r, control_port=server.control_port, timeout_ms=timeout_ms)
        try:
            body(r, t)
        finally:
            t.close()
    try:
        errors = run_threads(rank, n, timeout=timeout)
        if errors:
            raise errors[0]
    finally:
        server.stop()
