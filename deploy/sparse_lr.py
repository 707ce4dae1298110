"""Sparse logistic regression through the PS: the workload of the SKCompress and FastSGD papers.

No KDD10/KDD12 ships in an installed package, so the dataset is generated from a seed with
their shape: D features whose document frequencies follow a power law (Zipf), a fixed number
of active features per sample, binary labels from a hidden sparse weight vector.  Each worker
computes the gradient of its batch (nonzero only on the features its samples touch), the
gradient goes through the PS with the chosen codec, and every worker applies Adam to the
averaged gradient.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict, dataclass

import numpy as np

from thc_ps.deploy.procs import each_report, single_threaded_children


@dataclass
class SparseLRConfig:
    codec: str = "skcompress"
    workers: int = 4
    features: int = 1 << 20
    samples: int = 40000
    active: int = 30          # nonzero features per sample
    zipf: float = 1.1         # power-law exponent of feature frequencies
    batch: int = 500          # per worker
    steps: int = 60
    lr: float = 0.05
    seed: int = 0


def make_dataset(cfg: SparseLRConfig):
    """(rows × active feature ids, values, labels, test split index) — reproducible from the seed."""
    rng = np.random.default_rng(cfg.seed)
    ranks = np.arange(1, cfg.features + 1, dtype=np.float64)
    p = ranks ** -cfg.zipf
    p /= p.sum()
    perm = rng.permutation(cfg.features)                       # frequent features spread over keys
    feats = perm[rng.choice(cfg.features, (cfg.samples, cfg.active), p=p)]
    vals = rng.random((cfg.samples, cfg.active)).astype(np.float32)
    w_true = np.zeros(cfg.features, np.float32)
    hot = perm[:2000]
    w_true[hot] = rng.standard_normal(2000).astype(np.float32) * 2
    logits = (w_true[feats] * vals).sum(axis=1)
    labels = (rng.random(cfg.samples) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return feats, vals, labels, int(cfg.samples * 0.8)


def loss_and_grad(w, feats, vals, labels):
    z = (w[feats] * vals).sum(axis=1)
    pr = 1 / (1 + np.exp(-z))
    loss = float(np.mean(np.logaddexp(0, z) - labels * z))
    g = np.zeros_like(w)
    np.add.at(g, feats.ravel(), ((pr - labels)[:, None] * vals).ravel() / len(labels))
    return loss, g


def _worker(cfg: SparseLRConfig, rank: int, shard, q) -> None:
    try:
        from thc_ps.worker.client import Worker
        from thc_ps.worker.transport import Transport
        feats, vals, labels, split = make_dataset(cfg)
        t = Transport(shard[0], shard[1], rank, control_port=shard[2], timeout_ms=200)
        w_client = Worker(t, seed=cfg.seed)
        w = np.zeros(cfg.features, np.float32)
        m = np.zeros_like(w)
        v = np.zeros_like(w)
        rng = np.random.default_rng([cfg.seed, 17])
        t.barrier("start")
        up = down = 0
        t0 = time.perf_counter()
        for step in range(cfg.steps):
            idx = rng.choice(split, cfg.batch * cfg.workers, replace=False)[rank::cfg.workers]
            _, g = loss_and_grad(w, feats[idx], vals[idx], labels[idx])
            avg = w_client.allreduce(g, key="w")
            up += w_client.last.bytes_up
            down += w_client.last.bytes_down
            m = 0.9 * m + 0.1 * avg                                  # Adam (paper §7.1 setting)
            v = 0.999 * v + 0.001 * avg * avg
            mh, vh = m / (1 - 0.9 ** (step + 1)), v / (1 - 0.999 ** (step + 1))
            w -= cfg.lr * mh / (np.sqrt(vh) + 1e-8)
        elapsed = time.perf_counter() - t0
        test_loss, _ = loss_and_grad(w, feats[split:], vals[split:], labels[split:])
        z = (w[feats[split:]] * vals[split:]).sum(axis=1)
        acc = float(np.mean((z > 0) == (labels[split:] > 0.5)))
        t.barrier("end")
        t.close()
        q.put((rank, {"test_loss": test_loss, "test_accuracy": acc, "bytes_up": up, "bytes_down": down,
                      "seconds": elapsed, "mean_round_ms": 1e3 * elapsed / cfg.steps}))
    except Exception as exc:
        q.put((rank, f"{type(exc).__name__}: {exc}"))


def run(cfg: SparseLRConfig) -> dict:
    """One training run through a local PS; rank 0's test metrics and its traffic."""
    from thc_ps.proto.job import JobConfig
    from thc_ps.ps_server.server import PSServer
    job = JobConfig(num_workers=cfg.workers, codec=cfg.codec, seed=cfg.seed,
                    lane_bits=16 if cfg.workers * 30 > 255 else 8)
    server = PSServer(job, ("127.0.0.1", 0), control_port=0).start()
    single_threaded_children()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    shard = ("127.0.0.1", server.data_addr[1], server.control_port)
    procs = [ctx.Process(target=_worker, args=(cfg, r, shard, q), daemon=True) for r in range(cfg.workers)]
    for p in procs:
        p.start()
    out = {}
    try:
        for rank, doc in each_report(q, procs, 1800, "sparse LR worker"):
            if isinstance(doc, str):
                raise RuntimeError(f"sparse LR worker {rank} failed: {doc}")
            out[rank] = doc
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
        server.stop()
    return {**asdict(cfg), **out[0]}
