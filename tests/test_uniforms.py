"""Uniforms drawn ahead (worker/uniforms.py) are exactly the ones a round would draw itself."""
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

from worker.uniforms import UniformsAhead


def _now(fn) -> Future:
    f = Future()
    f.set_result(fn())
    return f


def test_pcg64_float32_draws_in_pieces_equal_one_draw():
    """What the one-stream mode relies on: numpy's float32 uniforms from PCG64 are the same
    values whether drawn at once or in pieces of any size, odd sizes included."""
    whole = np.random.default_rng(7).random(1001, dtype=np.float32)
    rng = np.random.default_rng(7)
    parts = [rng.random(k, dtype=np.float32) for k in (1, 2, 333, 17, 648)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


@pytest.mark.parametrize("threaded, ahead", [(False, True), (True, True), (False, False)])
def test_one_stream_gives_the_stream_in_order_whatever_the_sizes(threaded, ahead):
    """Rounds of changing sizes (a smaller one leaves values over, a larger one draws the rest)
    get the stream's values in order, as if each had drawn its own; drawing ahead off too."""
    sizes = [64, 64, 16, 64, 33, 128, 128, 5, 7, 200]
    rng = np.random.default_rng(3)
    ua = UniformsAhead(lambda r: rng, keyed=False, ahead=ahead)
    pool = ThreadPoolExecutor(max_workers=1) if threaded else None
    got = []
    try:
        for r, n in enumerate(sizes):
            u = ua.take(r, n)
            assert u.dtype == np.float32 and u.shape == (n,)
            got.append(u.copy())          # valid until the next draw_ahead
            ua.draw_ahead(pool.submit if pool else _now, r + 1, n)
    finally:
        if pool:
            pool.shutdown()
    want = np.random.default_rng(3).random(sum(sizes), dtype=np.float32)
    np.testing.assert_array_equal(np.concatenate(got), want)


def test_keyed_rounds_use_values_drawn_ahead_only_for_their_round_and_size():
    """Per-round generators: round r always gets rng_for(r)'s first n values, whether drawn
    ahead (matching round and size), or drawn again after a skipped round or a new size."""
    def rng_for(r):
        return np.random.default_rng([11, r])

    ua = UniformsAhead(rng_for, keyed=True, ahead=True)
    calls = []

    def submit(fn):
        calls.append(1)
        return _now(fn)

    for r, n in [(0, 50), (1, 50), (2, 20), (5, 20), (6, 20)]:
        u = ua.take(r, n)
        np.testing.assert_array_equal(u, rng_for(r).random(n, dtype=np.float32))
        ua.draw_ahead(submit, r + 1, n)
    assert len(calls) == 5


def test_a_failed_draw_ahead_surfaces_at_the_next_take():
    class Broken:
        def random(self, *a, **k):
            raise MemoryError("no room")

    ua = UniformsAhead(lambda r: Broken(), keyed=True, ahead=True)
    with ThreadPoolExecutor(max_workers=1) as pool:
        ua.draw_ahead(pool.submit, 1, 10)
        with pytest.raises(MemoryError, match="no room"):
            ua.take(1, 10)


@pytest.mark.parametrize("ahead", ["1", "0"])
def test_worker_rounds_of_changing_sizes_encode_the_one_stream_in_order(monkeypatch, ahead):
    """A one-worker THC job through the C PS with the default one-stream randomness: every
    round's kept residual is x − RHT⁻¹(X) of indices encoded with the stream's next values,
    recomputed here from a copy of the stream, with the uniforms drawn ahead or not."""
    from compression import thc
    from proto.job import JobConfig
    from ps_server.server import PSServer
    from worker.client import Worker
    from worker.transport import Transport
    monkeypatch.setenv("THC_UNIFORMS_AHEAD", ahead)
    job = JobConfig(num_workers=1)
    server = PSServer(job, ("127.0.0.1", 0), control_port=0, engine="c").start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port)
    try:
        w = Worker(t, seed=3)
        assert w._uniforms.ahead == (ahead == "1")
        mirror = np.random.default_rng(np.random.SeedSequence([3, 0]))     # the worker's stream
        data = np.random.default_rng(5)
        e = {}
        for r, d in enumerate([40_000, 40_000, 9_000, 40_000, 70_000]):
            g = data.standard_normal(d).astype(np.float32)
            w.allreduce(g, key=f"g{d}", round_no=r)
            mine = thc.WorkerRound(w.cfg, g + e.get(d, 0))
            mine.encode(np.asarray(w.last.norms), mirror, r, packed=True)
            e[d] = mine.residual()
            np.testing.assert_array_equal(w.errors.errors[f"g{d}"], e[d])
    finally:
        t.close()
        server.stop()
