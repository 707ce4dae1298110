"""THC-PS for your own PyTorch training script: one call joins this rank to a PS job, one
DDP communication hook sends every gradient bucket through it.

    import thc_ps
    dist.init_process_group("gloo")          # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, ...
    model = DistributedDataParallel(model)
    state = thc_ps.connect(model, ps="10.0.0.1:9000")   # this rank joins; the hook is registered
    ...                                                 # train as usual
    state.close()                                       # leave the job (before destroy_process_group)

Every rank of one launch joins the same PS job: its name comes from torchrun's run id and
restart count, and a token drawn on rank 0 and broadcast over the process group keeps two
launches apart even when they share a name.  Job options default to `thc train`'s
(thc_ps.proto.job.JobConfig); an option the caller gives is one this rank insists on (a PS started
with a fixed job refuses the launch, naming both sides).  Refusals are raised on every rank,
before any gradient is sent.  The returned state is the hook's (worker/ps_hook.py
PSHookState) plus the connection: `state_dict()` / `load_state_dict()` checkpoint what a
resumed job needs (docs/api.md).
"""
import atexit
import os
import re
import secrets
import signal
import sys
import threading

import torch
import torch.distributed as dist

from thc_ps.proto.addresses import parse_ps
from thc_ps.proto.job import JobConfig
from thc_ps.worker.client import Worker
from thc_ps.worker.ps_hook import PSHookState, check_warmup_steps, ps_hook
from thc_ps.worker.transport import Transport

#: The job options `connect` takes, as JobConfig names them (None: the default, not insisted on).
JOB_OPTIONS = ("codec", "bits", "granularity", "p", "lane_bits", "quorum", "seed", "rotation", "block_log2",
               "tail_log2", "slots", "result_group", "codec_params")
#: The transport options `connect` takes, as Transport names them (None: its default).
TRANSPORT_OPTIONS = ("loss_policy", "timeout_ms", "ps_wait_s", "queue_s", "window")
#: A transport option's name on Transport where it differs (`thc train`'s --loss-policy is its `policy`).
TRANSPORT_NAMES = {"loss_policy": "policy"}
#: Where a script's defaults for `ps` and `keys` may come from instead of arguments.
PS_ENV, KEYS_ENV = "THC_PS", "THC_PS_KEYS"
#: The job's first steps that all-reduce over the process group in float16 before the PS takes
#: over (`connect(warmup_steps=)`), and whether a rank keeps THC's error feedback unless told
#: (`connect(error_feedback=)`).  Both from the example language model under AdamW, five seeds
#: against float16 DDP: Adam's first updates are near sign steps, and error feedback doubles
#: each step's noise for a telescoping sum that a per-coordinate RMS does not use (docs/design.md,
#: "Warm-up steps, and error feedback under Adam"; docs/bench.md).  `thc train`'s SGD keeps
#: error feedback.
WARMUP_STEPS = 10
ERROR_FEEDBACK = False
#: The support fraction p a launch without error feedback proposes when it gives none (with
#: error feedback, JobConfig's 1/32).  The clamp to [−t_p, t_p] (THC §5.3, "bounding the
#: support") moves the extreme rotated coordinates toward zero; error feedback carries that
#: error into the next step, and without it the error is a bias that, under one rotation per
#: job, falls the same way every step while Adam's momentum averages the rounding noise away.
#: At 1/512 (THC §7's loss and straggler runs) the clamp's bias² on the example LM's gradients
#: was 0.00004 ‖x̄‖² against 1/32's 0.0021, for 19% more rounding noise (docs/design.md, "The
#: support without error feedback").
P_WITHOUT_FEEDBACK = "1/512"
#: The table a launch without error feedback proposes when it gives neither bits nor
#: granularity: 5-bit indices at g = 31 (with error feedback, JobConfig's 4 bits at g = 30).
#: Without error feedback each round's rounding noise stays in the update; 32 levels cut it to a
#: third, and the example LM needed 0.6% more steps than float16 DDP to its target over nine
#: seeds (4 bits 2.1% more), for 25% more bytes up and the same down: n ranks' sums n·31 take
#: the lane width n·30 takes, for every n (docs/design.md, "The table without error feedback").
TABLE_WITHOUT_FEEDBACK = {"bits": 5, "granularity": 31}
#: The format of `State.state_dict()`: bumped when its layout changes.
STATE_FORMAT = 1


class Refused(ValueError):
    """The PS (or another rank's connect) refused this launch: the message says why, in the
    words of `connect`'s arguments."""


