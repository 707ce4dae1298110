"""`thc train`: a PS and N worker processes on this host train a model on Fashion-MNIST.

Each worker trains on its 1/n shard of every epoch's shared permutation,
synchronizes gradients through the PS after each backward pass (THC over UDP,
or float32 for the baseline), and evaluates on the test set at each epoch's
end.  The same run is then repeated uncompressed for the comparison.
"""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from thc_ps.deploy.procs import (die_with_parent, leave_on_sigterm, single_threaded_children, start_shielded,
                          stop_children)
from thc_ps.proto.job import LANE_AUTO, JobConfig


#: TrainConfig.grad_sync's choices (`thc train --grad-sync`).
GRAD_SYNC = ("auto", "hook", "after-backward")


@dataclass
class TrainConfig:
    """A training run: the job it runs (validated when built: n·g must fit the lane, ...) and
    the training's own options."""

    job: JobConfig = field(default_factory=lambda: JobConfig(num_workers=4))
    epochs: int = 3
    model: str = "cnn"
    batch: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    loss: float = 0.0
    loss_policy: str = "retransmit"
    straggler_delay_ms: float = 0.0
    straggler_prob: float = 0.0
    sync_every: int = 1
    train_limit: int = 0      # 0: the whole training set
    test_limit: int = 0
    timeout_ms: float = 50.0
    straggler_count: int = 0  # k random stragglers per round (the paper's §8.3 scheme)
    ps: str = ""              # use a running PS "host:port[,host:port…]" instead of starting one
    curve_every: int = 20     # steps per point of the train-loss curve
    eval_every: int = 0       # steps per test-accuracy point (0: at each epoch's end only)
    per_tensor: bool = False  # one PS round per parameter tensor instead of one per model
    kill_rank: int = -1       # fault injection: this rank's process dies at kill_at_step ...
    kill_at_step: int = 0
    restart: bool = False     # ... and is started again: it rejoins at the next model sync
    lease_s: float = 5.0      # the PS this starts
    job_name: str = ""        # the job's name on a running PS ("": a fresh one per run)
    rank_netns: tuple = ()    # with ps: rank i runs in network namespace rank_netns[i] (a host each)
    # how gradients reach the PS: "hook", DDP's communication hook (each bucket's round while
    # backward goes on, worker/ps_hook.py); "after-backward", one round per model (or per tensor)
    # once backward has ended (worker/training.py GradientSync); "auto": the hook only for a
    # model whose gradients fill more than one bucket (uses_hook_for)
    grad_sync: str = "auto"
    rendezvous: str = ""      # the hook's gloo rendezvous HOST:PORT (rank 0 serves it); "": loopback
    bucket_cap_mb: float = 25.0   # DDP's bucket size with the hook (its default)
    keys: str = ""            # CURVE key directory (`thc keys`) of the PS this starts, or of cfg.ps

    def __post_init__(self):
        if self.grad_sync not in GRAD_SYNC:
            raise ValueError(f"grad_sync must be one of {', '.join(GRAD_SYNC)}, got {self.grad_sync!r}")
        if self.grad_sync == "hook" and self.per_tensor:
            raise ValueError("per-tensor rounds need --grad-sync after-backward (DDP's hook gets buckets, "
                             "not tensors)")
        if self.grad_sync == "hook" and self.restart:
            raise ValueError("a killed rank's restart needs --grad-sync after-backward (a restarted rank "
                             "fast-forwards by the model's rounds, which DDP's buckets do not state)")
        if not 0 < self.bucket_cap_mb <= 1 << 14:
            raise ValueError(f"bucket_cap_mb must be in (0, 16384], got {self.bucket_cap_mb}")

    def uses_hook_for(self, params: int) -> bool:
        """Whether a model of `params` float32 parameters sends its gradients through DDP's
        communication hook (grad_sync resolved).  "auto" takes the hook only where it can
        overlap a round with backward: when the gradients fill more than one bucket
        (bucket_cap_mb).  A model in one bucket gets its round when backward ends either way,
        and after backward its round reads the gradients where backward left them, without
        DDP's reducer and the hand-off to the hook's thread (docs/bench.md, "Defaults that
        win");
        per-tensor rounds and a restarted rank need after-backward."""
        if self.grad_sync == "auto":
            return not (self.per_tensor or self.restart) and 4 * params > self.bucket_cap_mb * (1 << 20)
        return self.grad_sync == "hook"

    @property
    def uses_hook(self) -> bool:
        """`uses_hook_for` the run's model (`model`)."""
        return self.uses_hook_for(model_params(self.model))

    def with_job(self, **changes) -> TrainConfig:
        """A copy whose job has `changes` (JobConfig's field names); its derived fields (table,
        elems_per_packet, and the lane: the narrowest that holds the new n·g) are derived again
        unless given."""
        return replace(self, job=replace(self.job, **{"table": (), "elems_per_packet": 0, "lane_bits": LANE_AUTO,
                                                      **changes}))


