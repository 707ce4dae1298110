"""Training through THC-PS: gradient synchronization after backward, and model sync.

`GradientSync` flattens a model's gradients into one bucket, averages it through
the PS (THC with error feedback kept per bucket key by the Worker, or float32
for codec "none"), and makes the average the parameters' `.grad` — the PS-side
counterpart of a DDP communication hook with explicit state.

Periodic model synchronization (THC §6.1, §8.3): rank 0 publishes its
parameters through the control plane and every other rank loads them, which
repairs the divergence that lost results cause under the `zero` policy.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from thc_ps.compression.thc import Pieces
from thc_ps.worker.client import Worker


class SmallCNN(nn.Module):
    """A small CNN for 28×28 grey images (≈ 50k parameters)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 7 * 7, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x):
        return self.head(self.features(x))


class MLP(nn.Module):
    def __init__(self, classes: int = 10, hidden: int = 128):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class WideMLP(MLP):
    """784-2600-10 MLP, 2 067 010 parameters (8.3 MB of float32 gradients): large enough that
    the link dominates a round at 100 Mbit/s and 1 Gbit/s (the bandwidth experiment), and
    RHT blocks of 2^20 and its tail in smaller ones pad it by 1,470 coordinates (0.07%), so the
    bytes on the wire are the ones the 4-bit/8-bit limit counts."""

    def __init__(self, classes: int = 10):
        super().__init__(classes, hidden=2600)


MODELS = {"cnn": SmallCNN, "mlp": MLP, "mlp-wide": WideMLP}


def flat_grad(params) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def write_flat_grad(params, flat: torch.Tensor) -> None:
    off = 0
    for p in params:
        n = p.numel()
        chunk = flat[off:off + n].view_as(p)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)
        off += n


def flat_params(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().astype(np.float32)


def load_flat_params(model: nn.Module, flat: np.ndarray) -> None:
    off = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(torch.from_numpy(flat[off:off + n]).view_as(p))
            off += n


class GradientSync:
    """Average gradients through the PS after each backward pass.

    One bucket for the whole model by default (one round per step); `per_tensor=True` sends
    every parameter tensor as its own round, as codecs with one scale per layer (3LC, CASQ)
    are meant to be used.
    """

    def __init__(self, worker: Worker, model: nn.Module, key: str = "model", per_tensor: bool = False):
        self.worker = worker
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.key = key
        self.per_tensor = per_tensor
        # each tensor its own RHT blocks in the one round (thc.make_layout's segments)
        self.sizes = tuple(p.numel() for p in self.params)
        # one float32 bucket kept across steps; after a step each .grad is a view of it (as
        # DDP's gradient_as_bucket_view), and the average is decoded into it: no new vector of d
        # and no copy back.  The gradients go to the round as pieces (thc.Pieces): a job with
        # one rotation reads them where backward left them, any other round copies them in once
        self.bucket = None
        if not per_tensor and self.params and all(p.dtype == torch.float32 and p.device.type == "cpu"
                                                  for p in self.params):
            self.bucket = np.empty(sum(p.numel() for p in self.params), dtype=np.float32)
            self.bucket.fill(0.0)       # its pages mapped now, not by the first round's decode
            worker.prepare(self.bucket.size, key, self.sizes)
            self.views, off = [], 0
            for p in self.params:
                self.views.append(torch.from_numpy(self.bucket[off:off + p.numel()]).view_as(p))
                off += p.numel()

    def __call__(self) -> None:
        if self.bucket is not None:
            pieces = []
            for p, v in zip(self.params, self.views):
                if p.grad is None:
                    v.zero_()
                    pieces.append(v.numpy().reshape(-1))
                else:       # a new gradient (zero_grad set it to None) or the bucket's view
                    pieces.append(p.grad.detach().reshape(-1).numpy())
            self.worker.allreduce(Pieces(pieces), key=self.key, out=self.bucket)
            for p, v in zip(self.params, self.views):
                p.grad = v
            return
        if not self.per_tensor:
            write_flat_grad(self.params, self.worker.allreduce(flat_grad(self.params), key=self.key,
                                                               segments=self.sizes))
            return
        last, averages = None, []
        for i, p in enumerate(self.params):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            averages.append(self.worker.allreduce(g.reshape(-1), key=f"{self.key}.{i}"))
            last = self._merge(last, self.worker.last)
        # written once every tensor is back: a step interrupted (LeaseLost) can run again
        for p, avg in zip(self.params, averages):
            write_flat_grad([p], avg)
        self.worker.last = last

    def skip_step(self) -> None:
        """Advance the slot rounds as one step's allreduces would, sending nothing."""
        if self.per_tensor:
            for d in self.sizes:
                self.worker.skip_rounds(1, d)
        else:
            self.worker.skip_rounds(1, sum(self.sizes), self.sizes)

    @staticmethod
    def _merge(acc, rep):
        """One report for the whole step (time and bytes summed over the tensors)."""
        if acc is None:
            return rep
        acc.seconds += rep.seconds
        acc.phase_seconds += rep.phase_seconds
        acc.bytes_up += rep.bytes_up
        acc.bytes_down += rep.bytes_down
        acc.lost += rep.lost
        return acc


def rejoin_step(sync: GradientSync, step: int) -> None:
    """A rank whose lease expired during `step`'s allreduce, in a quorum-1 job: the others
    cannot have gone past that step without it, so it registers again, fast-forwards its
    slot rounds to the step and the caller runs the step's allreduce again (its gradients
    are untouched until every tensor is back)."""
    w = sync.worker
    w.rejoin()
    others = w.t.others_step()
    if others != step:
        raise RuntimeError(f"rank {w.t.worker_id} lost its lease at step {step}, and the others are "
                           f"at step {others}: a quorum-1 job cannot have moved on without it")
    for _ in range(step):
        sync.skip_step()
    w.t.progress = step


def rejoin_training(sync: GradientSync, model: nn.Module, steps_per_epoch: int, sync_every: int) -> int:
    """A restarted rank joins a running training job (quorum < 1: the others went on without
    it): it waits for the next model sync, takes that model, fast-forwards its slot rounds
    to the step after the sync, and returns the epoch to continue with."""
    t = sync.worker.t
    if not sync_every:
        raise ValueError("a rank can rejoin a training job only if the job synchronizes the model "
                         "(--sync-every > 0)")
    progress = t.call({"type": "status"}).get("progress", {})
    step = max((v for k, v in progress.items() if int(k) != t.worker_id and v >= 0), default=0)
    epoch = step // max(steps_per_epoch, 1)
    while (epoch + 1) % sync_every:
        epoch += 1
    blob = t.call({"type": "sync_get", "round": epoch}, wait=True)["blob"]
    load_flat_params(model, np.frombuffer(blob, dtype=np.float32).copy())
    for _ in range((epoch + 1) * steps_per_epoch):
        sync.skip_step()
    t.progress = (epoch + 1) * steps_per_epoch
    t.barrier(f"sync-{epoch}")
    return epoch + 1


def sync_model(worker: Worker, model: nn.Module, epoch: int) -> None:
    """Make every rank's parameters identical to the sync source's (via the PS control plane)."""
    # the source is rank 0, or the lowest live rank when rank 0 is gone; a PS restart during
    # the sync runs it again at the new PS (Transport.sync_state)
    blob, source = worker.t.sync_state(epoch, flat_params(model).tobytes())
    if not source:
        load_flat_params(model, np.frombuffer(blob, dtype=np.float32).copy())
