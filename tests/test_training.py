"""Training through the PS: exact agreement with the in-process THC reference, model sync, CLI."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from thc_ps.compression import thc
from thc_ps.compression.stochastic import CounterUniforms, key_from
from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.server import PSServer
from thc_ps.worker.client import Worker
from thc_ps.worker.training import MLP, GradientSync, flat_grad, flat_params, sync_model
from thc_ps.worker.transport import Transport

from tests.helpers import run_threads

N, STEPS, SEED = 2, 3, 5


def batches(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.rand(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)


def train_through_ps(rotation="round", set_to_none=True):
    job = JobConfig(num_workers=N, seed=SEED, rotation=rotation)
    server = PSServer(job, ("127.0.0.1", 0), control_port=0).start()
    finals, errors = {}, []
    models = []
    for _ in range(N):          # torch's RNG is process-wide: initialize before the threads start
        torch.manual_seed(0)
        models.append(MLP(hidden=32))

    def run(rank):
        model = models[rank]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        t = Transport("127.0.0.1", server.data_addr[1], rank, control_port=server.control_port)
        sync = GradientSync(Worker(t, seed=SEED), model)
        # prepared at construction (Worker.prepare): the memory's two vectors, mapped already
        prepared = list(sync.worker.errors._spare["model"])
        assert len(prepared) == 2 and all(b.dtype == np.float32 and not b.any() for b in prepared)
        for step in range(STEPS):
            x, y = batches(rank, step)
            opt.zero_grad(set_to_none=set_to_none)
            F.cross_entropy(model(x), y).backward()
            sync()
            # the average is each .grad, a view of the sync's bucket (set_to_none=False: the
            # next backward accumulates into it in place)
            assert all(np.shares_memory(p.grad.numpy(), sync.bucket) for p in model.parameters())
            # one rotation per job: the rounds' two vectors are the prepared ones, taken in turn
            # (none made inside a round); a rotation per round keeps a third
            assert any(sync.worker.errors.errors["model"] is b for b in prepared) or rotation == "round"
            opt.step()
        finals[rank] = flat_params(model)
        with pytest.raises(ValueError, match="needs out="):     # refused before any traffic
            sync.worker.allreduce(thc.Pieces([sync.bucket]))
        t.close()

    errors += run_threads(run, N)
    server.stop()
    assert not errors, errors
    return finals


def train_reference(rotation="round"):
    """Same seeds, no network: the THC average computed in-process (Alg. 3; with one rotation
    per job, error feedback in the rotated domain, docs/protocol.md §4 step 8)."""
    cfg = thc.ThcConfig(seed=SEED, rotation=rotation)
    models, opts = [], []
    for _ in range(N):
        torch.manual_seed(0)
        m = MLP(hidden=32)
        models.append(m)
        opts.append(torch.optim.SGD(m.parameters(), lr=0.1))
    rngs = [np.random.default_rng(np.random.SeedSequence([SEED, r])) for r in range(N)]
    errs = [None] * N
    for step in range(STEPS):
        xs = []
        for r in range(N):
            x, y = batches(r, step)
            opts[r].zero_grad()
            F.cross_entropy(models[r](x), y).backward()
            g = flat_grad(list(models[r].parameters())).numpy().astype(np.float32)
            layout = thc.make_layout(g.size, cfg.block_log2,     # each tensor its own blocks
                                     segments=[p.numel() for p in models[r].parameters()])
            if rotation == "job":
                xs.append(thc.rotate(g, cfg, layout, carry=errs[r]))
            else:
                xs.append(g + errs[r] if errs[r] is not None else g)
        norm = thc.rotated_norms if rotation == "job" else thc.block_norms
        norms = np.max([norm(x, layout) for x in xs], axis=0).astype(np.float32).astype(np.float64)
        if rotation == "job":
            res = [np.empty(layout.padded_dim, np.float32) for _ in xs]
            zs = [thc.quantize_rotated(x, norms, cfg, layout, CounterUniforms(key_from(rngs[r])), resid=res[r])
                  for r, x in enumerate(xs)]
        else:
            zs = [thc.encode(x, norms, cfg, layout, step, CounterUniforms(key_from(rngs[r])))   # one key per round
                  for r, x in enumerate(xs)]
        y_avg = (thc.lookup_sum(zs, cfg.table.values) / N).astype(np.float32)
        avg = thc.decode(y_avg, 1, norms, cfg, layout, step)
        for r in range(N):
            own = thc.lookup_sum([zs[r]], cfg.table.values)
            errs[r] = res[r] if rotation == "job" else xs[r] - thc.decode(own, 1, norms, cfg, layout, step)
            off = 0
            for p in models[r].parameters():
                p.grad = torch.from_numpy(avg[off:off + p.numel()].copy()).view_as(p)
                off += p.numel()
            opts[r].step()
    return {r: flat_params(models[r]) for r in range(N)}


@pytest.fixture
def one_torch_thread():
    """Intra-op threading may split reductions differently run to run; pin it for bit-exactness."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("rotation,set_to_none", [("round", True), ("job", True), ("job", False)])
def test_training_through_ps_matches_reference_exactly(one_torch_thread, rotation, set_to_none):
    got, ref = train_through_ps(rotation, set_to_none), train_reference(rotation)
    for r in range(N):
        assert np.array_equal(got[r], ref[r]), np.abs(got[r] - ref[r]).max()
    assert np.array_equal(got[0], got[1])
    torch.manual_seed(0)
    assert not np.array_equal(got[0], flat_params(MLP(hidden=32)))   # the model did move


