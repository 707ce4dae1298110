"""`thc ps`, `thc worker` and `thc launch`: processes per host and a checked local cluster.

`thc launch` starts a PS (unless --ps is given) and N worker processes on this
host, runs R rounds of deterministic random gradients, and checks every chunk
of every round against an in-process reference: the exact integer sum
Σ_{i ∈ bitmap} T[Z_i] recomputed from the same seeds (THC), or the float32 sum
(codec none).  Under the `zero` policy a lost chunk is reported as lost, not as
a mismatch; every delivered chunk must still be exact.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
import zlib

import numpy as np

from thc_ps.deploy.procs import (die_with_parent, leave_on_sigterm, process_state, single_threaded_children,
                          start_shielded, stop_children)

from thc_ps.compression import thc
from thc_ps.proto.addresses import parse_ps
from thc_ps.proto.job import AUTO_GROUP, DEFAULT_BLOCK_LOG2, DEFAULT_ROTATION, DEFAULT_TAIL_LOG2, LANE_AUTO, JobConfig
from thc_ps.proto.packing import pack_lanes


def gradient(seed: int, round_no: int, worker: int, dim: int) -> np.ndarray:
    """The deterministic test gradient of (seed, round, worker).

    Values are multiples of 2^-10 below 2^7 in magnitude, so float32 sums of up to 32 of
    them are exact in any order: the uncompressed baseline can be checked bit for bit too.
    """
    rng = np.random.default_rng(np.random.SeedSequence([seed, round_no, worker, 0x6AD]))
    x = rng.standard_normal(dim) * rng.lognormal(0, 1)
    return (np.round(np.clip(x, -127, 127) * 1024) / 1024).astype(np.float32)


def one_host_group(requested: str, own_ps: bool) -> str:
    """The result group (JobConfig.result_group) of a cluster on this host.

    "auto": when the run starts its own PS on loopback, a fresh group in the
    organization-local range 239.255.0.0/16 at a random port, so that the PS sends each
    result once, as THC's switch multicasts it (THC §6), instead of once per worker (on one
    host that takes about a third of the PS's CPU off a 2^24 round: docs/design.md, "Result
    fan-out").  Random, so that clusters started side by side on one host each hear only
    their own.  "" (one copy per worker) when the run joins a running PS (its operator
    chooses) or when loopback has no multicast route here.  Anything else is the caller's
    own choice."""
    if requested != AUTO_GROUP:
        return requested
    if not own_ps:
        return ""
    import secrets
    from thc_ps.proto.sockets import multicast_unreachable
    group = (f"239.255.{1 + secrets.randbelow(254)}.{1 + secrets.randbelow(254)}",
             20000 + secrets.randbelow(30000))
    return "" if multicast_unreachable("127.0.0.1", group) else f"{group[0]}:{group[1]}"


KILLED = 17     # exit status of a worker killed by fault injection (`die_at`)


class LaunchFailed(RuntimeError):
    """No worker of a launch reported (each died or raised): the message joins their errors,
    and `doc` is the launch's summary all the same (ok false, the problems, nothing exact)."""

    def __init__(self, problems: list, doc: dict):
        super().__init__("launch failed: " + ("; ".join(problems) or "no worker reported"))
        self.doc = doc


def skip_to_front(w, dim: int, step: int, limit: int, passes: int = 50) -> int:
    """Skip the allreduces of `dim` coordinates that the results the data plane has fanned
    out to worker `w` since it registered again show finished (every chunk of its next round
    answered: Worker.round_finished_elsewhere), until a pass finds it at most a few rounds
    behind the others (the rest its stash answers); returns the step reached.  A round the
    others are still in is joined, not skipped.  Bounded by `passes` reads of at most 0.1 s
    each."""
    for _ in range(passes):
        seen = w.t.drain()
        skipped = 0
        while step < limit and w.round_finished_elsewhere(seen, dim):
            w.skip_rounds(1, dim)
            step, skipped = step + 1, skipped + 1
        if skipped <= 4:
            break
    return step