@functools.cache
def model_params(name: str) -> int:
    """The parameters of thc_ps.worker.training.MODELS[name]."""
    from thc_ps.worker.training import MODELS
    return sum(p.numel() for p in MODELS[name]().parameters())


def training_data(cfg: TrainConfig) -> tuple:
    """(train images, train labels, test images, test labels) of a run, cut to its limits."""
    from thc_ps.worker import data
    xtr, ytr = data.load("train")
    xte, yte = data.load("test")
    if cfg.train_limit:
        xtr, ytr = xtr[:cfg.train_limit], ytr[:cfg.train_limit]
    if cfg.test_limit:
        xte, yte = xte[:cfg.test_limit], yte[:cfg.test_limit]
    return xtr, ytr, xte, yte


class AccuracyClock:
    """Training time with the evaluations left out, and the test accuracy against it: a point
    (seconds, step, accuracy) every `every` steps and at each epoch's end, so that the time to
    a target accuracy is not rounded up to a whole epoch and no method pays for evaluating."""

    def __init__(self, every: int, evaluate):
        self.every, self.evaluate = every, evaluate
        self.train_s, self.points = 0.0, []
        self._since = time.perf_counter()

    def step_done(self, step: int) -> None:
        if self.every and step % self.every == 0:
            self.measure(step)

    def measure(self, step: int) -> tuple[float, float]:
        """(accuracy, loss) on the test set now; the clock stops while it is computed."""
        self.train_s += time.perf_counter() - self._since
        acc, loss = self.evaluate()
        if not self.points or self.points[-1][1] != step:
            self.points.append((self.train_s, step, acc))
        self._since = time.perf_counter()
        return acc, loss


