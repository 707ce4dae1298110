"""THC as a DDP communication hook: homomorphic compression under AllReduce (gloo).

THC §10 names AllReduce as future work; the homomorphic property makes it direct:
each rank sends table values T[Z] (not floats) into an integer all-reduce, whose sum is
exactly what the PS would have returned.  With n·g ≤ 255 the integer lanes are uint8, so
the ring moves 8 bits per coordinate instead of 32.

    state = THCHookState(world_size=dist.get_world_size(), rank=dist.get_rank())
    ddp_model.register_comm_hook(state, thc_hook)

The state follows PyTorch's PowerSGDState: explicit hyper-parameters, error feedback keyed
by bucket index (buckets are rebuilt after the first iteration, so keys must be stable),
and the worker RNG.  Per call it draws the same uniforms, in the same order, as a PS worker
with the same (seed, rank), so `allreduce_thc` returns exactly what `Worker.allreduce`
returns through the PS for the same inputs.
"""

import numpy as np
import torch
import torch.distributed as dist

from thc_ps.compression import thc
from thc_ps.compression.codec import ErrorFeedback


class THCHookState:
    """Hyper-parameters and per-bucket state of the THC comm hook."""

    __slots__ = ("cfg", "world_size", "rank", "rng", "errors", "round_no", "error_feedback",
                 "process_group")

    def __init__(self, world_size: int, rank: int, *, bits: int = 4, granularity: int = 30,
                 p="1/32", seed: int = 0, error_feedback: bool = True, process_group=None):
        lane = 8 if world_size * granularity <= 255 else (16 if world_size * granularity <= 32767 else 32)
        self.cfg = thc.ThcConfig(bits=bits, granularity=granularity, p=p, lane_bits=lane, seed=seed)
        self.cfg.check_workers(world_size)
        self.world_size, self.rank = world_size, rank
        self.rng = np.random.default_rng(np.random.SeedSequence([seed, rank]))
        self.errors = ErrorFeedback()
        self.round_no = 0
        self.error_feedback = error_feedback
        self.process_group = process_group


def _lane_dtype(lane_bits: int):
    # gloo sums uint8 without widening: safe because n·g ≤ 255 bounds every partial sum
    return {8: torch.uint8, 16: torch.int16, 32: torch.int32}[lane_bits]


def allreduce_thc(state: THCHookState, flat: torch.Tensor, key, segments=None) -> torch.Tensor:
    """Average of `flat` over the ranks by one THC round over torch.distributed (`segments`:
    the sizes of the tensors it holds, each cut into RHT blocks of its own, as
    `Worker.allreduce` takes them)."""
    cfg, pg = state.cfg, state.process_group
    grad = flat.detach().cpu().numpy().astype(np.float32).ravel()
    rnd = thc.WorkerRound(cfg, grad, state.errors if state.error_feedback else None, key, segments=segments)
    norms = torch.from_numpy(rnd.norms().astype(np.float32))
    dist.all_reduce(norms, op=dist.ReduceOp.MAX, group=pg)            # preliminary stage
    rn = state.round_no
    z = rnd.encode(norms.numpy().astype(np.float64), state.rng, rn)
    values = torch.from_numpy(np.asarray(cfg.table.values, dtype=np.int64)[z]).to(_lane_dtype(cfg.lane_bits))
    dist.all_reduce(values, op=dist.ReduceOp.SUM, group=pg)          # homomorphic sum of T[Z]
    est = rnd.decode((values.numpy().astype(np.int64) / state.world_size).astype(np.float32))
    rnd.feedback()
    state.round_no = rn + 1
    return torch.from_numpy(est).to(flat.dtype).view_as(flat)


def thc_hook(state: THCHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: replaces the bucket's float all-reduce with a THC round."""
    fut = torch.futures.Future()
    fut.set_result(allreduce_thc(state, bucket.buffer(), key=bucket.index(),
                                 segments=tuple(p.numel() for p in bucket.parameters())))
    return fut