def worker_loop(shards, worker_id, rounds, dim, seed, policy, faults,
                straggler_delay_ms, straggler_prob, timeout_ms, window, report=None, quiet=True,
                bind_port=0, batched=True, expect=None, propose=None, keys=None, die_at=None,
                rejoin=False, progress=None, job_name=None, fixed_timeout=False, ps_wait_s=None,
                job_counters=False, error_feedback=False):
    """Run `rounds` allreduces of test gradients against the PS shards [(host, data, control)].

    `expect` is the job configuration this worker insists on (a dict of JobConfig fields),
    `propose` the job it proposes to a PS started without one.  A rank that registers into
    a running job in which it held a place before (it crashed and was restarted) rejoins:
    it fast-forwards to the round the other ranks are at.  `die_at` makes the process exit
    abruptly at the start of that round or the first one past it (fault injection); `rejoin` (a restarted rank) only
    joins a job it held a place in, and returns no rounds if that job has ended meanwhile.
    A rank whose lease expired while it was paused (SIGSTOP, descheduled, partitioned)
    rejoins the same way when it wakes: the rounds from the other ranks' step on run again,
    the ones it skipped are not reported.  If its job ended while it was away, the counters
    say `ended_while_away` and only the rounds it finished are reported.
    `progress` (a shared integer) is set to each round this worker starts, for the
    launcher's watchdog.  `job_name` names the job on the PS (None: the PS's default).
    `fixed_timeout` starts every chunk at `timeout_ms` instead of the measured RTO.
    `ps_wait_s`: how long to wait for a PS that answers nothing (None: the transport's default).
    `job_counters`: after the last round, read this job's counters from the PS (its status)
    into the counters' `ps_job`.  `error_feedback`: keep THC's error feedback (off: every
    round encodes its test gradient alone, as the exact check assumes unless told).
    Returns (per-round reports, transport counters, the job as announced by the PS).
    """
    import os

    from thc_ps.worker.client import Worker
    from thc_ps.worker.transport import JobEnded, LeaseLost, Transport
    sized = {} if window is None else {"window": window}      # None: the transport's default
    if ps_wait_s is not None:
        sized["ps_wait_s"] = ps_wait_s
    try:
        t = Transport(shards[0][0], shards[0][1], worker_id, control_port=shards[0][2], policy=policy,
                      faults=faults, timeout_ms=timeout_ms, shards=shards, **sized,
                      bind_port=bind_port, batched=batched, expect=expect, propose=propose, keys=keys,
                      rejoin=rejoin, job_name=job_name, adaptive_timeout=not fixed_timeout)
    except ValueError as exc:
        if not rejoin or "no running job to rejoin" not in str(exc):
            raise
        if report is not None:
            report.put((worker_id, [], {"rejoin_refused": 1}, None))
        return [], {"rejoin_refused": 1}, None
    w = Worker(t, error_feedback=error_feedback, seed=seed, straggler_delay_ms=straggler_delay_ms,
               straggler_prob=straggler_prob, per_round_rng=True)
    out, job_ps = [], None
    lapses, missed, ended, catching = 0, 0, False, False
    quorum_job = t.job.quorum_count < t.job.num_workers

    def catch_up(own: int = 0) -> int:
        """Fast-forward to the others' step: in a quorum-1 job that is the round they wait in
        for this rank.  A quorum job goes on meanwhile, and the heartbeats' step is up to a
        heartbeat old: there the rank reads the results fanned out to it since it registered
        again and skips the rounds they show finished, so its first round is the one the
        others are in (a round behind the front would be lost, and at the front's pace it
        would never catch up; a round skipped while the others are in it is lost for them).
        `own`: the round this rank was in when its lease lapsed (no other rank can be before
        it in a quorum-1 job, nor past it while all of them lapsed: no live rank says a step)."""
        nonlocal catching
        first = min(max(t.others_step(), own), rounds)
        w.skip_rounds(first, dim)
        if quorum_job:
            first = skip_to_front(w, dim, first, rounds)
        t.progress = first
        catching = True
        if not quiet:
            print(f"worker {worker_id} rejoined job {t.sessions[0]['job_number']} at round {first}",
                  file=sys.stderr, flush=True)
        return first

    try:
        r = catch_up() if t.rejoined else None
        while True:
            try:
                if r is None:
                    t.barrier("start")
                    r = 0
                if die_at is not None and r >= die_at:
                    os._exit(KILLED)        # >=: a straggler skipped to the front may pass die_at, even to the end
                if r >= rounds:
                    t.progress = rounds          # done: a rank that rejoins now skips every round
                    t.barrier("end")
                    job_ps = job_stats(shards, t.sessions, keys, 5.0) if job_counters else None
                    break
                t.progress = r
                if progress is not None:
                    progress.value = r
                notices = t.stats.counters["straggler_notices"]
                w.allreduce(gradient(seed, r, worker_id, dim), key="grad", round_no=r)
                rep = w.last
                r += 1
                straggled = quorum_job and t.stats.counters["straggler_notices"] > notices
                if (catching and rep.lost) or straggled:
                    missed += 1             # too late for it: the job went on without this rank
                    if straggled:
                        # a straggler (paused, descheduled) in a quorum job: at the others' pace
                        # it would stay behind for good; resynchronize at the front
                        r = skip_to_front(w, dim, r, rounds)
                        catching = True
                    continue
                catching = False
                out.append({"round": r - 1, "lost": rep.lost, "k": rep.contributors, "bitmap": rep.bitmaps,
                            "digest": rep.chunk_digests(), "norms": rep.norms,
                            "seconds": rep.seconds, "bytes_up": rep.bytes_up, "bytes_down": rep.bytes_down})
                if not quiet:
                    print(f"worker {worker_id} round {r}/{rounds} {rep.seconds * 1e3:.1f} ms "
                          f"lost={rep.lost}", file=sys.stderr, flush=True)
            except LeaseLost as exc:
                lapses += 1
                print(f"worker {worker_id}: {exc}; rejoining", file=sys.stderr, flush=True)
                w.rejoin()
                r = catch_up(r if r is not None and not quorum_job else 0)
                out = [o for o in out if o["round"] < r]     # rounds it runs again
        counters = dict(t.stats.counters)
    except JobEnded as exc:
        ended = True
        print(f"worker {worker_id}: {exc}", file=sys.stderr, flush=True)
        counters = dict(t.stats.counters)
    finally:
        t.close(leave=not ended)
    counters["resumes"] = t.resumes
    counters["lease_rejoins"] = lapses
    counters["catch_up_missed_rounds"] = missed
    counters["ended_while_away"] = int(ended)
    if job_ps is not None:
        counters["ps_job"] = job_ps
    counters["rto_ms"] = 1e3 * max(t.rtt.first_timeout(s, t.cwnd) for s in range(len(t.shard_addrs)))
    announced = t.job.to_msg()
    if report is not None:
        report.put((worker_id, out, counters, announced))
    return out, counters, announced


