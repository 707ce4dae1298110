"""THC-PS as a DDP communication hook: each bucket goes to the PS as soon as DDP hands it over.

    worker = Worker(Transport(...))                  # this rank, registered with the PS
    state = PSHookState(worker, world_size=dist.get_world_size())
    ddp_model.register_comm_hook(state, ps_hook)
    ...                                              # train as usual
    state.close()

DDP calls the hook from its backward pass for each bucket of gradients the moment the
bucket is full, and waits for the returned futures only when backward has ended.  The hook
hands the bucket to the state's communication thread and returns at once, so a bucket's
round (NORM and DATA phases through the PS, THC §5) runs while autograd computes the
gradients of the layers below: the overlap DDP's own all-reduce has, and BytePS's
scheduler gives its PS pushes.  The transport's phase loop and THC's kernels release the
GIL, so backward's operators and the round run side by side.

Rounds of one rank run one bucket at a time, in the order DDP hands the buckets over.
DDP launches buckets in index order on every rank (its reducer marks bucket i ready only
after buckets 0 … i−1), so every rank issues the same sequence of phases, which is what the
transport's slot rounds assume (worker/phases.py: a slot's round advances identically in
every worker): two buckets never share a slot's round, and a later bucket's chunks wait in
the window until the earlier bucket's are answered.

A job's first `warmup_steps` steps (counted across checkpoints) do not go to the PS: their
buckets are all-reduced over the process group in float16 by PyTorch's own
`fp16_compress_hook`, as PowerSGD's hook all-reduces before `start_powerSGD_iter`.  Adam's
first updates are near sign steps, m/√v ≈ ±1 on every coordinate, so the quantization noise
the RHT spreads over coordinates whose gradient is zero or tiny moves them by a full step;
with the exact average those first steps are what DDP's are (docs/design.md, "Warm-up steps,
and error feedback under Adam").

Error feedback is kept per bucket index (key ``bucket<i>``), as PyTorch's PowerSGD keeps its
per-bucket state: DDP rebuilds its buckets once, after the first iteration, and a residual
whose size no longer matches its bucket starts again from zero (thc_ps.compression.codec's
ErrorFeedback), so at most the first step's residual is dropped.  Replicas stay identical
because every rank decodes the same aggregated indices.
"""
import queue
import threading

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from thc_ps.worker.client import RoundReport, Worker


