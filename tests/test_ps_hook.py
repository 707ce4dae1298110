"""THC-PS as a DDP communication hook (worker/ps_hook.py): the same bits as the after-backward
path, several buckets in flight without confusing their rounds, replicas identical under loss,
and bad input refused before any traffic."""
import numpy as np
import pytest
import torch

from thc_ps.proto import headers as H
from thc_ps.proto.job import JobConfig
from tests.helpers import run_threads
from tests.test_service import ps, transports
from thc_ps.worker.client import Worker
from thc_ps.worker.ps_hook import HookSync, PSHookState, merged_report, ps_hook

N, SEED = 2, 11
SIZES = (3000, 70_000, 513)         # three buckets, each a round of its own size


def grads(rank: int, step: int, size: int, integer: bool = False) -> np.ndarray:
    rng = np.random.default_rng([rank, step, size, 5])
    if integer:                      # float sums of small integers are exact in any order
        return rng.integers(-50, 50, size).astype(np.float32)
    return rng.normal(0, 1, size).astype(np.float32)


_PARAMS: dict = {}


class FakeBucket:
    """What ps_hook reads of torch.distributed.GradBucket: its index, flat buffer and
    parameters (by default one covering the whole bucket)."""

    def __init__(self, index: int, buffer: torch.Tensor, params=None):
        self._index, self._buffer = index, buffer
        # by default one parameter covering the bucket, the same tensor every step (as DDP's are)
        self._params = [_PARAMS.setdefault((index, buffer.numel()), torch.zeros(buffer.numel()))] \
            if params is None else params

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list:
        return self._params


def _job(codec="thc", n=N):
    return JobConfig(num_workers=n, codec=codec, seed=SEED)


def _run(codec: str, body, n=N) -> list:
    """body(rank, worker) in a thread per rank against a fresh PS; returns each rank's result."""
    server = ps(_job(codec, n))
    ts = transports(server, n)
    out = [None] * n

    def rank_main(r):
        out[r] = body(r, Worker(ts[r], seed=SEED))
    try:
        errors = run_threads(rank_main, n, timeout=120)
    finally:
        for t in ts:
            t.close()
        server.stop()
    assert not errors, errors
    return out


def test_one_bucket_through_the_hook_is_bit_for_bit_the_after_backward_round():
    """The same gradient, seed and rank: the hook's average equals Worker.allreduce's (the
    after-backward path) in every bit, error feedback included over three steps."""
    def after_backward(r, w):
        return [w.allreduce(grads(r, s, SIZES[1]), key="bucket0") for s in range(3)]

    def hooked(r, w):
        state = PSHookState(w, world_size=N)
        try:
            outs = []
            for s in range(3):
                fut = ps_hook(state, FakeBucket(0, torch.from_numpy(grads(r, s, SIZES[1]))))
                outs.append(fut.wait().numpy().copy())
            return outs
        finally:
            state.close()
    ref, got = _run("thc", after_backward), _run("thc", hooked)
    for r in range(N):
        for s in range(3):
            assert got[r][s].dtype == np.float32
            np.testing.assert_array_equal(got[r][s], ref[r][s])
    np.testing.assert_array_equal(got[0][2], got[1][2])        # every rank decodes the same sum


def _in_flight(codec, integer):
    def body(r, w):
        state = PSHookState(w, world_size=N, keep_reports=True)
        try:
            outs = []
            for s in range(2):
                # every bucket of a step handed over before any result is awaited, as DDP does
                futs = [ps_hook(state, FakeBucket(i, torch.from_numpy(grads(r, s, d, integer))))
                        for i, d in enumerate(SIZES)]
                outs.append([f.wait().numpy().copy() for f in futs])
                assert state.bucket_dims == list(SIZES)
                rep = merged_report(state.take_reports())
                assert rep.lost == 0 and rep.bytes_up > 0
            return outs
        finally:
            state.close()
    return body