def _evaluate(model, x, y, batch=1000) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            xb, yb = torch.from_numpy(x[i:i + batch]), torch.from_numpy(y[i:i + batch])
            out = model(xb)
            loss += float(F.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
    model.train()
    return correct / len(x), loss / len(x)


def _init_gloo(cfg: TrainConfig, rank: int, store_port: int):
    """The gloo process group DDP needs beside the hook (its start-up broadcast of the model;
    the gradients go through the PS).  On loopback the parent holds the TCP store at
    127.0.0.1:store_port; across hosts rank 0 serves it at cfg.rendezvous."""
    import datetime

    import torch.distributed as dist
    n = cfg.job.num_workers
    host, port, master = "127.0.0.1", store_port, False
    if cfg.rendezvous:
        host, _, text = cfg.rendezvous.rpartition(":")
        port, master = int(text), rank == 0
    store = dist.TCPStore(host, port, n, is_master=master, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n)


def worker_main(cfg: TrainConfig, rank: int, shards: list, q, job_msg: dict | None = None,
                rejoin: bool = False, store_port: int = 0) -> None:
    """One worker process: train, report per-epoch metrics on the queue.  Stopped by the
    parent (SIGTERM: it was interrupted), it leaves its job and exits without a word; a
    refused registration (a ValueError: the job's configuration, the keys) is reported as
    `refused`, for exit status 2."""
    die_with_parent()
    leave_on_sigterm()
    t = path = None
    try:
        if cfg.rank_netns:
            from thc_ps.deploy import netns
            netns.enter(cfg.rank_netns[rank])
            os.environ.setdefault("GLOO_SOCKET_IFNAME", netns.Star.ifname)
        elif cfg.uses_hook:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch
        import torch.nn.functional as F

        from thc_ps.worker import data
        from thc_ps.worker.client import Worker
        from thc_ps.deploy.launch import KILLED
        from thc_ps.worker.training import MODELS, flat_params, rejoin_step, rejoin_training, sync_model
        from thc_ps.worker.transport import Faults, LeaseLost, Transport
        torch.set_num_threads(1)
        torch.manual_seed(cfg.job.seed)                  # identical initial models
        xtr, ytr, xte, yte = training_data(cfg)
        model = MODELS[cfg.model]()
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        faults = Faults(drop_out=cfg.loss, drop_in=cfg.loss, seed=cfg.job.seed)
        job = JobConfig.from_msg(job_msg) if job_msg else None
        try:
            t = Transport(shards[0][0], shards[0][1], rank, control_port=shards[0][2],
                          policy=cfg.loss_policy, faults=faults, timeout_ms=cfg.timeout_ms, shards=shards,
                          expect=job_msg, propose=job,   # the PS must run this job (or start it)
                          rejoin=rejoin, job_name=cfg.job_name or None, keys=cfg.keys or None)
        except ValueError as exc:
            if rejoin and "no running job to rejoin" in str(exc):   # the others already finished
                q.put(("done", rank, {"rejoin_refused": 1}))
                return
            raise
        w = Worker(t, seed=cfg.job.seed, straggler_delay_ms=cfg.straggler_delay_ms,
                   straggler_prob=cfg.straggler_prob, straggler_count=cfg.straggler_count)
        path = _GradPath(cfg, rank, model, w, store_port)
        sync = path.sync
        steps = (len(xtr) // cfg.job.num_workers) // cfg.batch    # the same in every rank
        first = 0
        if t.rejoined:
            first = rejoin_training(sync, model, steps, cfg.sync_every)
        else:
            t.barrier("start")
        clock = None
        while True:             # again from the epoch a rank that lost its lease rejoined at
            try:
                step = first * steps
                for epoch in range(first, cfg.epochs):
                    idx = data.shard(len(xtr), rank, cfg.job.num_workers, cfg.job.seed, epoch)
                    t0 = time.perf_counter()
                    comm, phases, up, down, losses, lost, curve = 0.0, 0.0, 0, 0, [], 0, []
                    if clock is None:
                        clock = AccuracyClock(cfg.eval_every, lambda: _evaluate(model, xte, yte))
                    prev = clock.train_s
                    for s in range(steps):
                        b = idx[s * cfg.batch:(s + 1) * cfg.batch]
                        xb, yb = torch.from_numpy(xtr[b]), torch.from_numpy(ytr[b])
                        t.progress = step
                        if rank == cfg.kill_rank and step == cfg.kill_at_step and not rejoin:
                            os._exit(KILLED)
                        opt.zero_grad()
                        loss = F.cross_entropy(path.net(xb), yb)
                        try:
                            path.backward(loss)
                        except LeaseLost as exc:
                            print(f"rank {rank}: {exc}; rejoining", file=sys.stderr, flush=True)
                            if cfg.job.quorum < 1:       # the others went on: take the model at a sync
                                w.rejoin()
                                raise _Rejoined(rejoin_training(sync, model, steps, cfg.sync_every)) from None
                            rejoin_step(sync, step)
                            path.again(lambda x=xb, y=yb: (opt.zero_grad(), F.cross_entropy(path.net(x), y))[1])
                        opt.step()
                        rep = w.last
                        comm += rep.seconds
                        phases += rep.phase_seconds
                        up += rep.bytes_up
                        down += rep.bytes_down
                        lost += rep.lost
                        losses.append(float(loss.detach()))
                        step += 1
                        if step % cfg.curve_every == 0:
                            curve.append((step, float(np.mean(losses[-cfg.curve_every:]))))
                        clock.step_done(step)
                    if cfg.sync_every and (epoch + 1) % cfg.sync_every == 0:
                        sync_model(w, model, epoch)
                    t.progress = step
                    acc, test_loss = clock.measure(step)
                    digest = float(np.abs(flat_params(model)).sum())
                    q.put(("epoch", rank, {"epoch": epoch + 1, "train_loss": float(np.mean(losses)),
                                           "test_accuracy": acc, "test_loss": test_loss,
                                           "epoch_seconds": time.perf_counter() - t0,
                                           "mean_round_ms": 1e3 * comm / max(steps, 1), "steps": steps,
                                           "mean_phase_ms": 1e3 * phases / max(steps, 1),
                                           "bytes_up": up, "bytes_down": down, "lost_chunks": lost,
                                           "param_digest": digest, "step": step, "loss_curve": curve,
                                           "train_seconds": clock.train_s, "accuracy_curve": list(clock.points),
                                           "train_epoch_seconds": clock.train_s - prev}))
                break
            except _Rejoined as again:
                first = again.epoch
        t.barrier("end")
        counters = dict(t.stats.counters)
        if rank == 0:
            counters["ps_stats"] = t.call({"type": "stats"})["stats"]
        q.put(("done", rank, counters))
        t.close()
    except KeyboardInterrupt:
        if t is not None:
            t.close()               # leaves the job: a running PS ends it now, not after the lease
    except ValueError as exc:
        q.put(("refused", rank, str(exc)))
    except Exception as exc:
        q.put(("error", rank, f"{type(exc).__name__}: {exc}"))
    finally:
        if path is not None:
            path.close()
        _destroy_gloo()


class _GradPath:
    """How a step's gradients reach the PS: one round per model (or tensor) after backward
    (worker/training.py GradientSync), or each DDP bucket's round inside backward
    (worker/ps_hook.py).  `net` is what the step runs forward; `sync` what a rejoining rank
    fast-forwards with."""

    def __init__(self, cfg: TrainConfig, rank: int, model, worker, store_port: int):
        from thc_ps.worker.training import GradientSync
        self.worker, self.net, self.hook = worker, model, None
        if not cfg.uses_hook:
            self.sync = GradientSync(worker, model, per_tensor=cfg.per_tensor)
        else:
            import torch

            from thc_ps.worker.ps_hook import HookSync, PSHookState, merged_report, ps_hook
            self._merged = merged_report
            _init_gloo(cfg, rank, store_port)
            # the gradients live in the buckets (no copy in and out of them each step)
            self.net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb,
                                                                 gradient_as_bucket_view=True)
            self.hook = PSHookState(worker, world_size=cfg.job.num_workers, keep_reports=True)
            self.net.register_comm_hook(self.hook, ps_hook)
            self.sync = HookSync(self.hook)

    def backward(self, loss) -> None:
        """backward and the step's rounds; a round's own error (LeaseLost, ...) is raised as
        itself, not as the RuntimeError DDP wraps it in."""
        if self.hook is None:
            loss.backward()
            self.sync()
            return
        try:
            loss.backward()
        except RuntimeError:
            self.hook.raise_error()
            raise
        rep = self._merged(self.hook.take_reports())
        if rep is not None:
            self.worker.last = rep

    def again(self, recompute) -> None:
        """The step's rounds once more after a rejoin: after backward the gradients are still
        there; through the hook the step's backward runs again (`recompute()` gives its loss)."""
        if self.hook is None:
            self.sync()
        else:
            self.backward(recompute())

    def close(self) -> None:
        if self.hook is not None:
            self.hook.close()


def _destroy_gloo() -> None:
    """gloo processes must destroy their group before exiting (else gloo may abort at exit)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _Rejoined(Exception):
    """Internal: this rank lost its lease in a quorum job and rejoined at a model sync."""

    def __init__(self, epoch: int):
        super().__init__(epoch)
        self.epoch = epoch


def _log_epoch(cfg: TrainConfig, e: dict, log) -> None:
    """One progress line from the ranks' reports of an epoch."""
    r0 = e[min(e)]
    n = cfg.job.num_workers
    ranks = "" if len(e) == n else f" ({len(e)} of {n} ranks reported)"
    log(f"[{cfg.job.codec}] epoch {r0['epoch']}/{cfg.epochs}: train loss {r0['train_loss']:.4f}, "
        f"test acc {r0['test_accuracy']:.4f}, round {r0['mean_round_ms']:.1f} ms, "
        f"up {r0['bytes_up'] / 1e6:.2f} MB, down {r0['bytes_down'] / 1e6:.2f} MB per worker, "
        f"lost chunks {sum(e[r]['lost_chunks'] for r in e)}, "
        f"models identical: {_identical(e)}{ranks}")


def run(cfg: TrainConfig, log=print) -> dict:
    """Train once with cfg; returns the per-epoch history (rank 0's metrics, and the chunks
    all ranks lost, as the progress lines count them) and totals."""
    from thc_ps.ps_server.server import PSServer
    from thc_ps.worker import data
    data.load("test")   # fail early, with the install hint, if the dataset is missing
    job = cfg.job
    server = None
    if cfg.ps:
        if not cfg.job_name:        # a fresh name: runs started together train side by side
            import secrets
            cfg = replace(cfg, job_name=f"train-{secrets.token_hex(4)}")
        from thc_ps.proto.addresses import parse_ps
        shards = parse_ps(cfg.ps)
    else:
        server = PSServer(job, ("127.0.0.1", 0), control_port=0, lease_s=cfg.lease_s,
                          keys=cfg.keys or None).start()
        shards = [("127.0.0.1", server.data_addr[1], server.control_port)]
    from thc_ps.deploy.launch import KILLED
    single_threaded_children()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = None
    if cfg.uses_hook and not cfg.rendezvous:      # the gloo rendezvous, held here: no port race
        import datetime

        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, job.num_workers, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=120))

    def spawn(r, rejoin=False):
        proc = ctx.Process(target=worker_main, args=(cfg, r, shards, q, job.to_msg(), rejoin,
                                                     store.port if store is not None else 0), daemon=True)
        start_shielded(proc)            # Ctrl-C is this process's: it stops the workers (one line, 130)
        return proc
    procs = [spawn(r) for r in range(job.num_workers)]
    history: dict = {}
    done, counters, printed = set(), {}, set()
    restarted = 0
    t0 = time.perf_counter()
    try:
        while len(done) < job.num_workers:
            try:
                kind, rank, body = q.get(timeout=1)
            except Exception:
                for r, proc in enumerate(procs):
                    if proc.exitcode == KILLED and cfg.restart and not restarted:
                        log(f"[{job.codec}] rank {r} died (fault injection); restarting it: it rejoins "
                            f"at the next model sync")
                        restarted += 1
                        procs[r] = spawn(r, rejoin=True)
                if not any(p.is_alive() for p in procs):
                    raise RuntimeError("worker processes exited without reporting") from None
                continue
            if kind == "error":
                raise RuntimeError(f"worker {rank} failed: {body}")
            if kind == "refused":
                raise ValueError(body)          # exit status 2, the reason once
            if kind == "done":
                done.add(rank)
                counters[rank] = body
                continue
            history.setdefault(body["epoch"], {})[rank] = body
            for ep in sorted(history):
                # an epoch is complete when every rank reported it, or when a later one began
                # (a rank that died during it never will)
                if ep not in printed and (len(history[ep]) == job.num_workers or
                                          any(later > ep for later in history)):
                    printed.add(ep)
                    _log_epoch(cfg, history[ep], log)
    except KeyboardInterrupt:
        stop_children(procs)
        raise
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
        ps_stats = server.stats() if server is not None else counters.get(0, {}).pop("ps_stats", None)
        if server is not None:
            server.stop()
    for ep in sorted(set(history) - printed):
        _log_epoch(cfg, history[ep], log)
    epochs = epoch_records(history)
    return {"config": asdict(cfg), "epochs": epochs, "seconds": time.perf_counter() - t0,
            "final_test_accuracy": epochs[-1]["test_accuracy"],
            "bytes_up": sum(e["bytes_up"] for e in epochs), "bytes_down": sum(e["bytes_down"] for e in epochs),
            "ps": ps_stats, "transport": counters, "restarted_workers": restarted,
            "final_params_identical": _identical(history[max(history)]) if history else None}