def _worker_entry(*args, **kwargs):
    die_with_parent()
    leave_on_sigterm()          # the launcher, interrupted, stops its workers: each leaves its job
    try:
        worker_loop(*args, **kwargs)
    except KeyboardInterrupt:
        pass
    except ValueError as exc:   # refused (the job's configuration, the keys): the parent exits 2
        kwargs["report"].put((args[1], str(exc), None, REFUSED))
    except Exception as exc:    # reported to the parent, which fails the launch
        kwargs["report"].put((args[1], f"{type(exc).__name__}: {exc}", None, None))


#: the report of a worker whose registration was refused (a ValueError: configuration, keys)
REFUSED = "refused"


def _by_round(per_worker: dict) -> dict:
    """{rank: {round: report}} from {rank: [report, ...]} (a rejoined rank reports fewer)."""
    return {i: {rep["round"]: rep for rep in reps} for i, reps in per_worker.items()}


def reference_digests(job: JobConfig, seed: int, round_no: int, dim: int, reports: dict,
                      memory: dict | None = None) -> list:
    """Per-chunk crc32 of the exact aggregate each reported bitmap should have produced.

    Every rank's contribution is recomputed from (seed, rank, round) — test gradients and
    per-round randomness — so ranks that did not report (another host's, or a crashed
    incarnation's) are checked too, with the shared norms of any rank's report.  `memory`
    ({rank: ErrorFeedback}, thc): the ranks keep error feedback, so each rank's encoding
    adds its residual of the previous round (docs/protocol.md §4 step 8 under rotation
    `job`) and leaves its new one there: the rounds must come in order."""
    n = job.num_workers
    grads = [gradient(seed, round_no, i, dim) for i in range(n)]
    per = job.elems_per_packet
    if job.codec == "none":
        payloads = None
    else:
        from thc_ps.worker.client import round_rng
        cfg = thc.ThcConfig.of_job(job)
        tab = np.asarray(job.table, dtype=np.int64)
        shared = next(r["norms"] for r in reports.values() if r.get("norms") is not None)
        # a rank encodes with the norms it ended up with (its own, if it lost the NORM result)
        norms = [np.asarray(reports[i]["norms"] if i in reports else shared) for i in range(n)]
        payloads = []
        for i in range(n):
            rnd = thc.WorkerRound(cfg, grads[i], None if memory is None else memory[i], "grad")
            payloads.append(tab[rnd.encode(norms[i], round_rng(seed, i, round_no), round_no)])
            rnd.feedback()          # nothing without a memory
    results = []
    total_len = payloads[0].size if payloads is not None else dim
    for c, off in enumerate(range(0, total_len, per)):
        count = min(per, total_len - off)
        by_bitmap = {}
        for rep in reports.values():
            bm = rep["bitmap"][c]
            if bm == 0 or bm in by_bitmap:
                continue
            members = [w for w in range(n) if bm >> w & 1]
            if payloads is None:
                # the PS's float32 sum: the first contribution, then IEEE additions in rank
                # order (exact for these gradients, and −0.0 + −0.0 stays −0.0; 0.0 + … would not)
                s = grads[members[0]][off:off + count].copy()
                for w in members[1:]:
                    s = s + grads[w][off:off + count]
                by_bitmap[bm] = zlib.crc32(s.astype(">f4").tobytes())
            else:
                s = sum(payloads[w][off:off + count] for w in members)
                by_bitmap[bm] = zlib.crc32(pack_lanes(s, job.lane_bits))
        results.append(by_bitmap)
    return results