def test_several_buckets_in_flight_are_each_exact():
    """codec none over integer gradients: each bucket's result is exactly the mean of what the
    ranks sent for that bucket and step, so no bucket took another's round or slot."""
    got = _run("none", _in_flight("none", integer=True))
    for r in range(N):
        for s in range(2):
            for i, d in enumerate(SIZES):
                want = sum(grads(q, s, d, True) for q in range(N)) / N
                np.testing.assert_array_equal(got[r][s][i], want.astype(np.float32))


def test_several_thc_buckets_in_flight_equal_the_serial_rounds():
    """THC: buckets handed over together give what the same rounds give one after another."""
    def serial(r, w):
        return [[w.allreduce(grads(r, s, d), key=f"bucket{i}") for i, d in enumerate(SIZES)] for s in range(2)]
    ref, got = _run("thc", serial), _run("thc", _in_flight("thc", integer=False))
    for r in range(N):
        for s in range(2):
            for i in range(len(SIZES)):
                np.testing.assert_array_equal(got[r][s][i], ref[r][s][i])


def test_hook_sync_fast_forwards_by_the_last_steps_buckets():
    """A rejoining rank skips a step as its buckets' rounds: the slot rounds advance as a
    rank that ran the step's buckets."""
    def body(r, w):
        state = PSHookState(w, world_size=N)
        try:
            futs = [ps_hook(state, FakeBucket(i, torch.from_numpy(grads(r, 0, d)))) for i, d in enumerate(SIZES)]
            [f.wait() for f in futs]
            ran = w.t.slot_round.copy()
            HookSync(state).skip_step()
            skipped = w.t.slot_round - ran
            for i, d in enumerate(SIZES):
                w.allreduce(grads(r, 1, d), key=f"bucket{i}")
            return skipped, w.t.slot_round - ran - skipped
        finally:
            state.close()
    slots = _job().slots             # data slots first, then the NORM slots (which rotate by phase)
    for skipped, ran_again in _run("thc", body):
        assert skipped.sum() > 0
        np.testing.assert_array_equal(skipped[:, :slots], ran_again[:, :slots])
        assert skipped[:, slots:].sum() == ran_again[:, slots:].sum() == len(SIZES)


def test_a_state_for_another_world_size_is_refused_before_any_traffic():
    server = ps(_job())
    (t,) = transports(server, 1)
    try:
        sent = t.stats.counters["packets_sent"]
        with pytest.raises(ValueError, match="process group has 3 ranks but the PS job .* has 2 workers"):
            PSHookState(Worker(t, seed=SEED), world_size=3)
        assert t.stats.counters["packets_sent"] == sent
    finally:
        t.close()
        server.stop()


def test_a_bucket_too_large_or_of_another_dtype_is_refused_before_any_traffic():
    server = ps(_job())
    (t,) = transports(server, 1)
    state = PSHookState(Worker(t, seed=SEED), world_size=N)
    try:
        sent = t.stats.counters["packets_sent"]
        huge = torch.zeros(1).expand(H.MAX_COORDS + 1)        # no memory behind it
        with pytest.raises(ValueError, match="does not fit a round"):
            state.submit(0, huge)
        with pytest.raises(ValueError, match=r"bucket 0 has dtype torch.complex64: the PS hook takes "
                                             r"floating-point gradients \(float32, float16, bfloat16, float64\)"):
            ps_hook(state, FakeBucket(0, torch.zeros(8, dtype=torch.complex64)))
        assert t.stats.counters["packets_sent"] == sent and state.error is None
    finally:
        state.close()
        t.close()
        server.stop()


def test_a_ps_that_refuses_the_job_fails_the_worker_before_any_hook_exists():
    """The hook needs a registered Worker: a PS running another configuration refuses the
    registration, naming the differing field."""
    server = ps(_job())
    try:
        with pytest.raises(ValueError, match="num_workers"):
            transports(server, 1, expect={"num_workers": 3})
    finally:
        server.stop()


