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

Error feedback is kept per bucket index (key ``bucket<i>``), as PyTorch's PowerSGD keeps its
per-bucket state: DDP rebuilds its buckets once, after the first iteration, and a residual
whose size no longer matches its bucket starts again from zero (compression.codec's
ErrorFeedback), so at most the first step's residual is dropped.  Replicas stay identical
because every rank decodes the same aggregated indices.
"""
import queue
import threading

import torch
import torch.distributed as dist

from worker.client import RoundReport, Worker


class PSHookState:
    """The hook's explicit state: the rank's Worker, the communication thread, what the
    rounds did (for progress output), and the first error a round raised."""

    def __init__(self, worker: Worker, world_size: int | None = None, *, key_prefix: str = "bucket"):
        """`world_size` (the process group's) must be the PS job's number of workers: the
        PS averages over the job's ranks, and a DDP group of another size would mix models
        that are not in the job.  Checked here, before any traffic."""
        job = worker.job
        if world_size is not None and world_size != job.num_workers:
            raise ValueError(f"the DDP process group has {world_size} ranks but the PS job "
                             f"'{worker.t.job_name or 'default'}' has {job.num_workers} workers; "
                             f"start the PS job with --workers {world_size} (or the group with "
                             f"{job.num_workers} ranks)")
        self.worker = worker
        self.key_prefix = key_prefix
        self.reports: list[RoundReport] = []
        self.bucket_dims: list[int] = []          # sizes of the buckets of the latest step, in order
        self.error: BaseException | None = None
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"thc-ps-hook-{worker.t.worker_id}")
        self._thread.start()

    def submit(self, index: int, buffer: torch.Tensor) -> torch.futures.Future:
        """Queue bucket `index` (a flat float32 CPU tensor, averaged in place); the future
        completes with it when its round is done."""
        self.worker.check_dim(buffer.numel())
        if buffer.dtype != torch.float32 or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError(f"bucket {index}: the PS hook takes contiguous float32 CPU buckets, got "
                             f"{'' if buffer.is_contiguous() else 'a non-contiguous '}{buffer.dtype} on "
                             f"{buffer.device}")
        fut: torch.futures.Future = torch.futures.Future()
        if self.error is not None:          # a round failed: fail fast, the step is void
            fut.set_exception(self.error)
            return fut
        self._q.put((index, buffer, fut))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._q.task_done()
                return
            index, buffer, fut = item
            try:
                if self.error is not None:
                    raise self.error
                arr = buffer.numpy()
                self.worker.allreduce(arr, key=f"{self.key_prefix}{index}", out=arr)
                with self._lock:
                    self.reports.append(self.worker.last)
                    if index == 0:
                        self.bucket_dims = []
                    self.bucket_dims.append(int(arr.size))
                fut.set_result(buffer)
            except BaseException as exc:    # noqa: BLE001 - handed to DDP, which raises it in backward
                self.error = self.error or exc
                fut.set_exception(exc)
            finally:
                self._q.task_done()

    def take_reports(self) -> list[RoundReport]:
        """The reports of the rounds completed since the last call (one per bucket)."""
        with self._lock:
            out, self.reports = self.reports, []
        return out

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
        for d in dims:
            self.worker.skip_rounds(1, d)


def ps_hook(state: PSHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's average over the job's ranks, through the PS."""
    # (annotated without `from __future__ import annotations`: DDP checks the annotation)
    return state.submit(bucket.index(), bucket.buffer())


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

