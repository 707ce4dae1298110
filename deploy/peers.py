"""DDP's own answers beside THC: the same training under torch DDP with a plain fp32
all-reduce, PyTorch's `fp16_compress_hook`, PyTorch's `PowerSGDHook` (rank 1 and 4, with its
warm-up) and this project's THC hook (worker/ddp_hook.py); THC-PS itself is `deploy/train.py`.

Every method trains the same model from the same seed on the same shards with the same
optimizer as `thc train` (deploy/train.py), N processes over gloo on loopback, or each rank
in a host namespace of its own behind a rate-limited link (`net`, a thc_ps.deploy.netns.Star:
rank i in net.hosts[i], gloo on net.ifname, the rendezvous at rank 0's address).  Bytes are
counted where the hooks hand tensors to `torch.distributed.all_reduce`: the payload of every
call, and what a ring all-reduce puts on each rank's link for it, 2(N−1)/N × payload (the
plain fp32 run uses PyTorch's `allreduce_hook`, which is DDP's default all-reduce written as
a hook, so it is counted the same way).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from dataclasses import dataclass

import numpy as np

from thc_ps.deploy.procs import die_with_parent, free_tcp_port, single_threaded_children

#: method name -> (hook family, PowerSGD rank); "thc-ps" is the PS path (deploy/train.py).
METHODS = {"ddp-fp32": ("allreduce", 0), "ddp-fp16": ("fp16", 0), "powersgd-1": ("powersgd", 1),
           "powersgd-4": ("powersgd", 4), "thc-hook": ("thc", 0)}


@dataclass
class AllReduceCounter:
    """Payload bytes of every all_reduce a rank makes (installed over dist.all_reduce)."""

    calls: int = 0
    payload: int = 0

    def install(self):
        import torch.distributed as dist
        original = dist.all_reduce

        def counted(tensor, *args, **kwargs):
            self.calls += 1
            self.payload += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)
        dist.all_reduce = counted
        return original


def make_hook(method: str, world: int, rank: int, seed: int, warmup: int):
    """(state, hook) for a DDP model's register_comm_hook; `warmup`: PowerSGD's plain
    all-reduce iterations before it compresses (start_powerSGD_iter)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    family, r = METHODS[method]
    if family == "allreduce":
        return None, default_hooks.allreduce_hook
    if family == "fp16":
        return None, default_hooks.fp16_compress_hook
    if family == "powersgd":
        # PyTorch's warm-up: plain all-reduce for the first iterations; its default
        # min_compression_rate 2 keeps layers that would not shrink uncompressed
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                            start_powerSGD_iter=max(2, warmup), random_seed=seed)
        return state, powerSGD_hook.powerSGD_hook
    from thc_ps.worker.ddp_hook import THCHookState, thc_hook
    return THCHookState(world, rank, seed=seed), thc_hook


def join_group(rank: int, world: int, port: int, net=None) -> None:
    """This rank's gloo group, as every method's rank starts: in host net.hosts[rank] (gloo on
    the star's interface, the rendezvous at host 0's address) or on loopback; one torch thread."""
    import os

    import torch
    import torch.distributed as dist
    host = "127.0.0.1"
    if net is not None:
        from thc_ps.deploy import netns
        netns.enter(net.hosts[rank])
        os.environ["GLOO_SOCKET_IFNAME"] = net.ifname
        host = net.ips[0]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world)