def test_replicas_stay_identical_through_the_hook_with_loss():
    """Real DDP (gloo) with the hook, 2% injected loss each way, no model sync: every chunk
    is recovered and both ranks end with the same parameters."""
    from thc_ps.deploy.train import TrainConfig, run
    cfg = TrainConfig(job=JobConfig(num_workers=2, seed=3), epochs=1, model="mlp", train_limit=1024,
                      test_limit=200, loss=0.02, grad_sync="hook", sync_every=0, bucket_cap_mb=0.25)
    doc = run(cfg, log=lambda s: None)
    assert doc["final_params_identical"] is True
    assert sum(e["lost_chunks"] for e in doc["epochs"]) == 0
    injected = sum(c.get("injected_drops_out", 0) + c.get("injected_drops_in", 0) for c in doc["transport"].values())
    assert injected > 0
    assert doc["epochs"][0]["bytes_up"] > 0


def test_train_config_refuses_the_hook_where_it_cannot_serve():
    from thc_ps.deploy.train import TrainConfig
    with pytest.raises(ValueError, match="per-tensor rounds need --grad-sync after-backward"):
        TrainConfig(per_tensor=True, grad_sync="hook")
    with pytest.raises(ValueError, match="grad_sync must be one of"):
        TrainConfig(grad_sync="sometimes")
    # auto: the hook only for gradients beyond one bucket (the cnn's 0.2 MB fit 25 MB, not 0.1)
    assert not TrainConfig().uses_hook and TrainConfig(bucket_cap_mb=0.1).uses_hook
    assert TrainConfig(grad_sync="hook").uses_hook and not TrainConfig(bucket_cap_mb=0.1, per_tensor=True).uses_hook
    assert not TrainConfig(model="mlp-wide").uses_hook and TrainConfig().uses_hook_for(7 << 20)


class _FlakyWorker:
    """A Worker stand-in whose second round raises (a lease lost mid-step) and which counts
    the rounds it ran."""

    class _T:
        worker_id, job_name = 0, "flaky"

    def __init__(self):
        self.job, self.t, self.ran, self.last = _job(), self._T(), [], None

    def check_dim(self, dim):
        pass

    def allreduce(self, x, key, out, segments=None):
        if len(self.ran) == 1 and not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("lease lost")
        self.ran.append(key)
        from thc_ps.worker.client import RoundReport
        self.last = RoundReport(len(self.ran), 1, 0)
        return out


def test_a_failed_round_voids_the_rest_of_its_step_and_the_next_step_runs():
    w = _FlakyWorker()
    state = PSHookState(w, world_size=N)
    try:
        futs = [ps_hook(state, FakeBucket(i, torch.zeros(4))) for i in range(3)]
        with pytest.raises(RuntimeError, match="lease lost"):
            futs[1].wait()
        with pytest.raises(RuntimeError, match="lease lost"):
            state.raise_error()
        assert all(f.done() for f in futs) and w.ran == ["bucket0"]     # bucket 2 never ran
        state.raise_error()                                            # cleared: nothing to raise
        futs = [ps_hook(state, FakeBucket(i, torch.zeros(4))) for i in range(3)]
        [f.wait() for f in futs]
        assert w.ran == ["bucket0", "bucket0", "bucket1", "bucket2"]
    finally:
        state.close()


@pytest.mark.parametrize("rotation", ["round", "job"])
def test_each_parameter_of_a_bucket_gets_its_own_blocks(rotation):
    """The hook hands the bucket's parameter sizes to the round (Worker.allreduce's segments):
    parameters of 700 and 300 floats in blocks of 2^8 are cut 256 + 256 + 256 | 256 + 64 (five
    norms a round), not as one vector of 1,000 (four); the hook's average is bit for bit a
    worker's allreduce given those sizes, and not the one of the vector cut as one tensor."""
    from thc_ps.compression import thc
    a, b = torch.zeros(700), torch.zeros(300)
    job = JobConfig(num_workers=1, seed=SEED, rotation=rotation, block_log2=8)
    g = grads(0, 0, 1000)
    assert thc.ThcConfig.of_job(job).layout(1000, (700, 300)).padded == (256, 256, 256, 256, 64)

    def run(via_hook: bool, segments=None) -> np.ndarray:
        server = ps(job)
        t = transports(server, 1)[0]
        try:
            w = Worker(t, seed=SEED)
            if not via_hook:
                return w.allreduce(g.copy(), key="bucket0", segments=segments)
            state = PSHookState(w, world_size=1, keep_reports=True)
            out = ps_hook(state, FakeBucket(0, torch.from_numpy(g.copy()), [a, b])).wait().numpy().copy()
            state.close()
            assert [len(r.norms) for r in state.take_reports()] == [5]
            return out
        finally:
            t.close()
            server.stop()
    hooked = run(True)
    np.testing.assert_array_equal(hooked, run(False, (700, 300)))
    assert not np.array_equal(hooked, run(False))