def epoch_records(history: dict) -> list:
    """{epoch: {rank: report}} → one record per epoch: rank 0's metrics (or the lowest rank's
    that reported), with `lost_chunks` summed over every rank that reported, as the progress
    lines count them."""
    return [{**history[e][min(history[e])], "lost_chunks": sum(r["lost_chunks"] for r in history[e].values())}
            for e in sorted(history)]


def _identical(reports: dict) -> bool:
    digests = [r["param_digest"] for r in reports.values()]
    return max(digests) - min(digests) < 1e-6 * max(digests)


def run_with_baseline(cfg: TrainConfig, log=print, baseline: bool = True) -> dict:
    """The run, then the same run uncompressed (codec none, no injected faults)."""
    main = run(cfg, log)
    doc = {"final_test_accuracy": main["final_test_accuracy"], "run": main}
    if baseline and cfg.job.codec != "none":
        base_cfg = cfg.with_job(codec="none")
        base = run(base_cfg, log)
        doc.update(baseline_final_test_accuracy=base["final_test_accuracy"], baseline=base,
                   compression_up=base["bytes_up"] / max(main["bytes_up"], 1),
                   compression_down=base["bytes_down"] / max(main["bytes_down"], 1))
    return doc


def print_comparison(doc: dict, out=sys.stdout) -> None:
    main = doc["run"]
    print(f"\n{main['config']['job']['codec']}: final test accuracy {main['final_test_accuracy']:.4f}, "
          f"{main['bytes_up'] / 1e6:.1f} MB up / {main['bytes_down'] / 1e6:.1f} MB down per worker, "
          f"{main['seconds']:.0f} s", file=out)
    if "baseline" in doc:
        base = doc["baseline"]
        print(f"uncompressed: final test accuracy {base['final_test_accuracy']:.4f}, "
              f"{base['bytes_up'] / 1e6:.1f} MB up / {base['bytes_down'] / 1e6:.1f} MB down per worker, "
              f"{base['seconds']:.0f} s", file=out)
        print(f"bytes saved: {doc['compression_up']:.1f}x up, {doc['compression_down']:.1f}x down; "
              f"accuracy difference {main['final_test_accuracy'] - base['final_test_accuracy']:+.4f}",
              file=out)