def _rank_main(method: str, cfg, rank: int, port: int, q, warmup, net=None) -> None:
    die_with_parent()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from thc_ps.deploy.train import AccuracyClock, _evaluate, training_data
    from thc_ps.worker import data
    from thc_ps.worker.training import MODELS, flat_params
    n = cfg.job.num_workers
    join_group(rank, n, port, net)
    try:
        torch.manual_seed(cfg.job.seed)                       # identical initial models, as thc train
        xtr, ytr, xte, yte = training_data(cfg)
        model = MODELS[cfg.model]()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        steps = (len(xtr) // n) // cfg.batch
        # PowerSGD's warm-up defaults to one epoch of steps (at most PyTorch's default 1000)
        state, hook = make_hook(method, n, rank, cfg.job.seed, min(1000, steps) if warmup is None else warmup)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        counter = AllReduceCounter()
        counter.install()
        t_start = time.perf_counter()
        clock = AccuracyClock(cfg.eval_every, lambda: _evaluate(model, xte, yte))
        step = 0
        for epoch in range(cfg.epochs):
            idx = data.shard(len(xtr), rank, n, cfg.job.seed, epoch)
            before, prev, losses = counter.payload, clock.train_s, []
            for s in range(steps):
                b = idx[s * cfg.batch:(s + 1) * cfg.batch]
                opt.zero_grad()
                loss = F.cross_entropy(ddp(torch.from_numpy(xtr[b])), torch.from_numpy(ytr[b]))
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
                step += 1
                clock.step_done(step)
            acc, _ = clock.measure(step)
            seconds = clock.train_s - prev          # the epoch's training time, evaluations left out
            payload = (counter.payload - before) / max(steps, 1)
            q.put(("epoch", rank, {"epoch": epoch + 1, "test_accuracy": acc, "train_loss": float(np.mean(losses)),
                                   "step_ms": 1e3 * seconds / max(steps, 1), "payload_per_step": payload,
                                   "wire_per_step": payload * 2 * (n - 1) / n, "steps": steps,
                                   "wall_s": time.perf_counter() - t_start,
                                   "train_seconds": clock.train_s, "accuracy_curve": list(clock.points),
                                   "param_digest": float(np.abs(flat_params(model)).sum())}))
        q.put(("done", rank, None))
    except Exception as exc:           # reported to the parent
        q.put(("error", rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def spawned_ranks(target, n: int, args_of):
    """n rank processes (spawned, one thread each) running target(*args_of(rank, port, q)),
    with a free TCP port for their gloo group and the queue they report on; joined (killed
    if they hang) when the block ends."""
    port = free_tcp_port()
    single_threaded_children()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=args_of(r, port, q), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    try:
        yield procs, q
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def run_peer(method: str, cfg, log=print, timeout_s: float = 3600, warmup: int | None = None,
             net=None) -> dict:
    """Train cfg's model with `method` (a METHODS key) under DDP; per-epoch rank-0 metrics.
    `warmup`: PowerSGD's uncompressed iterations (default: one epoch's steps, at most 1000).
    `net`: a thc_ps.deploy.netns.Star with a host per rank (rate-limited links), else loopback."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    n = cfg.job.num_workers
    if net is not None and len(net.hosts) < n:
        raise ValueError(f"{n} ranks need {n} hosts, the star has {len(net.hosts)}")
    epochs: dict = {}
    done, deadline = set(), time.monotonic() + timeout_s
    with spawned_ranks(_rank_main, n, lambda r, port, q: (method, cfg, r, port, q, warmup, net)) as (procs, q):
        while len(done) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{method}: no result within {timeout_s:g} s")
            try:
                kind, rank, body = q.get(timeout=1)
            except Exception:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{method}: rank {dead[0]} exited with status "
                                       f"{procs[dead[0]].exitcode}") from None
                continue
            if kind == "error":
                raise RuntimeError(f"{method}: rank {rank} failed: {body}")
            if kind == "done":
                done.add(rank)
                continue
            epochs.setdefault(body["epoch"], {})[rank] = body
            if len(epochs[body["epoch"]]) == n:
                e = epochs[body["epoch"]][0]
                log(f"[{method}] epoch {e['epoch']}/{cfg.epochs}: test acc {e['test_accuracy']:.4f}, step "
                    f"{e['step_ms']:.1f} ms, {e['wire_per_step'] / 1e3:.1f} kB per rank per step each way")
    rows = [epochs[e][0] for e in sorted(epochs)]
    digests = [r["param_digest"] for r in epochs[max(epochs)].values()]
    return {"method": method, "epochs": rows, "final_test_accuracy": rows[-1]["test_accuracy"],
            "replicas_identical": max(digests) - min(digests) <= 1e-6 * max(digests)}

