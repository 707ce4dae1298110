"""`allreduce(tensor) -> averaged tensor` through the PS: one full THC round (Alg. 3).

  norms ‖x_j‖ per RHT block   → NORM phase  → ℓ_j = max over workers (§5.2)
  indices Z = THC(x) packed    → DATA phase  → Y = Σ T[Z_i] per chunk, with k and bitmap
  x̂ = RHT⁻¹(m + (Y/k)(M − m)/g) per chunk's own k (partial aggregation), e ← x − RHT⁻¹(X)

With codec "none" the same phases carry float32 values and the PS sums floats:
the uncompressed baseline over the same PS and transport.

A chunk lost under the `zero` policy contributes zero in the rotated domain
(Y/k = g/2, i.e. a value of 0 before the inverse transform) — the paper's
"treat the missing aggregate as zeros" (§6.1) applied to the gradient, not to
the raw lane values (which would decode to −M).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from thc_ps.compression import thc
from thc_ps.compression.codec import ErrorFeedback
from thc_ps.compression.cores import cpu_times, idle_share
from thc_ps.proto import headers as H
from thc_ps.proto.packing import unpack_lanes
from thc_ps.worker.transport import ChunkStream, PackedChunks, PhaseResults, Transport

log = logging.getLogger("thc_ps.worker")


def joined_lanes(chunks, results, total: int, lane_bits: int):
    """(all sum lanes Y of 8 bits or fewer as one uint8 vector, k) when every chunk came back
    with the same number of contributors k — the common round, whose Y/k (Alg. 3 line 19)
    thc.decode_lanes then computes inside the fused decode; None otherwise."""
    if lane_bits > 8 or not len(results):
        return None
    if isinstance(results, PhaseResults):      # the C phase: the lanes are already one vector
        k = results.contributors
        if not results.ok().all() or (k != k[0]).any() or results.coff[-1] != total \
                or (results.lengths != np.diff(results.roff)).any():
            return None
        return results.byte_lanes(), int(k[0])
    if any(r is None for r in results):
        return None
    k = results[0][0].contributors
    if any(h.contributors != k for h, _ in results):
        return None
    if lane_bits < 8:
        lanes = np.concatenate([unpack_lanes(p, lane_bits, count).astype(np.uint8)
                                for (_, count, _), (_, p) in zip(chunks, results)]) if len(chunks) else None
        return (lanes, k) if lanes is not None and lanes.size == total else None
    lanes = np.frombuffer(b"".join(p if len(p) == count else memoryview(p)[:count]
                                   for (_, count, _), (_, p) in zip(chunks, results)), dtype=np.uint8)
    return (lanes, k) if lanes.size == total else None


def average_lanes(chunks, results, total: int, granularity: int, lane_bits: int) -> np.ndarray:
    """Y/k per chunk (Alg. 3 line 19) as one float32 vector; a lost chunk stays at g/2, the
    rotated-domain zero (unpack_lanes(payload) / k cast to float32, as before)."""
    y_avg = np.full(total, granularity / 2.0, dtype=np.float32)
    for (off, count, _), r in zip(chunks, results):
        if r is not None:
            h, payload = r
            y_avg[off:off + count] = unpack_lanes(payload, lane_bits, count) / h.contributors
    return y_avg


#: Compute a round's error-feedback decode while its DATA phase runs ($THC_OVERLAP_RESIDUAL=1)
#: instead of beside the lanes decode after it.  Off by default: where the cores are full (four
#: workers on two cores) the decode took the CPU the phase's wake-ups need, and the phase took
#: 2.5 times as long; for a worker with cores to spare (docs/design.md, "Co-located load").
OVERLAP_RESIDUAL = os.environ.get("THC_OVERLAP_RESIDUAL", "0") == "1"
#: Run a THC round's DATA phase as a pipeline over its RHT blocks (`Worker._pipelined_round`):
#: "auto" (the default) when the host's cores sat idle during the last DATA phase, "1" always,
#: "0" never ($THC_PIPELINE; docs/design.md, "A round as a pipeline").
PIPELINE = os.environ.get("THC_PIPELINE", "auto")
#: A pipelined round with one rotation per job quantizes an RHT block in spans of this many
#: coordinates, the chunks of each span sent as soon as it is made: the wire starts after
#: 2^16 coordinates' quantizer instead of a whole 2^20 block's (docs/bench.md, "The first
#: chunk sooner").  Even, so that 4-bit pairs never straddle two spans.
SEND_SPAN = 1 << 16
#: ... and each later span twice the one before, up to this: the quantizer stays far ahead of
#: the wire while a 2^20 block is six hand-offs to the phase instead of sixteen (docs/bench.md,
#: "A first step like the others").
SPAN_CAP = 1 << 18
#: Under "auto": pipeline when at least this share of the host's CPU was idle during the last
#: plain DATA phase, and keep it while at least STAY_IDLE was idle during a pipelined one.
START_IDLE, STAY_IDLE = 0.25, 0.10


def send_spans(padded, first: int, cap: int) -> list[tuple[int, int, int]]:
    """The spans (block j, start, stop) a rotated round quantizes, in order, over blocks of
    `padded` coordinates: the first `first` long, each next one twice the last up to `cap`,
    none across a block's end.  With `first` and `cap` multiples of 8, every boundary is one or a
    block's end: no byte of packed indices (b bits, blocks of whole bytes) straddles two spans."""
    spans, size = [], first
    for j, p in enumerate(padded):
        a = 0
        while a < p:
            b = min(a + size, p)
            spans.append((j, a, b))
            a, size = b, min(2 * size, cap)
    return spans