def check_blob_rounds(job: JobConfig, seed: int, dim: int, per_worker: dict) -> dict:
    """Decode–sum–re-encode codecs: each round's downlink payload must equal the in-process
    aggregate of the same seeds (full rounds; rounds a worker lost are counted as lost)."""
    from thc_ps.compression import registry
    from thc_ps.compression.codec import Context, combine_preliminary
    from thc_ps.worker.client import round_rng
    n = job.num_workers
    codec = registry.get(job.codec, **job.codec_params)
    states = [codec.new_state() for _ in range(n)]
    ps_state = codec.new_ps_state()
    reports = _by_round(per_worker)
    rounds = max((max(r) + 1 for r in reports.values() if r), default=0)
    exact, mismatched, lost = 0, 0, 0
    for r in range(rounds):
        grads = [gradient(seed, r, i, dim) for i in range(n)]
        stats = [codec.preliminary(g, s) for g, s in zip(grads, states)]
        shared = combine_preliminary(stats)
        if shared is not None:
            shared = np.asarray(shared, dtype=np.float32).astype(np.float64)
        ctx = Context("grad", dim, r + 1, shared, n)
        ups = [codec.encode(g, s, round_rng(seed, i, r + 1), ctx) for i, (g, s) in enumerate(zip(grads, states))]
        ps_ctx = Context(str(dim), dim, r + 1, None, n)       # the PS knows a tensor by its size
        want = zlib.crc32(codec.aggregate(ups, ps_state, ps_ctx))
        ok = True
        for i in reports:
            rep = reports[i].get(r)
            if rep is None:
                continue
            if rep["bitmap"][0] == 0:
                lost += 1
                ok = False
            elif rep["digest"][0] != want:
                mismatched += 1
                ok = False
        exact += ok
    return {"rounds": rounds, "exact_rounds": exact, "mismatched_chunks": mismatched, "lost_chunks": lost}


def check_rounds(job: JobConfig, seed: int, dim: int, per_worker: dict, error_feedback: bool = False) -> dict:
    """Compare every reported chunk with the reference; returns exact/lost/mismatch counts.

    A round is exact only if every chunk every rank reported for it arrived and matched.
    `error_feedback`: the ranks kept THC's error feedback (`thc launch --error-feedback`):
    the reference replays every rank's residual from round 0 on."""
    if job.blob:
        return check_blob_rounds(job, seed, dim, per_worker)
    reports = _by_round(per_worker)
    rounds = max((max(r) + 1 for r in reports.values() if r), default=0)
    exact_rounds, mismatched, lost = 0, 0, 0
    memory = None
    if error_feedback and job.codec == "thc":
        from thc_ps.compression.codec import ErrorFeedback
        memory = {i: ErrorFeedback() for i in range(job.num_workers)}
    for r in range(rounds):
        have = {i: reps[r] for i, reps in reports.items() if r in reps}
        if not have:
            if memory is not None:
                raise ValueError(f"no rank reported round {r}: error feedback cannot be replayed past it")
            continue
        ref = reference_digests(job, seed, r, dim, have, memory)
        ok = True
        for rep in have.values():
            for c, digest in enumerate(rep["digest"]):
                bm = rep["bitmap"][c]
                if bm == 0:
                    lost += 1
                    ok = False
                elif ref[c].get(bm) != digest:
                    mismatched += 1
                    ok = False
        exact_rounds += ok
    return {"rounds": rounds, "exact_rounds": exact_rounds, "mismatched_chunks": mismatched,
            "lost_chunks": lost}