class State(PSHookState):
    """What `connect` returns: the hook's state (give it to `register_comm_hook` with
    `thc_ps.hook`), the rank's transport, and what the launch agreed on (`job`, `job_name`,
    `rank`, `world_size`).  `totals` counts what the rounds did; `close()` leaves the job."""

    def __init__(self, worker: Worker, *, process_group, rank: int, world_size: int, keep_reports: bool,
                 warmup_steps: int = 0):
        super().__init__(worker, world_size=world_size, keep_reports=keep_reports, warmup_steps=warmup_steps,
                         process_group=process_group)
        self.transport = worker.t
        self.job = worker.job
        self.job_name = worker.t.job_name
        self.rank, self.world_size = rank, world_size
        self._closed = False
        self._old_sigterm = None
        self._old_excepthook = None
        self._stopping = threading.Lock()
        self._wakeup = None                     # the write end of the SIGTERM watch's pipe

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The whole launch's codec state, gathered on group rank 0 (a collective: every rank
        calls it, between steps).  Rank 0 gets {"format", "job_name", "ranks": [one dict per
        rank]} to save beside the model's and the optimizer's; the other ranks get the same
        map with "ranks" None.  Error feedback is per rank, so one file holds every rank's."""
        mine = super().state_dict()
        everyone = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, everyone, dst=self._global(0), group=self.process_group)
        return {"format": STATE_FORMAT, "job_name": self.job_name, "world_size": self.world_size,
                "ranks": everyone}

    def load_state_dict(self, state: dict | None) -> None:
        """Go on from a `state_dict()` (a collective, before the first step or between steps).
        Any rank that has the saved map passes it, the others may pass None (a checkpoint on
        rank 0's disk alone is enough): the lowest rank that has it hands each rank its part."""
        have = isinstance(state, dict) and state.get("ranks") is not None
        if have and state.get("format") != STATE_FORMAT:
            raise ValueError(f"the saved THC-PS state has format {state.get('format')!r}; this version "
                             f"reads format {STATE_FORMAT}")
        if have and len(state["ranks"]) != self.world_size:
            raise ValueError(f"the saved THC-PS state is of {len(state['ranks'])} ranks, this launch has "
                             f"{self.world_size}: resume with the world size it was saved with")
        flags = [None] * self.world_size
        dist.all_gather_object(flags, have, group=self.process_group)
        if not any(flags):
            raise ValueError("no rank passed a saved THC-PS state to load_state_dict (every rank passed "
                             "None): load the checkpoint on at least one rank")
        src = flags.index(True)
        part = [None]
        dist.scatter_object_list(part, list(state["ranks"]) if self.rank == src else None,
                                 src=self._global(src), group=self.process_group)
        super().load_state_dict(part[0])

    def _global(self, group_rank: int) -> int:
        if self.process_group is None:
            return group_rank
        return dist.get_global_rank(self.process_group, group_rank)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop the hook's thread and leave the PS job (the PS ends it when every rank left).
        Idempotent; also run at exit and on SIGTERM."""
        if self._closed:
            return
        self._closed = True
        super().close()
        self.worker.close()
        self.transport.close()
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
            if self._wakeup is not None:        # the watch thread reads EOF and ends
                signal.set_wakeup_fd(-1)
                os.close(self._wakeup)
                self._wakeup = None
        if self._old_excepthook is not None and sys.excepthook == self._on_exception:
            sys.excepthook, self._old_excepthook = self._old_excepthook, None

    def __enter__(self) -> "State":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def where(self) -> str:
        """Where this rank is, for a note: the job, its latest round, what the PS waits for."""
        status = next((s for s in self.transport.status if s), None) or {}
        missing = status.get("missing") or []
        waits = "; the PS's job was waiting for " + ", ".join(
            f"rank {m['rank']} ({m['why']})" for m in missing) if missing else ""
        return f"job {self.job_name!r}, round {self.worker.round_no}{waits}"

    def _on_exception(self, kind, value, tb) -> None:
        """An error ends the script (a peer's death seen by gloo, say): say where this rank was
        before Python prints the traceback."""
        if not self._closed:
            print(f"thc_ps: rank {self.rank} ended by {kind.__name__} in {self.where()}", file=sys.stderr,
                  flush=True)
        (self._old_excepthook or sys.__excepthook__)(kind, value, tb)

    def _on_sigterm(self, signum=None, frame=None) -> None:
        """torchrun stops the other ranks with SIGTERM when one fails: say where this rank was,
        leave the job at once, and exit as SIGTERM would have."""
        if not self._stopping.acquire(blocking=False):     # the watch thread or the handler: once
            return
        print(f"thc_ps: rank {self.rank} stopped by SIGTERM in {self.where()}", file=sys.stderr, flush=True)
        try:
            self.transport.close()
        finally:
            os._exit(128 + signal.SIGTERM)

    def _watch_sigterm(self) -> None:
        """Act on SIGTERM at once, whatever the main thread does.  Python runs a handler only
        when the main thread runs Python again, and a rank's main thread waits in C (DDP's
        backward, for a round that waits for the dead rank): torchrun would SIGKILL it 30 s
        later with nothing said.  The signal module's wakeup fd is written by the C-level
        handler at once; a daemon thread reads it.  Only where no wakeup fd is in use yet
        (an asyncio loop's), and from the main thread."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        if signal.set_wakeup_fd(w, warn_on_full_buffer=False) != -1:    # someone else's: put it back
            signal.set_wakeup_fd(-1)
            os.close(r)
            os.close(w)
            return

        def watch():
            while True:
                got = os.read(r, 64)
                if not got or signal.SIGTERM in got:
                    break
            os.close(r)
            if got and not self._closed:
                self._on_sigterm()
        self._wakeup = w
        threading.Thread(target=watch, daemon=True, name="thc-ps-sigterm").start()


# (annotated without `from __future__ import annotations`: DDP checks the hook's annotations)
def hook(state: PSHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's average over the launch's ranks, through the PS."""
    return ps_hook(state, bucket)


def _in_callers_words(message: str, world_size: int) -> str:
    """A PS refusal with its job-field comparisons ("F: PS has A, worker expects B") said as
    the PS's value against what connect() was given."""
    def one(m: re.Match) -> str:
        field, have, want = m.group(1), m.group(2), m.group(3)
        if field == "num_workers":
            return f"world size: the PS's job has {have} workers, this process group has {want} ranks"
        return f"{field}: the PS has {have}, connect({field}={want})"
    return re.sub(r"(\w+): PS has (.+?), worker expects (.+?)(?=;|$)", one, message)


def default_job_name(launch: str, environ=None) -> str:
    """The PS job name of a launch: torchrun's run id and restart count (so an elastic
    restart starts a job of its own while the previous incarnation's leases run out) and the
    launch token (so launches that share a run id never share a job)."""
    env = os.environ if environ is None else environ
    run = re.sub(r"[^A-Za-z0-9._-]", "-", env.get("TORCHELASTIC_RUN_ID", "") or "torch")[:32]
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    restart = restart if restart.isdigit() else "0"
    return f"{run}.r{restart}.{launch[:8]}"


def _check_model(model) -> None:
    if not hasattr(model, "register_comm_hook"):
        raise ValueError(f"connect(model=...) takes a DistributedDataParallel model (it registers the hook "
                         f"on it), got {type(model).__name__}; wrap it in DistributedDataParallel first, "
                         f"or call connect() without a model and register thc_ps.hook yourself")
    for name, p in model.named_parameters():
        if p.requires_grad:
            PSHookState.check_bucket(p, f"parameter {name!r}")


def _group_of(process_group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("thc_ps.connect() needs a torch.distributed process group: call "
                         "dist.init_process_group(...) first (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR)")
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    env_world = os.environ.get("WORLD_SIZE")
    if process_group is None and env_world and env_world.isdigit() and int(env_world) != world:
        raise ValueError(f"the process group has {world} ranks but WORLD_SIZE={env_world}: start every rank "
                         f"with the same world size")
    return rank, world


def _agree(ok: bool, why: str, rank: int, world: int, process_group) -> None:
    """Every rank learns whether every rank connected; a refusal is raised on all of them,
    naming the rank it came from."""
    told = [None] * world
    dist.all_gather_object(told, (ok, why), group=process_group)
    bad = [(r, w) for r, (good, w) in enumerate(told) if not good]
    if bad:
        r, w = bad[0]
        raise Refused(w if r == rank else f"rank {r} could not connect: {w}")


def job_proposal(world: int, given: dict, error_feedback: bool) -> JobConfig:
    """The job a launch proposes: the options `given`, else `thc train`'s defaults, except that
    without error feedback the support fraction p is P_WITHOUT_FEEDBACK and the table
    TABLE_WITHOUT_FEEDBACK (unless bits or granularity is given: a given b keeps g's default,
    and the reverse).  Only the given options are insisted on: a PS with a fixed job keeps its
    own for the rest."""
    defaults = {} if error_feedback else {"p": P_WITHOUT_FEEDBACK}
    if not error_feedback and "bits" not in given and "granularity" not in given:
        defaults.update(TABLE_WITHOUT_FEEDBACK)
    return JobConfig(num_workers=world, **{**defaults, **given})


def connect(model=None, ps: str | None = None, *, keys: str | None = None, job_name: str | None = None,
            process_group=None, error_feedback: bool = ERROR_FEEDBACK, warmup_steps: int = WARMUP_STEPS,
            keep_reports: bool = False, notes: bool = True, **options) -> State:
    """Join this rank to a THC-PS job and return the hook's state.

    `model`: a DistributedDataParallel model; given, its parameters' dtypes are checked and
    `thc_ps.hook` is registered on it.  `ps`: "HOST:PORT[,HOST:PORT…]", one per PS shard
    (default $THC_PS).  `keys`: the PS's CURVE key directory (`thc keys`; default
    $THC_PS_KEYS).  `job_name`: the job's name on the PS (default: from torchrun's run id,
    restart count and a launch token; `default_job_name`).  `process_group`: the group whose
    ranks form the job (default the world).  `error_feedback`: keep each bucket's residual
    (THC Alg. 3 line 22; off unless asked, ERROR_FEEDBACK).  `warmup_steps`: the job's first
    steps, whose buckets are all-reduced over the process group in float16 (PyTorch's
    fp16_compress_hook) before the PS takes over (WARMUP_STEPS; 0: the PS from the first
    step); every rank must give the same number.  Job options (JOB_OPTIONS: codec, bits,
    granularity, p, lane_bits, quorum, seed, rotation, block_log2, tail_log2, slots,
    result_group, codec_params) and transport options (TRANSPORT_OPTIONS: loss_policy,
    timeout_ms, ps_wait_s, queue_s, window) default to `thc train`'s (but without error
    feedback p, bits and granularity: P_WITHOUT_FEEDBACK and TABLE_WITHOUT_FEEDBACK,
    `job_proposal`); the job options given are ones this launch
    insists on.  `keep_reports`: keep every round's report until `take_reports()` (off:
    memory stays flat; `totals` always counts).  `notes`: when an uncaught error or a
    SIGTERM (torchrun stopping the ranks after one failed) ends the script, say on stderr
    where this rank was (job, round, the ranks the PS waited for); on SIGTERM leave the job.

    Raises ValueError for bad arguments and `Refused` when the PS or another rank refused
    the launch, on every rank and before any gradient is sent."""
    unknown = sorted(set(options) - set(JOB_OPTIONS) - set(TRANSPORT_OPTIONS))
    if unknown:
        raise TypeError(f"connect() got unknown option(s) {', '.join(unknown)}; job options: "
                        f"{', '.join(JOB_OPTIONS)}; transport options: {', '.join(TRANSPORT_OPTIONS)}")
    rank, world = _group_of(process_group)
    check_warmup_steps(warmup_steps, "connect(warmup_steps=...)")
    if model is not None:
        _check_model(model)
    ps = ps or os.environ.get(PS_ENV)
    if not ps:
        raise ValueError(f"no PS address: pass connect(ps='HOST:PORT[,HOST:PORT...]') or set ${PS_ENV}")
    shards = parse_ps(ps)
    keys = keys or os.environ.get(KEYS_ENV) or None
    given = {k: v for k, v in options.items() if k in JOB_OPTIONS and v is not None}
    proposal = job_proposal(world, given, error_feedback)   # bad values refused here, in their names
    expect = {k: v for k, v in proposal.to_msg().items() if k in {"num_workers", *given}}
    transport = {TRANSPORT_NAMES.get(k, k): v for k, v in options.items() if k in TRANSPORT_OPTIONS and v is not None}
    warmups = [None] * world
    dist.all_gather_object(warmups, warmup_steps, group=process_group)
    if len(set(warmups)) > 1:
        raise Refused("the ranks gave connect() different warmup_steps: " + ", ".join(
            f"rank {r} {w}" for r, w in enumerate(warmups)) + "; every rank must warm up as long")
    box = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0) if process_group else 0,
                               group=process_group)
    launch = box[0]
    name = job_name or default_job_name(launch)
    worker, why = None, ""
    try:
        t = Transport(shards[0][0], shards[0][1], rank, control_port=shards[0][2], shards=shards,
                      expect=expect, propose=proposal, keys=keys, job_name=name, launch=launch, **transport)
        worker = Worker(t, seed=t.job.seed, error_feedback=error_feedback)
    except ValueError as exc:
        why = _in_callers_words(str(exc), world)
    try:
        _agree(worker is not None, why, rank, world, process_group)
    except Refused:
        if worker is not None:      # connected, but another rank was refused: leave again
            worker.t.close()
        raise
    state = State(worker, process_group=process_group, rank=rank, world_size=world, keep_reports=keep_reports,
                  warmup_steps=warmup_steps)
    if model is not None:
        model.register_comm_hook(state, hook)
    atexit.register(state.close)
    if notes:
        state._old_excepthook, sys.excepthook = sys.excepthook, state._on_exception
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            state._watch_sigterm()
    return state
