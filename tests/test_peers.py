"""DDP's own hooks beside THC (deploy/peers.py): each method trains a tiny step, replicas stay
identical, the bytes are what each method should move, and DDP's fp32 sum equals the PS's."""
import multiprocessing as mp
import os
import socket

import numpy as np
import pytest

from thc_ps.deploy.launch import gradient
from thc_ps.deploy.peers import METHODS, run_peer
from thc_ps.deploy.train import TrainConfig
from thc_ps.proto.job import JobConfig

pytestmark = pytest.mark.skipif(
    not os.path.exists("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
    and not os.environ.get("THC_FASHION_MNIST"), reason="Fashion-MNIST not installed (apt-get install "
    "dataset-fashion-mnist)")

CFG = TrainConfig(job=JobConfig(num_workers=2), epochs=1, model="mlp", train_limit=512, test_limit=64)


@pytest.fixture(scope="module")
def runs():
    # 4 steps per rank; PowerSGD compresses from its 3rd step
    return {m: run_peer(m, CFG, log=lambda _m: None, timeout_s=300, warmup=2) for m in METHODS}


def test_every_method_trains_and_keeps_replicas_identical(runs):
    for m, doc in runs.items():
        e = doc["epochs"][0]
        assert doc["replicas_identical"], m
        assert e["steps"] == 4 and 0 <= e["test_accuracy"] <= 1 and e["payload_per_step"] > 0, (m, e)


def test_each_method_moves_the_bytes_it_should(runs):
    from thc_ps.worker.training import MODELS
    params = sum(p.numel() for p in MODELS["mlp"]().parameters())
    pay = {m: doc["epochs"][0]["payload_per_step"] for m, doc in runs.items()}
    assert pay["ddp-fp32"] == 4 * params                     # one float32 per parameter
    assert pay["ddp-fp16"] == 2 * params
    assert runs["ddp-fp32"]["epochs"][0]["wire_per_step"] == 4 * params   # ring, n = 2: 2(n−1)/n = 1
    # 8-bit lanes of each tensor's own RHT blocks (100,352 in 2^16 + 2^15 + 2^12; 1,280 in 2^11;
    # 128; 10 in 16), plus a float32 norm each
    assert params == 101_770 and pay["thc-hook"] == (1 << 16) + (1 << 15) + (1 << 12) + 2048 + 128 + 16 + 6 * 4
    assert pay["powersgd-1"] < pay["powersgd-4"] < pay["ddp-fp32"]


def _gloo_sum(rank, port, q):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        x = torch.from_numpy(gradient(5, 0, rank, 3000))
        dist.all_reduce(x)
        q.put((rank, x.numpy()))
    finally:
        dist.destroy_process_group()


def test_ddp_fp32_sum_equals_the_ps_float32_path():
    from thc_ps.ps_server.server import PSServer
    from tests.helpers import run_threads
    from thc_ps.worker.client import Worker
    from thc_ps.worker.transport import Transport
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gloo_sum, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    gloo = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    server = PSServer(JobConfig(num_workers=2, codec="none"), ("127.0.0.1", 0), control_port=0).start()
    ps = {}

    def run(rank):
        t = Transport("127.0.0.1", server.data_addr[1], rank, control_port=server.control_port)
        ps[rank] = Worker(t).allreduce(gradient(5, 0, rank, 3000)) * 2     # the PS returns sum / k
        t.close()
    try:
        assert not run_threads(run, 2)
    finally:
        server.stop()
    assert np.array_equal(gloo[0], gloo[1]) and np.array_equal(gloo[0], ps[0]) and np.array_equal(ps[0], ps[1])


def test_the_peers_experiment_writes_its_table_and_plot(tmp_path):
    from thc_ps.deploy import experiments
    path = experiments.peers(CFG, "thc experiment peers", log=lambda _m: None, out=tmp_path,
                             methods=("ddp-fp16", "thc-ps"))
    text = path.read_text()
    assert path == tmp_path / "peers.md" and (tmp_path / "peers.json").exists()
    assert "| ddp-fp16 |" in text and "| thc-ps |" in text
    import json
    rows = {r["method"]: r for r in json.loads((tmp_path / "peers.json").read_text())}
    assert rows["thc-ps"]["up_per_step"] < rows["thc-ps"]["down_per_step"] < rows["ddp-fp16"]["up_per_step"]


@pytest.mark.skipif(__import__("thc_ps.deploy.netns").deploy.netns.unavailable(need_tc=True) is not None,
                    reason=__import__("thc_ps.deploy.netns").deploy.netns.unavailable(need_tc=True) or "")
def test_under_a_link_cap_every_rank_and_the_ps_have_a_capped_link_of_their_own(tmp_path):
    """--peer-rates: DDP's ranks and THC-PS's workers and PS each in a host namespace behind a
    50 Mbit/s link: DDP fp32's step now pays for its ring's bytes on the link; THC-PS still
    trains with identical replicas through a PS in its own namespace."""
    import json

    from thc_ps.deploy import experiments
    from thc_ps.worker.training import MODELS
    path = experiments.peers(CFG, "thc experiment peers --peer-rates 0,50", log=lambda _m: None, out=tmp_path,
                             methods=("ddp-fp32", "thc-ps"), rates=(None, 50), layouts=("ps-host",))
    rows = {(r["rate_mbit"], r["method"]): r for r in json.loads((tmp_path / "peers.json").read_text())}
    assert set(rows) == {(None, "ddp-fp32"), (None, "thc-ps"), (50, "ddp-fp32"), (50, "thc-ps")}
    params = sum(p.numel() for p in MODELS["mlp"]().parameters())
    link_ms = 1e3 * rows[50, "ddp-fp32"]["up_per_step"] * 8 / 50e6       # the ring's bytes at 50 Mbit/s
    assert rows[50, "ddp-fp32"]["up_per_step"] == 4 * params
    assert rows[50, "ddp-fp32"]["step_ms"] > rows[None, "ddp-fp32"]["step_ms"] + 0.5 * link_ms, rows
    assert rows[50, "thc-ps"]["up_per_step"] == rows[None, "thc-ps"]["up_per_step"]
    assert all(r["replicas_identical"] for r in rows.values()), rows
    assert "| 50 Mbit/s | thc-ps | ps-host |" in path.read_text()
    # every host's link was counted: 2 ranks and the PS; the PS's link carried both workers' chunks
    capped = rows[50, "thc-ps"]
    assert capped["layout"] == "ps-host" and capped["params"] == params and len(capped["link_bytes_per_step"]) == 3
    assert capped["link_bytes_per_step"][2][1] > 2 * capped["up_per_step"] > 0
    assert rows[50, "ddp-fp32"]["max_link_bytes_per_step"] > 4 * params       # the ring's 2(n-1)/n·4d, n = 2
    assert rows[None, "ddp-fp32"]["layout"] == "ring" and "link_bytes_per_step" not in rows[None, "ddp-fp32"]
    listed = __import__("subprocess").run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "thchub-" not in listed