class _Supervisor:
    """The launcher's worker processes: spawns them, collects their reports, starts a killed
    rank again (`restart`), and stops the job when no worker has started a round for
    `stall_s` seconds, naming the ranks behind (a stopped or hung process) and what the PS
    says the job waits for (`explain()`: ranks that never joined, from another host).
    Interrupted (Ctrl-C, SIGTERM), it stops the workers with SIGTERM (each leaves its job)
    and raises KeyboardInterrupt."""

    def __init__(self, ranks, worker_args, kill, restart: bool, stall_s: float, explain=lambda: ""):
        self.ctx = mp.get_context("spawn")
        self.q = self.ctx.Queue()
        self.ranks, self.worker_args, self.kill, self.restart = ranks, worker_args, kill, restart
        self.stall_s, self.explain = stall_s, explain
        self.refused: list = []
        self.progress = {i: self.ctx.Value("q", -1, lock=False) for i in ranks}
        self.procs: dict = {}
        self.per_worker, self.counters, self.errors, self.announced = {}, {}, [], None
        self.restarted = 0
        self._seen, self._moved = {}, time.monotonic()
        for i in ranks:
            self.spawn(i, kill[1] if kill is not None and kill[0] == i else None)

    def spawn(self, i: int, die_at=None, rejoin=False) -> None:
        args, kwargs = self.worker_args(i)
        proc = self.ctx.Process(target=_worker_entry, args=args, daemon=True,
                                kwargs={**kwargs, "report": self.q, "die_at": die_at, "rejoin": rejoin,
                                        "progress": self.progress[i]})
        start_shielded(proc)           # Ctrl-C is the launcher's to handle, not each worker's
        self.procs[i] = proc

    def _pending(self) -> bool:
        return len(self.per_worker) + len(self.errors) < len(self.ranks)

    def run(self) -> None:
        try:
            while self._pending():
                self._watchdog()
                try:
                    wid, out, ctr, ann = self.q.get(timeout=0.5)
                except Exception:
                    self._exits()
                    continue
                if ctr is None:
                    self.errors.append(f"worker {wid}: {out}")
                    if ann == REFUSED:
                        self.refused.append(out)
                elif ctr.get("rejoin_refused"):        # restarted after its job had ended
                    self.per_worker[wid], self.counters[wid] = [], ctr
                else:
                    self.per_worker[wid], self.counters[wid], self.announced = out, ctr, ann
        except KeyboardInterrupt:
            stop_children(list(self.procs.values()))
            raise

    def _exits(self) -> None:
        """Workers that ended without a report: a killed rank (restarted, or an error), a crash."""
        for i, proc in list(self.procs.items()):
            if proc.exitcode == KILLED and i not in self.per_worker:
                if self.restart:
                    self.restarted += 1
                    print(f"rank {i} was killed at round {self.kill[1]} (fault injection); started it "
                          f"again: it rejoins the running job", file=sys.stderr, flush=True)
                    self.spawn(i, rejoin=True)
                else:
                    self.errors.append(f"worker {i}: killed at round {self.kill[1]} (fault injection)")
                    self.procs.pop(i)
            elif proc.exitcode not in (None, 0, KILLED) and i not in self.per_worker and self.q.empty():
                self.errors.append(f"worker {i}: exited with status {proc.exitcode}")
                self.procs.pop(i)
        if not any(p.is_alive() for p in self.procs.values()) and self.q.empty() and self._pending():
            missing = [i for i in self.ranks if i not in self.per_worker]
            self.errors.append(f"workers {missing} ended without a report")

    def _watchdog(self) -> None:
        now = time.monotonic()
        current = {i: v.value for i, v in self.progress.items()}
        if current != self._seen:
            self._seen, self._moved = current, now
            return
        if now - self._moved < self.stall_s:
            return
        behind = sorted((i for i, p in self.procs.items() if i not in self.per_worker and p.is_alive()),
                        key=lambda i: current[i])
        waits = self.explain() if behind else ""
        for i in behind:
            stopped = process_state(self.procs[i].pid) == "T"
            self.errors.append(f"worker {i}: no worker started a round for {self.stall_s:g} s; rank {i} "
                               f"is at round {current[i]}"
                               f"{' (its process is stopped by a signal)' if stopped else ''}"
                               f"{'; ' + waits if waits else ''}; stopped it")
            self.procs.pop(i).kill()

    def stop(self) -> None:
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def run_launch(*, workers=4, rounds=10, dim=1 << 16, codec="thc", bits=4, granularity=30, p="1/32",
               quorum=1.0, loss=0.0, duplicate=0.0, reorder=0.0, straggler_delay_ms=0.0,
               straggler_rank=None, straggler_prob=1.0, policy="retransmit", seed=0, ps=None,
               engine="c", timeout_ms=50.0, window=None, slots=512, lane_bits=LANE_AUTO, verbose=False,
               ps_control_port=None, check=True, shards=1, batched=True, rank_base=0,
               local_workers=None, expect=None, keys=None, kill=None, restart=False,
               lease_s=None, rejoin_grace_s=None, stall_s=180.0, job_name=None,
               fixed_timeout=False, block_log2=DEFAULT_BLOCK_LOG2, tail_log2=DEFAULT_TAIL_LOG2,
               rotation=DEFAULT_ROTATION, result_group=AUTO_GROUP,
               serve_shard=None, ps_wait_s=None, error_feedback=False) -> dict:
    """Start a PS with `shards` shards (unless `ps` = "host:port[,host:port…]") and worker
    processes for ranks rank_base … rank_base + local_workers − 1 of an n = `workers` job;
    returns the JSON summary, whose `ok` is False when any chunk was inexact or, under
    `retransmit`, lost, or when a worker failed.

    With `ps`, the workers propose this job to a PS that has none and insist on `expect`
    (default: every field of this job); the check uses the job the PS announced.  The job
    is named `job_name` on that PS, by default a fresh name (launch-<8 hex digits>), so that
    launches started together run beside each other; a launch of a share of the ranks (one
    host of several) uses the PS's default name unless the hosts pass one.
    `kill` = (rank, round) makes that rank's process die at the start of that round;
    with `restart` it is started again and rejoins the running job.
    batched=False makes the workers use one system call per datagram instead of
    sendmmsg/recvmmsg.  `result_group` ("A.B.C.D:PORT") makes the PS multicast each result
    once to that group instead of sending it to every worker; "" sends one copy to each;
    "auto" (the default) picks a group when this launch starts the PS (one_host_group).
    `serve_shard` ("ADDR:PORT", one of `ps`'s shards) also runs that shard here for the job,
    control plane on PORT+1: colocated shards, one per host, as BytePS colocates its servers
    with its workers (every host passes the same `ps` list, each serving its own entry); the
    shard stays up after this host's workers finish until every rank has left its job.
    `ps_wait_s`: how long the workers wait for a PS that answers nothing (a restarted or
    stalled one) before they give up (None: thc_ps.worker.transport.DEFAULT_PS_WAIT_S).
    `error_feedback` (thc): the workers keep THC's error feedback and the check replays it
    (docs/protocol.md §4 step 8): every rank must run every round (no `kill`, quorum 1).

    Every wait is bounded: the workers' own (they fail naming a missing rank or an
    unreachable PS), and this launcher's watchdog, which stops the job when no worker has
    started a new round for `stall_s` seconds and names the ranks that are behind.  The
    workers die with this process (PR_SET_PDEATHSIG); SIGTERM/Ctrl-C stop them at once."""
    from thc_ps.worker.transport import Faults
    if error_feedback and (codec != "thc" or kill is not None or quorum < 1):
        raise ValueError("--error-feedback is THC's (codec thc) and the check replays every rank's residual "
                         "from round 0: every rank must run every round (no --kill-rank, quorum 1)")
    local_workers = workers - rank_base if local_workers is None else local_workers
    if not (0 <= rank_base and 1 <= local_workers and rank_base + local_workers <= workers):
        raise ValueError(f"ranks {rank_base}..{rank_base + local_workers - 1} do not fit a job of "
                         f"{workers} workers")
    job = JobConfig(num_workers=workers, codec=codec, bits=bits, granularity=granularity, p=p,
                    quorum=quorum, seed=seed, slots=slots, lane_bits=lane_bits, block_log2=block_log2,
                    tail_log2=tail_log2, rotation=rotation, result_group=one_host_group(result_group, own_ps=ps is None))
    servers, servers_here = [], []
    if serve_shard is not None and ps is None:
        raise ValueError("--serve-shard needs --ps listing every host's shard (this one's included)")
    from thc_ps.ps_server.server import PSServer
    options = {"engine": engine, "keys": keys}       # of every PS shard this launch starts
    if lease_s is not None:
        options["lease_s"] = lease_s
    if rejoin_grace_s is not None:
        options["rejoin_grace_s"] = rejoin_grace_s
    if ps is None:
        for _ in range(shards):
            servers.append(PSServer(job, ("127.0.0.1", 0), control_port=0, **options).start())
        shard_list = [("127.0.0.1", s.data_addr[1], s.control_port) for s in servers]
    else:
        shard_list = parse_ps(ps, ps_control_port)
        if serve_shard is not None:
            host, port = _shard_here(serve_shard, shard_list)
            servers_here.append(PSServer(job, (host, port), control_port=port + 1, **options).start())
        if job_name is None and local_workers == workers:
            import secrets
            job_name = f"launch-{secrets.token_hex(4)}"
    if expect is None:
        expect = job.to_msg()
        if ps is not None and result_group == AUTO_GROUP:
            del expect["result_group"]       # the running PS's job says where results go
    single_threaded_children()
    faults = Faults(drop_out=loss, drop_in=loss, duplicate=duplicate, reorder=reorder, seed=seed)

    # the job's counters are read after the end barrier by the lowest rank the launch does not
    # kill: a killed rank restarted may find its job ended and read nothing
    reader = next((r for r in range(rank_base, rank_base + local_workers) if kill is None or r != kill[0]), rank_base)

    def worker_args(i):
        delay = straggler_delay_ms if (straggler_rank is None or straggler_rank == i) else 0.0
        return ((shard_list, i, rounds, dim, seed, policy, faults, delay, straggler_prob, timeout_ms,
                 window), {"batched": batched, "expect": expect, "propose": job, "quiet": not verbose,
                           "keys": None if keys is None else str(keys), "job_name": job_name,
                           "fixed_timeout": fixed_timeout, "ps_wait_s": ps_wait_s,
                           "job_counters": i == reader, "error_feedback": error_feedback})

    ranks = range(rank_base, rank_base + local_workers)

    def explain() -> str:
        return job_waits_for(shard_list[0], job_name, keys)

    sup = _Supervisor(ranks, worker_args, kill, restart, stall_s, explain)
    t0 = time.perf_counter()
    try:
        sup.run()
    finally:
        sup.stop()
        elapsed = time.perf_counter() - t0
        ps_stats = _merge_stats([s.stats() for s in servers]) if servers else \
            fetch_ps_stats(shard_list, keys)
        for s in servers:
            s.stop()
        for s in servers_here:
            _stop_when_left(s)
    per_worker, counters, errors, announced = sup.per_worker, sup.counters, sup.errors, sup.announced
    restarted = sup.restarted
    if not per_worker and sup.refused and len(sup.refused) == len(errors):
        raise ValueError("; ".join(dict.fromkeys(sup.refused)))    # each reason once, not once per worker
    if not per_worker:
        problems = errors or ["no worker reported"]
        raise LaunchFailed(problems, {
            "rounds": rounds, "exact_rounds": 0, "mismatched_chunks": None, "lost_chunks": None,
            "ok": False, "problems": problems, "workers": workers, "job_name": job_name,
            "ranks": [], "dim": dim, "codec": codec, "quorum": quorum, "policy": policy,
            "seconds": elapsed, "restarted_workers": restarted, "ps": ps_stats})
    used = JobConfig.from_msg(announced) if announced else job
    result = check_rounds(used, seed, dim, per_worker, error_feedback) if check else \
        {"rounds": rounds, "exact_rounds": None, "mismatched_chunks": None, "lost_chunks": None}
    total = lambda key: int(sum(c.get(key, 0) for c in counters.values()))
    per_worker = {i: out for i, out in per_worker.items() if out}
    problems = list(errors)
    if check and result["mismatched_chunks"]:
        problems.append(f"{result['mismatched_chunks']} chunks differ from the reference")
    if check and policy == "retransmit" and result["lost_chunks"]:
        problems.append(f"{result['lost_chunks']} chunks lost under retransmit")
    away = sorted(i for i, c in counters.items() if c.get("ended_while_away"))
    if away and used.quorum >= 1:
        problems.append(f"the job ended while rank{'s' if len(away) > 1 else ''} "
                        f"{', '.join(map(str, away))} {'were' if len(away) > 1 else 'was'} away")
    first = next(iter(per_worker.values()), None)
    if first is None:               # every rank reported, none a round (each ran them again after a lapse)
        problems.append(f"no rank reported a round of {rounds} (lease rejoins: "
                        f"{total('lease_rejoins')}, resumes: {total('resumes')})")
    return {**result, "ok": not problems, "problems": problems, "workers": workers, "job_name": job_name,
            "ranks": sorted(per_worker), "dim": dim, "codec": used.codec, "quorum": used.quorum,
            "result_group": used.result_group,
            "loss": loss, "policy": policy, "seconds": elapsed, "restarted_workers": restarted,
            "mean_round_ms": 1e3 * float(np.mean([r["seconds"] for w in per_worker.values() for r in w]
                                                  or [0.0])),
            "retransmissions": total("retransmissions"), "timeouts": total("timeouts"),
            "fast_losses": total("fast_losses"), "notices": total("notices"), "packets_sent": total("packets_sent"),
            "rto_ms": max((c.get("rto_ms", 0.0) for c in counters.values()), default=0.0),
            "fixed_timeout": fixed_timeout,
            "lost_chunks_reported": total("lost_chunks"), "straggler_notices": total("straggler_notices"),
            "resynced_chunks": total("resynced_chunks"), "ps_restarts_survived": total("resumes"),
            "rejoin_refused": total("rejoin_refused"), "lease_rejoins": total("lease_rejoins"),
            "catch_up_missed_rounds": total("catch_up_missed_rounds"),
            "away_at_end": away,
            "injected": {k: total(k) for k in ("injected_drops_out", "injected_drops_in",
                                                 "injected_duplicates", "injected_reorders")},
            "drops": ps_stats["drops"] if ps_stats else None, "ps": ps_stats,
            "ps_job": next((c["ps_job"] for c in counters.values() if c.get("ps_job")), None),
            "bytes_up_per_round": first[0]["bytes_up"] if first else 0,
            "bytes_down_per_round": first[0]["bytes_down"] if first else 0}