@dataclass
class RoundReport:
    """What one allreduce did, for checks and progress output."""

    round_no: int
    chunks: int
    lost: int
    contributors: list = field(default_factory=list)   # k per chunk (0 = lost)
    bitmaps: list = field(default_factory=list)
    digests: list = field(default_factory=list)        # crc32 of each chunk's result payload
    seconds: float = 0.0
    phase_seconds: float = 0.0                         # of `seconds`, in the transport's phases
    bytes_up: int = 0
    bytes_down: int = 0
    norms: list | None = None                          # the preliminary stage's result (THC)
    pipelined: bool = False                            # the DATA phase ran as a block pipeline
    phase: PhaseResults | None = field(default=None, repr=False)   # digests not yet taken

    def chunk_digests(self) -> list:
        """`digests`, taken from the phase's results on first use: only the exact checks
        need them, so a training round does not pay for 16 MiB of crc32 at d = 2^24."""
        if self.phase is not None:
            self.digests += self.phase.digests()
            self.phase = None
        return self.digests


def round_rng(seed: int, rank: int, round_no: int) -> np.random.Generator:
    """Per-(seed, rank, round) randomness for `Worker(per_round_rng=True)`."""
    return np.random.default_rng(np.random.SeedSequence([seed, rank, round_no, 0x52]))