def test_model_sync_makes_workers_identical():
    job = JobConfig(num_workers=2)
    server = PSServer(job, ("127.0.0.1", 0), control_port=0).start()
    out = {}

    models = []
    for rank in range(2):
        torch.manual_seed(rank)                      # deliberately different models
        models.append(MLP(hidden=8))

    def run(rank):
        model = models[rank]
        t = Transport("127.0.0.1", server.data_addr[1], rank, control_port=server.control_port)
        out[(rank, "before")] = flat_params(model)
        sync_model(Worker(t), model, epoch=0)
        out[(rank, "after")] = flat_params(model)
        t.close()

    errors = run_threads(run, 2, 30)
    server.stop()
    assert not errors, errors
    assert not np.array_equal(out[(0, "before")], out[(1, "before")])
    assert np.array_equal(out[(0, "after")], out[(1, "after")])
    assert np.array_equal(out[(1, "after")], out[(0, "before")])


@pytest.mark.skipif(not os.path.exists("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
                    and not os.environ.get("THC_FASHION_MNIST"),
                    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
def test_train_json_summary_tiny():
    cmd = [sys.executable, "-m", "thc_ps.deploy.cli", "train", "--workers", "2", "--epochs", "1",
           "--train-limit", "512", "--test-limit", "256", "--model", "mlp", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    doc = json.loads(lines[-1])
    assert 0 <= doc["final_test_accuracy"] <= 1 and 0 <= doc["baseline_final_test_accuracy"] <= 1
    assert doc["compression_up"] > 5 and doc["compression_down"] > 3
    assert len(doc["epochs"]) == 1 and "epoch 1/1" in proc.stderr


@pytest.mark.skipif(not os.path.exists("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
                    and not os.environ.get("THC_FASHION_MNIST"),
                    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
def test_train_twice_against_one_long_lived_ps_is_identical():
    """Reproduction: `thc train --ps` twice against one PS gave 0.759, then 0.1315 (chance)."""
    from thc_ps.ps_server.server import PSServer
    server = PSServer(None, ("127.0.0.1", 0)).start()
    try:
        cmd = [sys.executable, "-m", "thc_ps.deploy.cli", "train", "--workers", "2", "--epochs", "1",
               "--train-limit", "512", "--test-limit", "256", "--model", "mlp", "--json",
               "--ps", f"127.0.0.1:{server.data_addr[1]}"]
        docs = []
        for _ in range(2):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr
            docs.append(json.loads([ln for ln in proc.stdout.splitlines() if ln.strip()][-1]))
        assert docs[0]["final_test_accuracy"] > 0.3
        assert docs[1]["final_test_accuracy"] == docs[0]["final_test_accuracy"]   # nothing leaked
        assert server.stats()["jobs_started"] == 2 and server.job is None
    finally:
        server.stop()


def test_train_config_holds_its_job():
    """A training's job options are one JobConfig: 4 workers by default, validated when built,
    re-derived by with_job (table, packet size), picklable for the spawned workers."""
    import pickle

    from thc_ps.deploy.train import TrainConfig
    cfg = TrainConfig()
    assert cfg.job == JobConfig(num_workers=4)
    with pytest.raises(ValueError, match="lane"):
        cfg.with_job(num_workers=16, lane_bits=8)          # 16·30 overflows an 8-bit lane
    # the lane is derived again: 7 bits for 4·30, 8 for 8·30, 16 for 16·30, 8 for another codec
    assert [cfg.with_job(num_workers=n).job.lane_bits for n in (4, 8, 16)] == [7, 8, 16]
    assert cfg.with_job(num_workers=10, granularity=16).job.lane_bits == 8
    for codec in ("none", "topk"):
        assert cfg.with_job(codec=codec).job == JobConfig(num_workers=4, codec=codec)
    assert cfg.job.codec == "thc"
    assert pickle.loads(pickle.dumps(cfg.with_job(quorum=0.5))) == cfg.with_job(quorum=0.5)


@pytest.mark.skipif(not os.path.exists("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
                    and not os.environ.get("THC_FASHION_MNIST"),
                    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
def test_training_survives_a_crashed_worker_that_rejoins():
    """Quorum 0.75: rank 2 dies in epoch 1, the others go on; restarted, it rejoins at the next
    model sync (gets the model, fast-forwards its rounds) and the job ends with every rank's
    model identical."""
    from thc_ps.deploy import train
    # every step takes >= 0.4 s, so the others are still training when the restarted rank is back
    cfg = train.TrainConfig(job=JobConfig(num_workers=4, quorum=0.75), epochs=4, model="mlp", train_limit=2048,
                            test_limit=256, kill_rank=2, kill_at_step=3, restart=True, lease_s=0.5,
                            straggler_delay_ms=400, straggler_prob=1.0)
    lines = []
    doc = train.run(cfg, log=lines.append)
    assert doc["restarted_workers"] == 1 and doc["ps"]["rejoins"] == 1
    assert doc["ps"]["leases_expired"] == 1 and doc["ps"]["partial_rounds"] > 0
    assert doc["final_params_identical"] and doc["final_test_accuracy"] > 0.3
    assert any("3 of 4 ranks reported" in ln for ln in lines)     # epoch 1 without rank 2
    assert sum("models identical: True" in ln for ln in lines) >= 2
