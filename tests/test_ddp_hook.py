"""THC over torch.distributed (gloo): equals the PS path; DDP hook keeps replicas identical."""
import multiprocessing as mp
import os
import socket

import numpy as np
import pytest
import torch

from proto.job import JobConfig
from ps_server.server import PSServer
from worker.client import Worker
from worker.launch_env import from_env
from worker.transport import Transport

from tests.helpers import run_threads

N, DIM, ROUNDS, SEED = 2, 5000, 3, 4


def inputs(rank, r):
    return np.random.default_rng([rank, r, 77]).lognormal(0, 1, DIM).astype(np.float32)


def _port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _hook_proc(rank, port, q, mode):
    import torch.distributed as dist
    from worker.ddp_hook import THCHookState, allreduce_thc, thc_hook
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=N)
    try:
        state = THCHookState(N, rank, seed=SEED)
        if mode == "function":
            outs = [allreduce_thc(state, torch.from_numpy(inputs(rank, r)), key="grad").numpy()
                    for r in range(ROUNDS)]
            q.put((rank, outs))
        else:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            ddp.register_comm_hook(state, thc_hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(rank)
            for _ in range(3):
                opt.zero_grad()
                ddp(torch.randn(8, 20, generator=g)).pow(2).mean().backward()
                opt.step()
            q.put((rank, [torch.cat([p.detach().ravel() for p in model.parameters()]).numpy()]))
            del ddp
        dist.barrier()              # no rank tears gloo down while a peer still uses it
    finally:
        dist.destroy_process_group()


def run_gloo(mode):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_hook_proc, args=(r, port, q, mode)) for r in range(N)]
    for p in procs:
        p.start()
    out = {}
    import queue
    import time
    deadline = time.monotonic() + 120
    while len(out) < N and time.monotonic() < deadline:
        try:
            rank, val = q.get(timeout=1)
            out[rank] = val
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.terminate()
        assert p.exitcode == 0
    assert len(out) == N
    return out


def run_ps():
    server = PSServer(JobConfig(num_workers=N, seed=SEED), ("127.0.0.1", 0), control_port=0).start()
    out = {}

    def run(rank):
        t = Transport("127.0.0.1", server.data_addr[1], rank, control_port=server.control_port)
        w = Worker(t, seed=SEED)
        out[rank] = [w.allreduce(inputs(rank, r), key="grad") for r in range(ROUNDS)]
        t.close()

    errors = run_threads(run, N)
    server.stop()
    assert not errors, errors
    return out


def test_comm_hook_equals_ps_path():
    hook, ps = run_gloo("function"), run_ps()
    for rank in range(N):
        for r in range(ROUNDS):
            assert np.array_equal(hook[rank][r], ps[rank][r]), (rank, r)
    mean = (inputs(0, 0) + inputs(1, 0)) / 2
    assert np.sum((hook[0][0] - mean) ** 2) / np.sum(mean ** 2) < 0.05


def test_ddp_with_thc_hook_keeps_replicas_identical():
    out = run_gloo("ddp")
    assert np.array_equal(out[0][0], out[1][0])


def test_torchrun_env_parsing():
    env = from_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.5",
                    "MASTER_PORT": "29400"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == \
        (2, 4, 0, "10.0.0.5", 29400)
    assert from_env({"RANK": "1", "WORLD_SIZE": "2"}).local_rank == 1
    for bad, msg in (({"WORLD_SIZE": "2"}, "RANK"), ({"RANK": "x", "WORLD_SIZE": "2"}, "integer"),
                     ({"RANK": "3", "WORLD_SIZE": "2"}, "outside"),
                     ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "0"}, "port")):
        with pytest.raises(ValueError, match=msg):
            from_env(bad)