class Worker:
    """One worker's THC (or float32) allreduce over a Transport, with error feedback per key."""

    def __init__(self, transport: Transport, *, error_feedback: bool = True, seed: int = 0,
                 straggler_delay_ms: float = 0.0, straggler_prob: float = 1.0, straggler_count: int = 0,
                 per_round_rng: bool = False):
        """`per_round_rng` draws each round's stochastic-rounding randomness from (seed, rank,
        round) instead of one stream, so a restarted rank that rejoins at round r encodes
        exactly what its first incarnation would have (the exact checks of `thc launch`)."""
        self.t = transport
        self.job = transport.job
        self.cfg = None
        if self.job.codec == "thc":
            self.cfg = thc.ThcConfig.of_job(self.job)
        self.error_feedback = error_feedback
        self.errors = ErrorFeedback()
        self.codec = None
        self.codec_states: dict = {}
        if self.job.blob:
            from thc_ps.compression import registry
            self.codec = registry.get(self.job.codec, **self.job.codec_params)
        self.rng = np.random.default_rng(np.random.SeedSequence([seed, transport.worker_id]))
        self.round_no = 0
        self.straggler_delay = straggler_delay_ms / 1e3
        self.straggler_prob = straggler_prob
        self.straggler_count = straggler_count
        self.seed = seed
        self.per_round_rng = per_round_rng
        self._delay_rng = np.random.default_rng(np.random.SeedSequence([seed, transport.worker_id, 99]))
        self.last: RoundReport | None = None
        self._report: RoundReport | None = None     # the allreduce running now
        self._background: ThreadPoolExecutor | None = None
        self._decode_pool: ThreadPoolExecutor | None = None
        if PIPELINE not in ("auto", "0", "1"):
            raise ValueError(f"THC_PIPELINE must be auto, 0 or 1, not {PIPELINE!r}")
        self.pipeline = {"auto": "auto", "0": False, "1": True}[PIPELINE]
        self._idle: float | None = None        # host CPU idle during the last DATA phase
        self._piped = False                     # whether that phase was pipelined

    #: The job fields a checkpoint's codec state depends on: the residuals and the random
    #: streams mean nothing under another codec, table, seed, rotation or block size.
    STATE_FIELDS = ("num_workers", "codec", "bits", "granularity", "p", "seed", "rotation", "block_log2",
                    "tail_log2", "codec_params")

    def state_dict(self) -> dict:
        """What a resumed run needs of this rank's codec to go on as if never stopped: the
        round count (THC's per-round RHT signs, Alg. 3 line 9), the stochastic-rounding
        stream, the error-feedback residuals per key and a BLOB codec's per-tensor state.
        Copies: training on does not change a saved state."""
        import copy
        job = self.job.to_msg()
        return {"rank": self.t.worker_id, "round_no": self.round_no,
                "rng": copy.deepcopy(self.rng.bit_generator.state),
                "errors": self.errors.state_dict(), "codec_states": copy.deepcopy(self.codec_states),
                "job": {k: job[k] for k in self.STATE_FIELDS}, "blocks": thc.BLOCK_RULE}

    def load_state_dict(self, state: dict) -> None:
        """Go on from `state_dict()`'s state; refused, naming the fields, when it was saved by
        another rank or under a job whose codec differs (the residuals would not fit it)."""
        import copy
        job = self.job.to_msg()
        saved = state.get("job", {})
        diffs = [f"{k}: saved {saved.get(k)!r}, this job {job[k]!r}" for k in self.STATE_FIELDS
                 if saved.get(k) != job[k]]
        if diffs:
            raise ValueError("the saved THC-PS state is of another job configuration: " + "; ".join(diffs))
        if state.get("rank") != self.t.worker_id:
            raise ValueError(f"the saved THC-PS state is rank {state.get('rank')}'s, this is rank "
                             f"{self.t.worker_id}: each rank loads its own")
        self.round_no = int(state["round_no"])
        self.rng.bit_generator.state = copy.deepcopy(state["rng"])
        if self.cfg is not None and self.cfg.rotation == "job" and state.get("blocks") != thc.BLOCK_RULE:
            # rotated residuals of blocks cut by another rule: they would land on other blocks
            log.warning("the saved error-feedback residuals were rotated in RHT blocks cut by an older rule "
                        "(blocks across tensors); this rank starts its error feedback afresh")
            self.errors.load_state_dict({})
        else:
            self.errors.load_state_dict(state["errors"])
        self.codec_states = copy.deepcopy(state["codec_states"])

    def prepare(self, dim: int, key: str = "grad", segments=None) -> None:
        """Ready this rank for allreduces of `dim` coordinates under `key` (tensors of
        `segments` sizes, as `allreduce` takes them) before the first: a THC job's table, its
        rotation's sign diagonals and the error-feedback vectors (thc.prepare); other codecs
        have nothing to make ahead.  Optional: a round that was not prepared makes them itself."""
        self.check_dim(dim, segments)
        if self.job.codec == "thc":
            thc.prepare(self.cfg, dim, self.errors if self.error_feedback else None, key, segments)

    def move_state(self, key: str, moves: list, dim: int, segments=(None, None)) -> None:
        """The tensor under `key` keeps its coordinates but in another order (DDP rebuilt its
        buckets): its error-feedback residual follows them.  `moves` are (old offset, new
        offset, count) runs covering all `dim` coordinates; `segments` the tensors' sizes in
        the old order and in the new (`allreduce`'s).  A job rotation's residual is rotated
        (R − X): it is taken back to the gradient's coordinates in the old layout, moved and
        rotated again in the new (its share in a block's padding is dropped).  A BLOB codec's
        per-tensor state starts afresh."""
        self.codec_states.pop(key, None)
        e = self.errors.errors.get(key)
        if e is None:
            return
        rotated = self.cfg is not None and self.cfg.rotation == "job"
        layout = self.cfg.layout(dim, segments[0]) if rotated else None
        if rotated and np.size(e) != layout.padded_dim:
            return                      # not this tensor's residual (nor would it be applied)
        flat = thc.unrotate(e, self.cfg, layout) if rotated else np.asarray(e).reshape(-1)
        if flat.size != dim:            # not a residual of this tensor: it would not be applied anyway
            return
        moved = np.empty_like(flat)
        for old, new, count in moves:
            moved[new:new + count] = flat[old:old + count]
        self.errors.update(key, thc.rotate(moved, self.cfg, self.cfg.layout(dim, segments[1])) if rotated
                           else moved.reshape(np.shape(e)))

    def close(self) -> None:
        """Stop this worker's helper threads (the transport is the caller's to close)."""
        for pool in (self._background, self._decode_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._background = self._decode_pool = None

    def _in_background(self, fn):
        """Start fn() in this worker's helper thread; returns its Future.  For the
        error-feedback decode, whose kernels release the GIL: it runs beside the lanes decode
        (or, with OVERLAP_RESIDUAL, beside the DATA phase)."""
        if self._background is None:
            self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="thc-feedback")
        return self._background.submit(fn)

    def _chunks(self, payload, total: int, bits: int) -> PackedChunks:
        """The packet chunks of a packed vector, cut without copying."""
        return PackedChunks(payload, total, bits, self.job.elems_per_packet)

    def _maybe_straggle(self) -> None:
        """Delay this round's DATA phase if this worker straggles.

        With `straggler_count` = k, every round the same k ranks (drawn from (seed, round),
        identically in every worker) straggle — the paper's §8.3 simulation; otherwise this
        worker straggles with probability `straggler_prob`.
        """
        if self.straggler_delay <= 0:
            return
        if self.straggler_count:
            pick = np.random.default_rng(np.random.SeedSequence([self.seed, self.round_no, 0x57])) \
                .choice(self.job.num_workers, self.straggler_count, replace=False)
            if self.t.worker_id in pick:
                time.sleep(self.straggler_delay)
        elif self._delay_rng.random() < self.straggler_prob:
            time.sleep(self.straggler_delay)

    def round_rng(self, round_no: int) -> np.random.Generator:
        """The generator a round's encoding draws from (see `per_round_rng`)."""
        if not self.per_round_rng:
            return self.rng
        return round_rng(self.seed, self.t.worker_id, round_no)

    def skip_rounds(self, count: int, dim: int, segments=None) -> None:
        """Fast-forward `count` allreduces of `dim` coordinates (tensors of `segments` sizes, as
        `allreduce` takes them) without sending anything: the slot rounds advance exactly as
        the other ranks' did, so a rank that rejoins a running job continues at their round
        (data-plane codecs: thc and none)."""
        job = self.job
        if job.blob:
            raise ValueError(f"rejoining a running job is supported for thc and none, not {job.codec}")
        for _ in range(count):
            if job.codec == "thc":
                blocks = len(self.cfg.layout(dim, segments).padded)
                self.t.skip_phase(H.NORM, -(-blocks // self.norms_per_chunk))
            self.t.skip_phase(H.DATA, self._data_chunks(dim, segments))
            self.round_no += 1

    def round_finished_elsewhere(self, seen: dict, dim: int) -> bool:
        """Whether the other ranks finished this worker's next allreduce of `dim` coordinates
        (its DATA phase, the last of a round), by the results in `seen` (Transport.drain):
        what a rank behind checks before it skips a round."""
        return self.t.finished_elsewhere(seen, self._data_chunks(dim))

    def _data_chunks(self, dim: int, segments=None) -> int:
        """Chunks of an allreduce's DATA phase of `dim` coordinates (thc and none)."""
        per = self.job.elems_per_packet
        if self.job.codec == "thc":
            return -(-self.cfg.layout(dim, segments).padded_dim // per)
        return -(-dim // per)

    def rejoin(self) -> None:
        """After the transport's `LeaseLost`: register again as a rejoining rank and restart the
        round count, so that `skip_rounds(step, d)` brings the slot rounds to the other ranks'
        step exactly as for a restarted rank (the error-feedback memory is kept)."""
        self.t.rejoin()
        self.round_no = 0

    def check_dim(self, dim: int, segments=None) -> None:
        """Refuse, before any traffic, a tensor this job cannot carry: its coordinates (THC's
        padded to whole RHT blocks) must be addressable by the header's 32-bit offset."""
        padded, blocks = dim, 1
        if self.cfg is not None and 1 <= dim <= H.MAX_COORDS:
            layout = self.cfg.layout(dim, segments)
            padded, blocks = layout.padded_dim, len(layout.padded)
        most = self.norms_per_chunk * self.job.norm_slots
        if blocks > most:
            raise ValueError(f"a round of {len(segments) if segments else 1} tensor(s) makes {blocks:,} RHT blocks, more "
                             f"norms than a NORM phase carries ({self.job.norm_slots} norm slots × "
                             f"{self.norms_per_chunk} a packet = {most:,}); split the bucket (e.g. a smaller DDP "
                             f"bucket_cap_mb) or give the job more norm_slots")
        if dim < 1 or padded > H.MAX_COORDS:
            raise ValueError(f"a tensor of {dim:,} coordinates ({padded:,} on the wire) does not fit a "
                             f"round: a round carries 1 to {H.MAX_COORDS:,} (the header's 32-bit offset); "
                             f"split it (e.g. a smaller DDP bucket_cap_mb)")

    def _exchange_norms(self, norms: np.ndarray) -> np.ndarray:
        """Preliminary stage: elementwise max over workers of float statistics (NORM phase), in
        chunks of at most `norms_per_chunk` values (one chunk unless a round has that many
        RHT blocks: a bucket of many tensors); a chunk whose result was lost keeps this
        worker's own values."""
        payload = H.float_to_ordered(norms).astype(">u4").tobytes()
        per = self.norms_per_chunk
        chunks = [(a, min(per, norms.size - a), payload[4 * a:4 * min(a + per, norms.size)])
                  for a in range(0, norms.size, per)]
        out = np.asarray(norms, dtype=np.float32).astype(np.float64)
        for (a, n, _), res in zip(chunks, self._run_phase(H.NORM, chunks)):
            if res is not None:
                out[a:a + n] = H.ordered_to_float(np.frombuffer(res[1], dtype=">u4"))
        return out

    @property
    def norms_per_chunk(self) -> int:
        """Norms one NORM packet carries: as many float32 as fit the job's MTU (docs/protocol.md
        §4 step 2), and no more than a DATA packet's elements (what the PS accepts)."""
        return max(1, min(H.payload_budget(self.job.mtu) // 4, self.job.elems_per_packet))

    def allreduce(self, x, key: str = "grad", round_no: int | None = None, out=None, segments=None):
        """Average of x over the workers (numpy array or torch tensor in, same kind out).

        `out`: a float32 numpy array of x's size the average is written into and returned
        (it may be x itself, as torch.distributed's all_reduce works in place); THC decodes
        straight into it, so a round makes no new vector of x's size.

        x may be `thc.Pieces` (a model's gradients tensor by tensor; `out` needed): a THC job
        with one rotation reads them where they lie, any other round first copies them into
        `out`.  `segments`: the sizes of the tensors x holds back to back (a DDP bucket's
        parameters; Pieces give their own): THC cuts each into RHT blocks of its own
        (thc.make_layout), so every rank of the job must give the same."""
        pieces = isinstance(x, thc.Pieces)
        if pieces and segments is None:
            segments = x.sizes
        torch_in = not pieces and not isinstance(x, np.ndarray)
        if out is not None and torch_in:
            raise ValueError("out must be a contiguous float32 numpy array of x's size (numpy x)")
        if pieces and out is None:
            raise ValueError("an allreduce of thc.Pieces needs out= (the vector the average goes into)")
        if pieces:
            arr = x
        else:
            arr = x.detach().cpu().numpy().astype(np.float32, copy=False).ravel() if torch_in else \
                np.ascontiguousarray(x, dtype=np.float32).ravel()
        self.check_dim(arr.size, segments)
        flat = None if out is None else thc.result_vector(out, arr.size)
        if pieces and not (self.job.codec == "thc" and self.cfg.rotation == "job"):
            arr = x.concatenate(out=flat)
        start = time.perf_counter()
        rn = self.round_no if round_no is None else round_no
        report = self._report = RoundReport(rn, 0, 0)
        if self.job.codec == "thc":
            est = self._thc_round(arr, key, rn, report, flat, segments)
        elif self.job.blob:
            est = self._blob_round(arr, key, report)
        else:
            est = self._float_round(arr, report)
        self.round_no = rn + 1
        report.seconds = time.perf_counter() - start
        self.last = report
        if out is not None:
            if est is not flat:                 # THC decoded into it already
                np.copyto(flat, est.reshape(-1))
            return out
        est = est.reshape(np.shape(x) if not torch_in else tuple(x.shape))
        if torch_in:
            import torch
            return torch.from_numpy(est).to(dtype=x.dtype)
        return est

    def _collect(self, results, report: RoundReport) -> None:
        report.chunks = len(results)
        if isinstance(results, PhaseResults):
            ok = results.ok()
            report.lost += int((~ok).sum())
            report.contributors += results.contributors.tolist()
            report.bitmaps += results.bitmaps.tolist()
            report.phase = results
            report.bytes_down += int(np.minimum(results.lengths, np.diff(results.roff))[ok].sum()) \
                + H.HEADER_SIZE * int(ok.sum())
            return
        for r in results:
            if r is None:
                report.lost += 1
                report.contributors.append(0)
                report.bitmaps.append(0)
                report.digests.append(0)
            else:
                h, payload = r
                report.contributors.append(h.contributors)
                report.bitmaps.append(h.bitmap)
                report.digests.append(zlib.crc32(payload))
                report.bytes_down += len(payload) + H.HEADER_SIZE

    def _thc_round(self, grad: np.ndarray, key: str, rn: int, report: RoundReport, out=None,
                   segments=None) -> np.ndarray:
        cfg, job = self.cfg, self.job
        rnd = thc.WorkerRound(cfg, grad, self.errors if self.error_feedback else None, key, segments=segments)
        layout = rnd.layout
        norms = self._exchange_norms(rnd.norms())
        report.norms = norms.tolist()
        can = len(layout.starts) > 1 and job.lane_bits <= 8 and rnd.can_pipeline() \
            and getattr(self.t, "streams", lambda: False)()
        if can and self._pipelines():
            return self._pipelined_round(rnd, norms, rn, report, out)
        n = layout.padded_dim
        packed = rnd.encode(norms, self.round_rng(rn), rn, packed=True)
        chunks = self._chunks(packed, n, cfg.bits)
        report.bytes_up = chunks.wire_bytes
        # e = x − RHT⁻¹(X) needs only this worker's own Z; a helper thread computes it beside the
        # lanes decode, or beside the phase with OVERLAP_RESIDUAL (a rotated round made R − X
        # as it quantized: nothing to hand over)
        own = rnd.memory is not None and not rnd.rotated
        residual = self._in_background(rnd.residual) if own and OVERLAP_RESIDUAL else None
        try:
            self._maybe_straggle()
            results = self._timed_phase(chunks, False, measure=can)
            if own and residual is None:
                residual = self._in_background(rnd.residual)
            self._collect(results, report)
            whole = joined_lanes(chunks, results, layout.padded_dim, job.lane_bits)
            if whole is not None:       # every chunk back, one k: lanes → Y/k inside the fused decode
                if out is not None and residual is not None and np.shares_memory(out, rnd.x):
                    residual.result()   # the helper thread still reads x
                est = rnd.decode_lanes(whole[0], whole[1], out=out)
            else:
                est = rnd.decode(average_lanes(chunks, results, layout.padded_dim, cfg.granularity,
                                               job.lane_bits))
        finally:
            e = residual.result() if residual is not None else None
        rnd.feedback(e)
        return est

    def _pipelined_round(self, rnd: thc.WorkerRound, norms, rn: int, report: RoundReport, out=None):
        """The DATA phase of `_thc_round` as a pipeline over the RHT blocks: a helper thread
        encodes block after block (a rotated round's big blocks in spans, `send_spans`, the
        first span in this thread before the phase starts) and the phase sends each block's
        or span's chunks as soon as they are made (worker/chunks.py ChunkStream), then the
        helper computes the error-feedback residual block by block while the chunks are on
        the wire; this thread runs the phase, and a second helper decodes each block as soon
        as all its results are back.  Every
        byte on the wire and every value decoded is what the plain round gives (the same
        chunks, slots and rounds; per-block kernels, each block decoded with its own k, which
        is the round's k when every chunk came back with it); the codec's CPU just overlaps
        the wire.  A block whose chunks came back with different k, or lost, is decoded with
        the plain round's path once the phase is over."""
        cfg, job, layout = self.cfg, self.job, rnd.layout
        per, n = job.elems_per_packet, layout.padded_dim
        flat = thc.result_vector(out, layout.dim)
        packed = rnd.start_packed(norms, self.round_rng(rn), rn)
        chunks = self._chunks(packed, n, cfg.bits)
        report.bytes_up, report.pipelined = chunks.wire_bytes, True
        offs, nblocks = layout.padded_offsets(), len(layout.starts)
        ends = [offs[j] + layout.padded[j] for j in range(nblocks)]
        # chunks [lo_j, hi_j) hold block j's coordinates; after block j the first end_j // per
        # are whole (a chunk across two blocks waits for the second)
        lo = [o // per for o in offs]
        hi = [min(-(-e // per), len(chunks)) for e in ends]
        stream = ChunkStream(len(chunks))
        # a rotated round quantizes a big block in spans, so that its first chunks go out while
        # the rest is made (the block's transform is done already: only the quantizer remains)
        spans = send_spans(layout.padded, SEND_SPAN, SPAN_CAP) if rnd.rotated else \
            [(j, 0, p) for j, p in enumerate(layout.padded)]
        made = [threading.Event() for _ in range(nblocks)]       # block j's residual done too
        residual = [None]
        shares = rnd.memory is not None and np.shares_memory(flat, rnd.x)

        def make(j: int, a: int, b: int) -> None:
            if b - a == layout.padded[j]:
                rnd.encode_blocks(range(j, j + 1))
            else:
                rnd.encode_span(j, a, b)
            stream.advance((offs[j] + b) // per if j < nblocks - 1 or b < layout.padded[j] else len(chunks))

        def produce():
            try:
                for span in spans[1:]:
                    make(*span)
                if rnd.memory is not None:
                    for j in range(nblocks):
                        residual[0] = rnd.residual_blocks(range(j, j + 1))
                        made[j].set()
            except BaseException as exc:    # noqa: BLE001 - the phase raises it
                stream.fail(exc)
                raise

        def consume() -> list:
            done = [False] * nblocks
            for j in range(nblocks):
                if not stream.wait_answered(hi[j]):
                    return done
                res = stream.results
                k = res.common_k(lo[j], hi[j])
                if k is None:
                    continue
                if shares:
                    made[j].wait()          # the residual still reads x, which is `out`
                rnd.decode_lanes(res.byte_lanes(lo[j], hi[j]), k, out=flat, blocks=range(j, j + 1))
                done[j] = True
            return done

        try:                    # the first span here: the phase starts with chunks to send
            make(*spans[0])     # rather than after a helper thread's wake-up
        except BaseException:
            stream.close()
            raise
        producer = self._in_background(produce)
        decoder = self._decoder().submit(consume)
        try:
            self._maybe_straggle()
            results = self._timed_phase(chunks, True, stream)
        finally:
            stream.end()
            done = decoder.result()
            try:
                producer.result()
            finally:
                stream.close()
        self._collect(results, report)
        if results is not stream.results:           # resumed after a PS restart: all anew
            done = [False] * nblocks
        rest = [j for j in range(nblocks) if not done[j]]  # the last block, typically
        ks = [results.common_k(lo[j], hi[j]) for j in rest] if isinstance(results, PhaseResults) else [None]
        if None not in ks:
            for j, k in zip(rest, ks):
                rnd.decode_lanes(results.byte_lanes(lo[j], hi[j]), k, out=flat, blocks=range(j, j + 1))
        else:                                       # loss or mixed k within a block: Y/k per chunk
            np.copyto(flat, rnd.decode(average_lanes(chunks, results, n, cfg.granularity, job.lane_bits)))
        rnd.feedback(residual[0])
        return flat

    def _pipelines(self) -> bool:
        """Whether this round's DATA phase is pipelined: always, never, or (auto) when the
        host's cores were idle for START_IDLE of the last plain DATA phase (the wire, not the
        CPU, held it up: the codec can overlap it) and STAY_IDLE of a pipelined one.  On a
        host whose cores are busy throughout, overlapping only adds the codec's memory
        traffic to the phase's (docs/bench-history.md).  Each rank decides alone: nothing on
        the wire differs."""
        if self.pipeline != "auto":
            return self.pipeline
        return self._idle is not None and self._idle >= (STAY_IDLE if self._piped else START_IDLE)

    def _timed_phase(self, chunks, piped: bool, stream=None, measure: bool = True):
        """The DATA phase, noting how idle the host's CPU was meanwhile (`_pipelines`;
        not for a round that could not be pipelined: /proc/stat is read only when it counts)."""
        before = cpu_times() if measure and self.pipeline == "auto" else None
        results = self._run_phase(H.DATA, chunks, stream)
        if before is not None:
            self._idle, self._piped = idle_share(before, cpu_times()), piped
        return results

    def _run_phase(self, kind, chunks, stream=None):
        """Transport.run_phase, its time added to the round's report (`phase_seconds`: the
        part of a round spent on the wire and waiting for the other ranks, the rest being the
        codec and the Python around it)."""
        t0 = time.perf_counter()
        try:
            return self.t.run_phase(kind, chunks, stream) if stream is not None else self.t.run_phase(kind, chunks)
        finally:
            if self._report is not None:
                self._report.phase_seconds += time.perf_counter() - t0

    def _decoder(self) -> ThreadPoolExecutor:
        """The pipeline's decode thread (one per worker, made on first use)."""
        if self._decode_pool is None:
            self._decode_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="thc-decode")
        return self._decode_pool

    def _blob_round(self, arr: np.ndarray, key: str, report: RoundReport) -> np.ndarray:
        """A decode–sum–re-encode codec: preliminary stage if it has one, payload as fragments."""
        from thc_ps.compression.codec import Context
        codec, t = self.codec, self.t
        state = self.codec_states.setdefault(key, codec.new_state())
        stats = codec.preliminary(arr, state)
        shared = self._exchange_norms(np.asarray(stats)) if stats is not None else None
        rn = t.next_blob_round()
        ctx = Context(key, arr.size, rn, shared, self.job.num_workers)
        up = codec.encode(arr, state, self.round_rng(rn), ctx)
        report.bytes_up = len(up)
        self._maybe_straggle()
        res = t.run_blob(up, arr.size, rn)
        report.chunks = 1
        if res is None:
            report.lost, report.contributors, report.bitmaps, report.digests = 1, [0], [0], [0]
            return np.zeros(arr.size, dtype=np.float32)
        h, down = res
        report.bytes_down = len(down)
        report.contributors, report.bitmaps, report.digests = [h.contributors], [h.bitmap], [zlib.crc32(down)]
        return codec.decode(down, Context(key, arr.size, rn, shared, h.contributors))

    def _float_round(self, arr: np.ndarray, report: RoundReport) -> np.ndarray:
        chunks = self._chunks(arr.astype(">f4"), arr.size, 32)
        report.bytes_up = chunks.wire_bytes
        self._maybe_straggle()
        results = self._run_phase(H.DATA, chunks)
        self._collect(results, report)
        if isinstance(results, PhaseResults) and results.ok().all() \
                and (results.lengths == np.diff(results.roff)).all():
            k = np.repeat(results.contributors.astype(np.float32), chunks.counts)
            return results.lanes.view(">f4").astype(np.float32) / k
        out = np.zeros(arr.size, dtype=np.float32)
        for (off, count, _), r in zip(chunks, results):
            if r is not None:
                h, payload = r
                out[off:off + count] = np.frombuffer(payload, dtype=">f4") / h.contributors
        return out