def _shard_here(addr: str, shard_list: list) -> tuple[str, int]:
    """--serve-shard's (host, port), which must be one of the --ps shards (colocated shards:
    every host lists all of them, its own included)."""
    host, _, port = addr.rpartition(":")
    if not port.isdigit() or (host, int(port)) not in [(sh[0], sh[1]) for sh in shard_list]:
        listed = ", ".join(f"{sh[0]}:{sh[1]}" for sh in shard_list)
        raise ValueError(f"--serve-shard {addr} is not one of the --ps shards ({listed}): every host "
                         f"lists all shards, its own included")
    return host, int(port)


def _stop_when_left(server, timeout_s: float = 120.0) -> None:
    """Stop a colocated shard once its job has ended (every rank left, or its leases lapsed):
    ranks of other hosts may still be finishing their last round through it."""
    deadline = time.monotonic() + timeout_s
    while server.jobs and time.monotonic() < deadline:
        time.sleep(0.1)
    server.stop()


def ask_ps(shard: tuple, msg: dict, keys=None, timeout_s: float = 2.0) -> dict | None:
    """One control request to a PS shard (host, data_port, control_port[, control_host]) from
    outside any job; None when it does not answer within `timeout_s`.  Keys that do not fit
    the PS's raise HandshakeFailed (a ValueError) naming the cause, at once."""
    import zmq

    from thc_ps.proto import control
    from thc_ps.proto.keys import HandshakeWatch, client_keys
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    watch = None
    try:
        if keys is not None:
            sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = client_keys(keys)
        watch = HandshakeWatch(sock, server=False, curve=keys is not None)
        endpoint = f"tcp://{shard[3] if len(shard) > 3 else shard[0]}:{shard[2]}"
        sock.connect(endpoint)
        sock.send(control.encode(msg))
        deadline = time.monotonic() + timeout_s
        while not sock.poll(int(1000 * min(0.1, max(0.0, deadline - time.monotonic())))):
            watch.check(endpoint)
            if time.monotonic() >= deadline:
                return None
        return control.decode(sock.recv())
    finally:
        if watch is not None:
            watch.close()
        sock.close(0)


