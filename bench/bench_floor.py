"""The end-to-end round at d = 2^24 against its CPU floor on this machine.

Floor: the sum of the workers' codec CPU in a round, divided by the cores they share.  The
codec work is every step of thc.WorkerRound that Worker._thc_round runs besides the transport
(x = ∇ + e, block norms, the uniforms, the fused encode, the error-feedback decode and the
fused lanes decode).  It is measured with the N workers' processes running those steps
together on one codec thread each, meeting where the round's norm and data phases make them
wait, with no network and no PS (`lockstep_floor`): the same work in the same company as in
a round, and nothing the data path does.  Four ranks on two cores spend ~10% more CPU on it
than one worker alone (their memory-bound steps overlap), so the script also prints the
floor "alone" (one worker, nothing else running, best of 3, times N / cores) and the
round against it.  The host's speed drifts by 10-20% within minutes, so both floors are
measured just before and just after the THC rounds and their means are used (all printed).

Then, in the same run, a PS (threads of this process, C engine) and N worker processes on
loopback run real rounds with error feedback, for THC and for float32 (codec none) through
the same path.  Each worker makes its round's test gradient first (untimed), all meet at a
barrier, then the allreduce (in place: the average is written into the gradient, as
torch.distributed's all_reduce does) is timed, and all meet again before the next gradient
is made, so that no rank's gradient making overlaps another's round (the lock-step floor
meets the same way); a round's time is its slowest worker's (the round is
done when every worker has its result); the table gives the mean and the median round (the
median is robust to the host's occasional stalls, the mean is not).  The CPU columns say
where the cores went: worker processes' user+system CPU in their timed rounds and the PS's
from each round's first start to its last end (read as the workers report those edges; the
PS's run-queue column too), against wall × cores (the rest is idle).  "run-queue ms" is the time the workers' threads (summed
over the four processes) and the PS's threads were runnable but not running, per round
(/proc/PID/task/*/schedstat, the kernel's run-queue delay): the wake-up latency a lock-step
round pays at every sync point, and the CPU share other work takes.
The data path's offload (GSO/GRO) and phase engine as the environment says
(THC_UDP_OFFLOAD, THC_PHASE_ENGINE).

`--timeline` also prints where each worker's median round went: every step's span on one
clock (time.monotonic, shared by the processes of a host) and its CPU on the calling thread.
The THC median round is also given against the lock-step floor's own wall time: what the
transport and the PS add to the codec's schedule of waits.  `--repeat N` runs everything N
times and ends with the median of the runs' ratios, every run's listed.  `--fanout multicast`
runs the THC rounds with a result group (the PS sends each result once, by multicast, instead
of once per worker; JobConfig.result_group), `--fanout both` runs the two one after the other
between the same floors (rows thc and thc-mcast).

    .venv/bin/python bench/bench_floor.py [--dim-log2 24] [--workers 4] [--rounds 5] [--timeline] [--thc-only]
        [--repeat N] [--fanout unicast|multicast|both] [--background N]
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import re
import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `bench` is not installed: run from a checkout
from thc_ps.compression import thc  # noqa: E402
from thc_ps.deploy.cli import result_group_arg  # noqa: E402
from thc_ps.deploy.launch import gradient  # noqa: E402
from bench.common import add_background_args, background_from_args  # noqa: E402
from thc_ps.deploy.procs import each_report, single_threaded_children  # noqa: E402
from thc_ps.proto import headers as H  # noqa: E402
from thc_ps.proto.job import DEFAULT_BLOCK_LOG2, JobConfig  # noqa: E402


def _codec_round(cfg, job, grad, memory, lanes, rng, r, meet=lambda: None, out=None, stages=None,
                 segments=None) -> float:
    """One worker's codec work in a round, the steps of thc.WorkerRound that Worker._thc_round
    runs besides the transport, in its order: x = ∇ + e and block norms, (the norm phase),
    uniforms + fused encode, (the data phase: results need every rank's data), the
    error-feedback decode e = x − RHT⁻¹(X) and the fused lanes decode into the gradient (with
    THC_OVERLAP_RESIDUAL the error-feedback decode comes before the data phase, as the worker
    then runs it).  `meet` stands for the two phases; `out`: where the average goes (the
    gradient's own vector unless given: `thc.Pieces` need one).  Returns this thread's CPU
    seconds in the steps (not in `meet`); `stages`, a dict, gets each step's CPU seconds added
    under "rotate and norms", "quantize" and "decode"; `segments`: the tensors' sizes, each
    cut into blocks of its own (`thc.Pieces` give theirs)."""
    from thc_ps.worker.client import OVERLAP_RESIDUAL
    c = time.thread_time()
    rnd = thc.WorkerRound(cfg, grad, memory, "grad", segments=segments)
    norms = rnd.norms().astype(np.float64)
    cpu = [time.thread_time() - c]
    meet()
    c = time.thread_time()
    rnd.encode(norms, rng, r, packed=True)
    e = rnd.residual() if OVERLAP_RESIDUAL else None
    cpu.append(time.thread_time() - c)
    meet()
    c = time.thread_time()
    if e is None:
        e = rnd.residual()
    rnd.decode_lanes(lanes, job.num_workers, out=grad if out is None else out)
    rnd.feedback(e)
    cpu.append(time.thread_time() - c)
    if stages is not None:
        for name, t in zip(("rotate and norms", "quantize", "decode"), cpu):
            stages[name] = stages.get(name, 0.0) + t
    return sum(cpu)


def _codec_state(dim: int, job: JobConfig):
    from thc_ps.compression.codec import ErrorFeedback
    memory = ErrorFeedback()
    memory.update("grad", np.zeros(dim, np.float32))
    lanes = np.full(thc.make_layout(dim, thc.ThcConfig.of_job(job).block_log2).padded_dim, 60, np.uint8)
    return memory, lanes


@contextlib.contextmanager
def _one_codec_thread():
    """THC_CODEC_THREADS=1 inside (and in processes spawned inside): the least CPU, since a
    pool thread per RHT block adds hand-offs and no work."""
    saved = os.environ.get("THC_CODEC_THREADS")
    os.environ["THC_CODEC_THREADS"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["THC_CODEC_THREADS"]
        else:
            os.environ["THC_CODEC_THREADS"] = saved


def codec_cpu_ms(dim: int, job: JobConfig) -> float:
    """The floor alone: one worker's codec CPU per round (_codec_round) in this process on one
    thread with nothing else running, best of 3."""
    memory, lanes = _codec_state(dim, job)
    best = float("inf")
    for r in range(3):
        grad = gradient(0, r, 0, dim)
        best = min(best, _codec_round(thc.ThcConfig.of_job(job), job, grad, memory, lanes, np.random.default_rng(r), r))
    return best * 1e3


def _lockstep_rank(rank, dim, job_msg, rounds, barrier, q) -> None:
    job = JobConfig.from_msg(job_msg)
    memory, lanes = _codec_state(dim, job)
    out = []
    for r in range(rounds + 1):                 # round 0 warms up, as in run_rounds
        grad = gradient(0, r, rank, dim)
        barrier.wait()
        t0 = time.monotonic()
        cpu = _codec_round(thc.ThcConfig.of_job(job), job, grad, memory, lanes, np.random.default_rng(r), r, barrier.wait)
        if r:
            out.append((time.monotonic() - t0, cpu))
        barrier.wait()          # the next gradient is made once every rank is done (as in worker_rounds)
    q.put((rank, out))


def lockstep_floor(dim: int, job: JobConfig, rounds: int) -> dict:
    """The floor in a round's company: `job.num_workers` processes run _codec_round together,
    meeting where the round's two phases make them wait, with no network and no PS, on one
    codec thread each.  Returns the least over rounds of the workers' summed codec CPU per
    round (ms), as the floor alone is a best of 3, their median (the codec CPU of a typical
    round), and the median of those rounds' wall time (what a round would take if the
    transport and the PS cost nothing)."""
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(job.num_workers)
    procs = [ctx.Process(target=_lockstep_rank, args=(r, dim, job.to_msg(), rounds, barrier, q), daemon=True)
             for r in range(job.num_workers)]
    for p in procs:
        p.start()
    try:
        per = np.array([out for _rank, out in sorted(each_report(q, procs, 600, "lock-step rank"))])   # workers × rounds × 2
    finally:
        for p in procs:
            p.join(timeout=30)
    cpu = per[:, :, 1].sum(axis=0)
    return {"cpu_ms": 1e3 * float(cpu.min()), "cpu_median_ms": 1e3 * float(np.median(cpu)),
            "wall_ms": 1e3 * float(np.median(per[:, :, 0].max(axis=0)))}


def _cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _schedstat() -> list:
    """(tid, seconds on a CPU, seconds runnable but not running) of each of this process's
    threads: the first two fields of /proc/self/task/*/schedstat (the second is the run-queue
    delay, the wait between a wake-up and the CPU)."""
    out = []
    for entry in os.scandir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry.name}/schedstat") as f:
                run, wait = f.read().split()[:2]
            out.append((int(entry.name), int(run) / 1e9, int(wait) / 1e9))
        except (OSError, ValueError):     # a thread that ended meanwhile, or no schedstat
            pass
    return out


def _runqueue_s() -> float:
    """Seconds this process's threads have spent runnable but not running."""
    return sum(wait for _tid, _run, wait in _schedstat())


def _thread_kind(name: str) -> str:
    """A thread's kind from its name: "thc-block_1" → "thc-block", "Thread-3 (_data_loop)" →
    "_data_loop", "ZMQbg/IO/0" → "ZMQbg/IO"."""
    m = re.fullmatch(r"Thread-\d+ \((.+)\)", name)
    return m.group(1) if m else re.sub(r"[_/]\d+$", "", name)


def _thread_cpu_s() -> dict:
    """CPU seconds of this process's threads so far by kind (Python threads by their name,
    others by their comm)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict = {}
    for tid, run, _wait in _schedstat():
        name = names.get(tid)
        if name is None:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue
        kind = _thread_kind(name)
        out[kind] = out.get(kind, 0.0) + run
    return out


def _cpu_delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def print_thread_cpu(label: str, by_kind: dict, rounds: int) -> None:
    """CPU ms per round by thread kind, largest first, to 10 µs (a small round's helper threads
    take tens of µs on a fast host)."""
    print(f"  {label}: " + ", ".join(f"{k} {1e3 * v / rounds:.2f}" for k, v in
                                     sorted(by_kind.items(), key=lambda kv: -kv[1]) if 1e3 * v / rounds >= 0.005))


def _print_profile(prof, rounds: int, top: int) -> None:
    """A cProfile of rank 0's allreduces: top functions by own CPU time, ms per round."""
    import io
    import pstats
    st = pstats.Stats(prof, stream=io.StringIO())
    total = sum(v[2] for v in st.stats.values())
    print(f"rank 0: {1e3 * total / rounds:.1f} ms CPU per round under the profiler; top functions "
          f"by own CPU time (ms per round):")
    for (file, line, name), (_cc, nc, tt, ct, _callers) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = f"{Path(file).name}:{line}" if line else "built-in"
        print(f"  {1e3 * tt / rounds:8.1f}  {1e3 * ct / rounds:8.1f} cum  {nc // rounds:6d} calls  {name} ({where})")


def _record_steps(spans: list) -> None:
    """Wrap the steps of a THC round (this process only) so each call appends (step, start,
    end, CPU of the calling thread) to `spans`.  With THC_CODEC_THREADS > 1 the other RHT
    blocks of an encode or decode run on pool threads, outside that CPU."""
    from thc_ps.worker.transport import Transport
    steps = ((thc.WorkerRound, "__init__", lambda a: "x=g+e"), (thc.WorkerRound, "norms", lambda a: "norms"),
             (Transport, "run_phase", lambda a: "norm phase" if a[1] == H.NORM else "data phase"),
             (thc.WorkerRound, "encode", lambda a: "encode"), (thc.WorkerRound, "residual", lambda a: "residual"),
             (thc.WorkerRound, "decode_lanes", lambda a: "decode"))

    def timed(fn, label):
        def call(*a, **k):
            t0, c0 = time.monotonic(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spans.append((label(a), t0, time.monotonic(), time.thread_time() - c0))
        return call
    for cls, name, label in steps:
        setattr(cls, name, timed(getattr(cls, name), label))


def print_timeline(rounds: dict, spans: dict) -> None:
    """The median round (by its slowest worker): each worker's steps as start-end ms from the
    round's first start, with the calling thread's CPU ms; then CPU per step over all rounds."""
    walls = [max(r[1] for r in by_rank) - min(r[0] for r in by_rank) for by_rank in zip(*rounds.values())]
    i = int(np.argsort(walls)[len(walls) // 2])
    t0 = min(rounds[rank][i][0] for rank in rounds)
    print(f"timeline of round {i + 1} (the median, {1e3 * walls[i]:.0f} ms): step [start-end ms] CPU ms")
    for rank in sorted(rounds):
        a, b = rounds[rank][i][:2]
        inside = [s for s in spans[rank] if a <= s[1] < b]
        print(f"  rank {rank} {1e3 * (a - t0):4.0f}-{1e3 * (b - t0):3.0f}: " + "  ".join(
            f"{name} [{1e3 * (s - t0):.0f}-{1e3 * (e - t0):.0f}] {1e3 * c:.0f}" for name, s, e, c in
            sorted(inside, key=lambda x: x[1])))
    cpu: dict = {}
    for rank in spans:
        for name, _s, _e, c in spans[rank]:
            cpu[name] = cpu.get(name, 0.0) + c
    n = len(walls) * len(spans)
    print("  CPU per worker and round, calling thread: " + ", ".join(
        f"{name} {1e3 * c / n:.1f} ms" for name, c in cpu.items()))


def worker_rounds(addr, rank, job_msg, dim, rounds, q, profile_top=0, timeline=False, edges=None,
                  reuse_gradient=False) -> None:
    """One rank: per round, make the gradient, meet the others, time the allreduce, meet them
    again (a rank's next gradient, ~0.3 s of CPU at 2^24, would otherwise be made while
    others are still in the timed round, and slow them on a host with fewer cores).  With
    `profile_top`, rank 0's allreduces run under cProfile (CPU time as its clock); with
    `timeline`, the steps of every round are recorded (see _record_steps); with `edges` (a
    queue), (round, 0) is put there as a timed round starts and (round, 1) as it ends;
    `reuse_gradient`: the gradient is made once and each round's result is the next one's
    input (round_cpu.py: no gradient making between the rounds).  Reports (rank, per-round
    figures, timeline spans, per-round (start, end, when its gradient making began), CPU by
    thread kind)."""
    import cProfile

    from thc_ps.worker.client import Worker
    from thc_ps.worker.transport import Transport
    host, data_port, control_port = addr
    t = Transport(host, data_port, rank, control_port=control_port, expect=job_msg, timeout_ms=2000)
    w = Worker(t, error_feedback=True, seed=0, per_round_rng=True)
    prof = cProfile.Profile(timer=time.process_time) if profile_top and rank == 0 else None
    out, spans, marks, threads = [], [], [], {}
    if timeline:
        _record_steps(spans)
    try:
        for r in range(rounds + 1):                     # round 0 warms up (buffers, pages)
            if not reuse_gradient or r == 0:
                made = time.monotonic()                 # when this round's gradient making began
                g = gradient(0, r, rank, dim)
            t.barrier(f"r{r}")
            k0, q0 = _thread_cpu_s(), _runqueue_s()          # /proc reads, outside the timed span
            c0, t0 = _cpu_s(), time.monotonic()             # one clock for every process of the host
            if edges is not None and r:
                edges.put((r, 0))
            if prof is not None and r:
                prof.enable()
            w.allreduce(g, key="grad", round_no=r, out=g)      # in place, as dist.all_reduce
            if prof is not None:
                prof.disable()
            t1, c1, q1 = time.monotonic(), _cpu_s(), _runqueue_s()
            if r:
                if edges is not None:
                    edges.put((r, 1))
                for k, v in _cpu_delta(_thread_cpu_s(), k0).items():
                    threads[k] = threads.get(k, 0.0) + v
                marks.append((t0, t1, made))
                out.append((t1 - t0, c1 - c0, w.last.bytes_up, w.last.bytes_down,
                            t.stats.counters["retransmissions"], q1 - q0))
            if not reuse_gradient:
                t.barrier(f"e{r}")      # no rank makes its next gradient while another is in the round
        t.barrier("end")
    finally:
        t.close()
    if prof is not None:
        _print_profile(prof, rounds, profile_top)
    q.put((rank, out, [s for s in spans if s[1] >= marks[0][0]] if marks else [], marks, threads))


def _edge_reads(edges, seen: list) -> None:
    """Append (round, 0 start / 1 end, (this process's CPU, its run-queue delay)) for every
    edge a worker reports, until None: the PS (this process) is read as the rounds start and
    end.  The reads themselves (eight a round with four workers) cost ~1 ms of this process's
    CPU per round, which the PS's column includes."""
    for item in iter(edges.get, None):
        seen.append((*item, (_cpu_s(), _runqueue_s())))


def _in_rounds(seen: list, rounds: int) -> np.ndarray:
    """Each reading's mean growth from a round's first start to its last end, over the rounds
    with both edges (nan where none has)."""
    per = []
    for r in range(1, rounds + 1):
        starts = [v for rr, kind, v in seen if rr == r and kind == 0]
        ends = [v for rr, kind, v in seen if rr == r and kind == 1]
        if starts and ends:      # readings only grow: the first start is the least, the last end the most
            per.append(np.max(ends, axis=0) - np.min(starts, axis=0))
    return np.mean(per, axis=0) if per else np.array([np.nan, np.nan])


def run_rounds(codec: str, dim: int, workers: int, rounds: int, quiet: bool = False,
               profile_top: int = 0, timeline: bool = False, block_log2: int = DEFAULT_BLOCK_LOG2,
               reuse_gradient: bool = False, result_group: str = "") -> dict:
    """PS + `workers` processes, `rounds` timed rounds; per-round means (`profile_top`: print
    rank 0's top functions, see bench/profile_cluster.py).  The PS's CPU is counted from each
    round's first start to its last end, read when the workers report those edges, and so is
    its run-queue delay.  `result_group`: the job's (JobConfig.result_group), "" for the
    per-worker fan-out.  Also returned: the timed rounds' `window` (time.monotonic of the
    first start and the last end), the PS's pid (this process) and the workers'."""
    from thc_ps.ps_server.server import PSServer
    job = JobConfig(num_workers=workers, codec=codec, block_log2=block_log2, result_group=result_group)
    ps = PSServer(job, ("127.0.0.1", 0), control_port=0, engine="c").start()
    single_threaded_children()
    ctx = mp.get_context("spawn")
    q, edges, seen = ctx.Queue(), ctx.Queue(), []
    addr = ("127.0.0.1", ps.data_addr[1], ps.control_port)
    procs = [ctx.Process(target=worker_rounds, args=(addr, r, job.to_msg(), dim, rounds, q, profile_top, timeline,
                                                     edges, reuse_gradient), daemon=True)
             for r in range(workers)]
    reader = threading.Thread(target=_edge_reads, args=(edges, seen), daemon=True)
    reader.start()
    try:
        for p in procs:
            p.start()
        k0 = _thread_cpu_s()
        reports = list(each_report(q, procs, 600))                      # (rank, out, spans, marks, threads)
        res = {rank: out for rank, out, *_ in reports}
        ps_threads = _cpu_delta(_thread_cpu_s(), k0)
    finally:
        for p in procs:
            p.join(timeout=30)
        edges.put(None)
        reader.join(timeout=10)
        ps.stop()
    per = np.array([res[r] for r in range(workers)])          # workers × rounds × 6
    if not quiet:
        where = f" (result group {result_group})" if result_group else ""
        print(f"{codec}{where}: round ms per worker (rows) and round (columns) "
              f"{np.round(per[:, :, 0] * 1e3).astype(int).tolist()}, retransmissions {int(per[:, -1, 4].sum())}")
    if timeline:
        print_timeline({rank: marks for rank, _out, _spans, marks, _t in reports},
                        {rank: spans for rank, _out, spans, _marks, _t in reports})
        summed: dict = {}
        for *_, threads in reports:
            for k, v in threads.items():
                summed[k] = summed.get(k, 0.0) + v / workers
        print("CPU ms per round by thread (schedstat):")
        print_thread_cpu("a worker (mean of the ranks; the timed allreduces)", summed, rounds)
        print_thread_cpu(f"the PS process (every round, the warm-up included: / {rounds + 1})", ps_threads, rounds + 1)
    wall = per[:, :, 0].max(axis=0)                            # a round ends with its slowest worker
    ps_cpu, ps_runq = _in_rounds(seen, rounds)
    return {"round_ms": 1e3 * wall.mean(), "median_ms": 1e3 * float(np.median(wall)),
            "worker_cpu_ms": 1e3 * per[:, :, 1].sum(axis=0).mean(),
            "ps_cpu_ms": 1e3 * ps_cpu,
            "up_mb": per[0, :, 2].mean() / 1e6,
            "worker_runq_ms": 1e3 * per[:, :, 5].sum(axis=0).mean(), "ps_runq_ms": 1e3 * ps_runq,
            "down_mb": per[0, :, 3].mean() / 1e6,
            "window": (min(m[0][0] for *_, m, _t in reports), max(m[-1][1] for *_, m, _t in reports)),
            "marks": {rank: marks for rank, _o, _s, marks, _t in reports},
            "ps_pid": os.getpid(), "worker_pids": [p.pid for p in procs]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim-log2", type=int, default=24)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--block-log2", type=int, default=DEFAULT_BLOCK_LOG2,
                    help="log2 of the RHT block (the job's block_log2; the authors' cap is 23)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeline", action="store_true", help="print the median THC round's steps per worker")
    ap.add_argument("--thc-only", action="store_true", help="skip the float32 rounds")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the whole measurement (floors and rounds) this many times and summarize the THC "
                         "median round against its floor over the runs (the host's speed drifts between runs)")
    ap.add_argument("--fanout", choices=("unicast", "multicast", "both"), default="unicast",
                    help="how the PS sends results back: once per worker, once to the job's result group "
                         "(JobConfig.result_group, --group), or both in turn in one run (rows thc, thc-mcast)")
    ap.add_argument("--group", default="239.255.77.1:47077", type=result_group_arg, metavar="ADDR:PORT",
                    help="the result group of --fanout multicast/both")
    add_background_args(ap)
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    with background_from_args(args):
        if args.background or args.background_memory or args.background_compile:
            print(f"background: {args.background} busy loop(s) and {args.background_memory} memory-bound "
                  f"process(es) and {args.background_compile} compiler loop(s) at nice 19, the whole run", flush=True)
        results = []
        for i in range(args.repeat):
            if args.repeat > 1:
                print(f"run {i + 1} of {args.repeat}", flush=True)
            results.append(_measure(args))
    if args.repeat > 1:
        for name, _ in _fanouts(args):
            print(summarize_runs([r[name] for r in results], name))


def summarize_runs(results: list, name: str = "thc") -> str:
    """One line over several runs: the median of the runs' "median round / floor" ratios (and
    of the round against the lock-step floor's own wall time), with every run's, so one lucky
    or unlucky run is not read as the result."""
    def listed(values, fmt):
        return f"{np.median(values):{fmt}} (runs: {', '.join(f'{x:{fmt}}' for x in values)})"
    return (f"{name} over {len(results)} runs: median round / floor = "
            f"{listed([r['median_ms'] / r['floor_ms'] for r in results], '.2f')}; median round / lock-step "
            f"wall = {listed([r['median_ms'] / r['lockstep_wall_ms'] for r in results], '.2f')}; median round, "
            f"ms = {listed([r['median_ms'] for r in results], '.1f')}")


def _measure(args) -> dict:
    """One measurement: the floors, the rounds, the table.  Returns the THC row's median round,
    the floor and the lock-step floor's own wall time (ms)."""
    dim, cores = 1 << args.dim_log2, os.cpu_count()
    job = JobConfig(num_workers=args.workers, block_log2=args.block_log2)
    print(f"d = 2^{args.dim_log2}, {args.workers} workers, {cores} cores; offload "
          f"{os.environ.get('THC_UDP_OFFLOAD', '1')}, phase engine {os.environ.get('THC_PHASE_ENGINE', 'c')}, "
          f"codec threads {os.environ.get('THC_CODEC_THREADS', 'one per core')}", flush=True)
    with _one_codec_thread():
        alone = [codec_cpu_ms(dim, job)]
        lock = [lockstep_floor(dim, job, args.rounds)]
    runs = {}
    for name, group in _fanouts(args):
        runs[name] = run_rounds("thc", dim, args.workers, args.rounds, timeline=args.timeline,
                                block_log2=args.block_log2, result_group=group)
    with _one_codec_thread():
        alone.append(codec_cpu_ms(dim, job))
        lock.append(lockstep_floor(dim, job, args.rounds))
    if not args.thc_only:
        runs["none"] = run_rounds("none", dim, args.workers, args.rounds)
    floor = np.mean([f["cpu_ms"] for f in lock]) / cores
    floor_alone = np.mean(alone) * args.workers / cores
    print(f"floor: the {args.workers} workers' codec CPU per round, run together in lock-step without the "
          f"network (least of {args.rounds} rounds): {lock[0]['cpu_ms']:.1f} ms before the THC rounds, "
          f"{lock[1]['cpu_ms']:.1f} after -> / {cores} cores = {floor:.1f} ms (the median round's: "
          f"{lock[0]['cpu_median_ms']:.1f} and {lock[1]['cpu_median_ms']:.1f} ms); those rounds took "
          f"{lock[0]['wall_ms']:.1f} and {lock[1]['wall_ms']:.1f} ms of wall time (median)")
    print(f"floor alone: one worker's codec CPU per round with nothing else running (best of 3): "
          f"{alone[0]:.1f} ms before, {alone[1]:.1f} after -> {args.workers} x {np.mean(alone):.1f} / {cores} "
          f"= {floor_alone:.1f} ms")
    print(f"{'codec':>9}{'round ms':>10}{'x floor':>9}{'x alone':>9}{'median ms':>11}{'x floor':>9}{'x alone':>9}"
          f"{'workers CPU ms':>16}{'PS CPU ms':>11}{'idle ms':>9}{'up MB':>8}{'down MB':>9}"
          f"{'run-queue ms':>14}{'PS run-queue':>14}")
    for codec, d in runs.items():
        idle = d["round_ms"] * cores - d["worker_cpu_ms"] - d["ps_cpu_ms"]
        print(f"{codec:>9}{d['round_ms']:10.1f}{d['round_ms'] / floor:9.2f}{d['round_ms'] / floor_alone:9.2f}"
              f"{d['median_ms']:11.1f}{d['median_ms'] / floor:9.2f}{d['median_ms'] / floor_alone:9.2f}"
              f"{d['worker_cpu_ms']:16.1f}{d['ps_cpu_ms']:11.1f}{idle:9.1f}{d['up_mb']:8.2f}{d['down_mb']:9.2f}"
              f"{d['worker_runq_ms']:14.1f}{d['ps_runq_ms']:14.1f}",
              flush=True)
    lock_wall = float(np.mean([f["wall_ms"] for f in lock]))
    thc = [name for name, _ in _fanouts(args)]
    for name in thc:
        print(f"{name}: median round / the lock-step floor's own wall time ({lock_wall:.1f} ms, the same codec "
              f"steps meeting at the same points with a network and a PS that cost nothing) = "
              f"{runs[name]['median_ms'] / lock_wall:.2f}", flush=True)
    return {name: {"median_ms": runs[name]["median_ms"], "floor_ms": float(floor), "lockstep_wall_ms": lock_wall}
            for name in thc}


def _fanouts(args) -> list:
    """The THC rows to run, (name, result group): the PS's per-worker fan-out ("thc"), the
    job's result group ("thc-mcast"), or both, one after the other in that order."""
    rows = {"unicast": [("thc", "")], "multicast": [("thc-mcast", args.group)],
            "both": [("thc", ""), ("thc-mcast", args.group)]}
    return rows[args.fanout]


if __name__ == "__main__":
    main()