#: Bucket dtypes the hook takes: rounds run in float32 (THC's kernels, the float sums), so
#: half-precision and float64 buckets are converted on the way in and back on the way out.
BUCKET_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_warmup_steps(value, what: str = "warmup_steps") -> int:
    """`value` as a number of warm-up steps (an int, 0 or more), else ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} takes an integer 0 or more, got {value!r}")
    return value


class PSHookState:
    """The hook's explicit state: the rank's Worker, the communication thread, running totals
    of what the rounds did (for progress output) and the first error a round raised.

    Memory stays flat over any number of steps: per-round reports are kept only with
    `keep_reports` (and then until `take_reports()` drains them); `totals` always counts."""

    def __init__(self, worker: Worker, world_size: int | None = None, *, key_prefix: str = "bucket",
                 keep_reports: bool = False, warmup_steps: int = 0, process_group=None):
        """`world_size` (the process group's) must be the PS job's number of workers: the
        PS averages over the job's ranks, and a DDP group of another size would mix models
        that are not in the job.  Checked here, before any traffic.  `warmup_steps`: the
        job's first steps whose buckets are all-reduced in float16 over `process_group` (the
        world when None) instead of going to the PS; every rank must give the same number."""
        job = worker.job
        check_warmup_steps(warmup_steps)
        if world_size is not None and world_size != job.num_workers:
            raise ValueError(f"the DDP process group has {world_size} ranks but the PS job "
                             f"'{worker.t.job_name or 'default'}' has {job.num_workers} workers; "
                             f"start the PS job with --workers {world_size} (or the group with "
                             f"{job.num_workers} ranks)")
        self.worker = worker
        self.key_prefix = key_prefix
        self.keep_reports = keep_reports
        self.reports: list[RoundReport] = []
        self.warmup_steps = warmup_steps
        self.process_group = process_group
        # bytes_up/bytes_down: what this rank put on and took off its link, the warm-up's ring
        # all-reduce included; warmup_steps: the steps that went over the process group
        self.totals = {"rounds": 0, "seconds": 0.0, "bytes_up": 0, "bytes_down": 0, "lost_chunks": 0,
                       "warmup_steps": 0}
        self.bucket_dims: list[int] = []          # sizes of the buckets of the latest step, in order
        self.error: BaseException | None = None
        self._staging: dict = {}                  # bucket index -> float32 CPU tensor (other dtypes, CUDA)
        # DDP rebuilds its buckets after the first step, in the order backward made the gradients:
        # a bucket's coordinates can change order.  Parameters are numbered in the order they are
        # first seen (DDP's first layout, the same in every run of a model) and a bucket's layout
        # is the numbers and sizes of its parameters; the layout a bucket's rounds ran in is the
        # one its residual is in (`_plan`).
        self._number: dict = {}                   # parameter (its data_ptr) -> its number
        self._layouts: dict = {}                  # bucket index -> (numbers, sizes) of its rounds
        self._steps = 0                           # steps begun (bucket 0 handed over)
        self._pinned = -1                         # the step whose buckets run in loaded layouts
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"thc-ps-hook-{worker.t.worker_id}")
        self._thread.start()

    @staticmethod
    def check_bucket(buffer: torch.Tensor, what: str = "a bucket") -> None:
        """Refuse, before any traffic, a bucket the rounds cannot carry (ValueError, one line)."""
        if buffer.dtype not in BUCKET_DTYPES:
            raise ValueError(f"{what} has dtype {buffer.dtype}: the PS hook takes floating-point gradients "
                             f"({', '.join(str(d).removeprefix('torch.') for d in BUCKET_DTYPES)})")
        if buffer.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{what} lives on {buffer.device}: the PS hook takes CPU and CUDA gradients")

    def submit(self, index: int, buffer: torch.Tensor, params=None) -> torch.futures.Future:
        """Queue bucket `index` (a flat tensor, averaged in place; `params`, its parameters in
        order, give its layout); the future completes with it when its round is done."""
        self.worker.check_dim(buffer.numel())
        self.check_bucket(buffer, f"bucket {index}")
        fut: torch.futures.Future = torch.futures.Future()
        if self.error is not None:          # a round failed: fail fast, the step is void
            fut.set_exception(self.error)
            return fut
        if index == 0:
            self._steps += 1
        layout = None if params is None else self._layout_of(params)
        self._q.put((index, buffer, layout, self._steps, fut))
        return fut

    def _layout_of(self, params) -> tuple:
        """A bucket's layout: its parameters' numbers (in the order first seen) and sizes."""
        numbers = tuple(self._number.setdefault(p.data_ptr(), len(self._number)) for p in params)
        return numbers, tuple(p.numel() for p in params)

    def warmup(self, bucket: dist.GradBucket) -> torch.futures.Future | None:
        """Bucket `bucket`'s average over the process group in float16 when it belongs to one
        of the job's first `warmup_steps` steps (that step is counted here), else None: the
        bucket goes to the PS.  Its bytes are the ring all-reduce's, 2(n−1)/n of the float16
        payload each way."""
        index = bucket.index()
        if self._steps + (index == 0) > self.warmup_steps:
            return None
        if self.error is not None:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_exception(self.error)
            return fut
        n = self.worker.job.num_workers
        ring = 2 * (n - 1) * 2 * bucket.buffer().numel() // n
        # the layout a checkpoint saves and a resumed launch's first round runs in (`_plan`):
        # the bucket's as DDP last built it, no residual yet to move with it
        self._layouts[index] = self._layout_of(bucket.parameters())
        with self._lock:
            if index == 0:
                self._steps += 1
                self.totals["warmup_steps"] += 1
            self.totals["bytes_up"] += ring
            self.totals["bytes_down"] += ring
        return default_hooks.fp16_compress_hook(self.process_group, bucket)

    def _host(self, index: int, buffer: torch.Tensor) -> torch.Tensor:
        """The float32 CPU tensor bucket `index`'s round runs on: the bucket itself when it is
        one, else a staging tensor kept for the index (pinned for a CUDA bucket, so the copies
        run at the link's speed) with the bucket copied in."""
        if buffer.dtype == torch.float32 and buffer.device.type == "cpu" and buffer.is_contiguous():
            return buffer
        host = self._staging.get(index)
        if host is None or host.numel() != buffer.numel():
            host = torch.empty(buffer.numel(), dtype=torch.float32,
                               pin_memory=buffer.device.type == "cuda")
            self._staging[index] = host
        host.copy_(buffer.reshape(-1))
        return host

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._q.task_done()
                return
            index, buffer, layout, step, fut = item
            try:
                if self.error is not None:
                    raise self.error
                host = self._host(index, buffer)
                arr = host.numpy()
                moves = self._plan(index, layout, step, arr.size)
                # each parameter its own RHT blocks, in the order of the layout the round runs in
                segments = self._layouts[index][1] if layout is not None else None
                if moves is None:
                    self.worker.allreduce(arr, key=f"{self.key_prefix}{index}", out=arr, segments=segments)
                else:                       # the round runs in the loaded layout, and back
                    work = np.empty_like(arr)
                    for src, dst, n in moves:
                        work[dst:dst + n] = arr[src:src + n]
                    self.worker.allreduce(work, key=f"{self.key_prefix}{index}", out=work, segments=segments)
                    for src, dst, n in moves:
                        arr[src:src + n] = work[dst:dst + n]
                if host is not buffer:
                    buffer.copy_(host.view_as(buffer))
                self._count(index, int(arr.size), self.worker.last)
                fut.set_result(buffer)
            except BaseException as exc:    # noqa: BLE001 - handed to DDP, which raises it in backward
                self.error = self.error or exc
                fut.set_exception(exc)
            finally:
                self._q.task_done()

    def _plan(self, index: int, layout, step: int, dim: int) -> list | None:
        """How bucket `index`'s round runs when its layout is not the one its rounds ran in:
        in the first step after `load_state_dict`, in the loaded layout (the bucket is moved
        into it and back: the moves are returned), so a resumed job encodes what it would
        have without the stop; otherwise DDP rebuilt its buckets, and the residual moves to
        the new layout (`Worker.move_state`).  None: the round runs on the bucket as it is."""
        if layout is None:
            return None
        have = self._layouts.get(index)
        if have is None or have == layout:
            self._layouts[index] = layout
            return None
        if sorted(zip(*have)) != sorted(zip(*layout)):      # other parameters: nothing carries over
            self.worker.errors.errors.pop(f"{self.key_prefix}{index}", None)
            self._layouts[index] = layout
            return None
        if step == self._pinned:
            return _moves(layout, have)
        self.worker.move_state(f"{self.key_prefix}{index}", _moves(have, layout), dim, (have[1], layout[1]))
        self._layouts[index] = layout
        return None

    def _count(self, index: int, dim: int, rep: RoundReport) -> None:
        with self._lock:
            if self.keep_reports:
                self.reports.append(rep)
            t = self.totals
            t["rounds"] += 1
            t["seconds"] += rep.seconds
            t["bytes_up"] += rep.bytes_up
            t["bytes_down"] += rep.bytes_down
            t["lost_chunks"] += rep.lost
            if index == 0:
                self.bucket_dims = []
            self.bucket_dims.append(dim)

    def take_reports(self) -> list[RoundReport]:
        """The reports of the rounds completed since the last call (one per bucket); empty
        unless the state keeps them (`keep_reports`)."""
        with self._lock:
            out, self.reports = self.reports, []
        return out

    def state_dict(self) -> dict:
        """This rank's state a resumed job needs (`Worker.state_dict`: round count, random
        stream, error-feedback residuals per bucket), taken between steps."""
        self._q.join()
        with self._lock:
            return {"worker": self.worker.state_dict(), "bucket_dims": list(self.bucket_dims),
                    "totals": dict(self.totals), "layouts": dict(self._layouts), "steps": self._steps}

    def load_state_dict(self, state: dict) -> None:
        """Go on from `state_dict()`'s state (before the first step, or between steps)."""
        self._q.join()
        self.worker.load_state_dict(state["worker"])
        with self._lock:
            self.bucket_dims = list(state.get("bucket_dims", []))
            self.totals.update(state.get("totals", {}))
            self._layouts = dict(state.get("layouts", {}))
            # a state saved before steps were counted is past any warm-up
            self._steps = int(state.get("steps", self.warmup_steps))
            self._pinned = self._steps + 1

    def raise_error(self) -> None:
        """Re-raise the first error a round raised (DDP wraps it in a RuntimeError; the
        caller may want its own type, e.g. the transport's LeaseLost), and clear it once every
        bucket queued behind the failed one has failed too (DDP stops waiting at the first
        failed future): none of the void step's rounds may run after the caller recovers."""
        self._q.join()
        exc, self.error = self.error, None
        if exc is not None:
            raise exc

    def close(self) -> None:
        """Stop the communication thread (after the rounds queued so far)."""
        self._q.put(None)
        self._thread.join(timeout=30)


class HookSync:
    """What a rejoining rank needs of the hook (worker/training.py's rejoin_step and
    rejoin_training call `skip_step` and read `worker`, as of GradientSync): one step's rounds
    are its buckets', in the sizes the last complete step had."""

    def __init__(self, state: PSHookState):
        self.state = state
        self.worker = state.worker

    def skip_step(self) -> None:
        dims = self.state.bucket_dims
        if not dims:
            raise RuntimeError("cannot fast-forward through the PS hook before a step has run here: "
                               "the buckets' sizes are not known yet")
        layouts = self.state._layouts
        for i, d in enumerate(dims):
            self.worker.skip_rounds(1, d, layouts[i][1] if i in layouts else None)


def ps_hook(state: PSHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's average over the job's ranks, through the PS (over the
    process group in float16 in the job's first `warmup_steps` steps)."""
    # (annotated without `from __future__ import annotations`: DDP checks the annotation)
    fut = state.warmup(bucket)
    if fut is not None:
        return fut
    return state.submit(bucket.index(), bucket.buffer(), bucket.parameters())


def _moves(src: tuple, dst: tuple) -> list:
    """(offset in src, offset in dst, count) for each parameter of two layouts of one bucket
    ((numbers, sizes) each): what carries a vector from the one order to the other."""
    at, off = {}, 0
    for number, size in zip(*src):
        at[number], off = off, off + size
    out, off = [], 0
    for number, size in zip(*dst):
        out.append((at[number], off, size))
        off += size
    return out


def merged_report(reports: list[RoundReport]) -> RoundReport | None:
    """One report for a step's buckets: seconds (and those in phases), bytes and lost chunks summed."""
    if not reports:
        return None
    out = RoundReport(reports[0].round_no, 0, 0)
    for r in reports:
        out.chunks += r.chunks
        out.lost += r.lost
        out.seconds += r.seconds
        out.phase_seconds += r.phase_seconds
        out.bytes_up += r.bytes_up
        out.bytes_down += r.bytes_down
    return out