@pytest.mark.parametrize("rotation", ["round", "job"])
def test_a_rebuilt_bucket_takes_its_residual_along(rotation):
    """DDP rebuilds its buckets after the first step: the same parameters in another order.
    The hook moves the bucket's residual with its coordinates (Worker.move_state, once), and
    the move is exact: the residual permuted as it is (a rotation per round), or taken out of
    the job's rotation, permuted and rotated again (a job rotation: its padding share goes)."""
    from thc_ps.compression import thc
    a, b = torch.zeros(700), torch.zeros(300)          # two "parameters" (their data_ptr names them)
    job = JobConfig(num_workers=1, seed=SEED, rotation=rotation, block_log2=8)
    server = ps(job)
    t = transports(server, 1)[0]
    try:
        w = Worker(t, seed=SEED)
        state = PSHookState(w, world_size=1)
        calls, move = [], w.move_state
        w.move_state = lambda key, moves, dim, segs: (calls.append((key, moves, dim, segs)), move(key, moves, dim, segs))
        g = grads(0, 0, 1000)
        ps_hook(state, FakeBucket(0, torch.from_numpy(g.copy()), [a, b])).wait()
        ps_hook(state, FakeBucket(0, torch.from_numpy(g.copy()), [a, b])).wait()
        assert calls == []
        ps_hook(state, FakeBucket(0, torch.from_numpy(np.concatenate([g[700:], g[:700]])), [b, a])).wait()
        state.close()
        assert calls == [("bucket0", [(700, 0, 300), (0, 300, 700)], 1000, ((700, 300), (300, 700)))]
        assert state._layouts[0] == ((1, 0), (300, 700))
        e = grads(0, 9, w.errors.errors["bucket0"].size)          # any residual: the move itself
        w.errors.update("k", e.copy())
        move("k", [(700, 0, 300), (0, 300, 700)], 1000, ((700, 300), (300, 700)))
    finally:
        t.close()
        server.stop()
    got = w.errors.errors["k"]
    if rotation == "round":
        np.testing.assert_array_equal(got, np.concatenate([e[700:], e[:700]]))
    else:
        cfg = thc.ThcConfig.of_job(w.job)           # each parameter its blocks, in either order
        flat = thc.unrotate(e, cfg, thc.make_layout(1000, 8, segments=(700, 300)))
        np.testing.assert_allclose(thc.unrotate(got, cfg, thc.make_layout(1000, 8, segments=(300, 700))),
                                   np.concatenate([flat[700:], flat[:700]]), atol=1e-5)


def test_the_moves_between_two_layouts_carry_each_parameter():
    from thc_ps.worker.ps_hook import _moves
    assert _moves(((0, 1, 2), (5, 3, 2)), ((2, 0, 1), (2, 5, 3))) == [(8, 0, 2), (0, 2, 5), (5, 7, 3)]
    x = np.arange(10)
    y = np.empty_like(x)
    for src, dst, n in _moves(((0, 1, 2), (5, 3, 2)), ((2, 0, 1), (2, 5, 3))):
        y[dst:dst + n] = x[src:src + n]
    assert y.tolist() == [8, 9, 0, 1, 2, 3, 4, 5, 6, 7]