def fetch_status(shard: tuple, keys=None, timeout_s: float = 2.0) -> dict | None:
    """A running PS's status reply: every running and queued job (None: no answer)."""
    reply = ask_ps(shard, {"type": "status"}, keys, timeout_s)
    return reply if reply is not None and reply.get("type") == "status" else None


def job_stats(shards: list, sessions: list, keys=None, timeout_s: float = 2.0) -> dict | None:
    """One running job's counters on the PS (its status listing), shards added up: the job
    each shard's registration reply (`sessions`) names.  None when a shard does not say."""
    stats = []
    for shard, sess in zip(shards, sessions):
        doc = fetch_status(shard, keys, timeout_s)
        job = next((j for j in (doc or {}).get("jobs", []) if j["job_number"] == sess["job_number"]), None)
        if job is None:
            return None
        stats.append(job["stats"])
    return _merge_stats(stats)


def job_waits_for(shard: tuple, job_name: str | None, keys=None) -> str:
    """What the PS says a job (by name; None: the default name) waits for: its missing ranks,
    or that it is queued; '' when the PS does not answer or names nothing."""
    from thc_ps.proto.control import describe_missing
    from thc_ps.ps_server.server import DEFAULT_JOB_NAME
    name = job_name or DEFAULT_JOB_NAME
    try:
        doc = fetch_status(shard, keys) or {}
    except ValueError:
        return ""
    job = next((j for j in doc.get("jobs", []) if j["job_name"] == name), None)
    if job is not None and job["missing"]:
        return f"the PS's job {job['job_number']} waits for {describe_missing(job['missing'])}"
    if job is None and any(q["job_name"] == name for q in doc.get("queued", [])):
        return "the job is queued on the PS (its slot space is held by other jobs: `thc status`)"
    return ""


def fetch_ps_stats(shard_list: list, keys=None, timeout_s: float = 2.0) -> dict | None:
    """A running PS's lifetime counters over its control plane (`stats`), shards added up;
    None when a shard does not answer within `timeout_s`."""
    stats = []
    for shard in shard_list:
        reply = ask_ps(shard, {"type": "stats"}, keys, timeout_s)
        if reply is None or reply.get("type") != "stats":
            return None
        stats.append(reply["stats"])
    return _merge_stats(stats)


def _merge_stats(stats: list) -> dict:
    """Counters of several shards added up."""
    out = {k: sum(s[k] for s in stats) for k in stats[0] if k != "drops"}
    out["drops"] = {k: sum(s["drops"][k] for s in stats) for k in stats[0]["drops"]}
    out["shards"] = len(stats)
    return out


def summary_json(doc: dict) -> str:
    return json.dumps(doc)
