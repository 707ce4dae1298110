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

from deploy.procs import single_threaded_children

from compression import thc
from proto.job import JobConfig
from proto.packing import LANE_DTYPES


def gradient(seed: int, round_no: int, worker: int, dim: int) -> np.ndarray:
    """The deterministic test gradient of (seed, round, worker).

    Values are multiples of 2^-10 below 2^7 in magnitude, so float32 sums of up to 32 of
    them are exact in any order: the uncompressed baseline can be checked bit for bit too.
    """
    rng = np.random.default_rng(np.random.SeedSequence([seed, round_no, worker, 0x6AD]))
    x = rng.standard_normal(dim) * rng.lognormal(0, 1)
    return (np.round(np.clip(x, -127, 127) * 1024) / 1024).astype(np.float32)


KILLED = 17     # exit status of a worker killed by fault injection (`die_at`)


def worker_loop(shards, worker_id, rounds, dim, seed, policy, faults,
                straggler_delay_ms, straggler_prob, timeout_ms, window, report=None, quiet=True,
                bind_port=0, batched=True, expect=None, propose=None, keys=None, die_at=None,
                rejoin=False):
    """Run `rounds` allreduces of test gradients against the PS shards [(host, data, control)].

    `expect` is the job configuration this worker insists on (a dict of JobConfig fields),
    `propose` the job it proposes to a PS started without one.  A rank that registers into
    a running job in which it held a place before (it crashed and was restarted) rejoins:
    it fast-forwards to the round the other ranks are at.  `die_at` makes the process exit
    abruptly at the start of that round (fault injection); `rejoin` (a restarted rank) only
    joins a job it held a place in, and returns no rounds if that job has ended meanwhile.
    Returns (per-round reports, transport counters, the job as announced by the PS).
    """
    import os

    from worker.client import Worker
    from worker.transport import Transport
    sized = {} if window is None else {"window": window}      # None: the transport's default
    try:
        t = Transport(shards[0][0], shards[0][1], worker_id, control_port=shards[0][2], policy=policy,
                      faults=faults, timeout_ms=timeout_ms, shards=shards, **sized,
                      bind_port=bind_port, batched=batched, expect=expect, propose=propose, keys=keys,
                      rejoin=rejoin)
    except ValueError as exc:
        if not rejoin or "no running job to rejoin" not in str(exc):
            raise
        if report is not None:
            report.put((worker_id, [], {"rejoin_refused": 1}, None))
        return [], {"rejoin_refused": 1}, None
    w = Worker(t, error_feedback=False, seed=seed, straggler_delay_ms=straggler_delay_ms,
               straggler_prob=straggler_prob, per_round_rng=True)
    out = []
    try:
        first = 0
        if t.rejoined:
            status = t.call({"type": "status"})
            others = [v for k, v in status.get("progress", {}).items() if int(k) != worker_id and v >= 0]
            first = max(others, default=0)
            w.skip_rounds(first, dim)
            if not quiet:
                print(f"worker {worker_id} rejoined job {t.sessions[0]['job_number']} at round {first}",
                      file=sys.stderr, flush=True)
        else:
            t.barrier("start")
        for r in range(first, rounds):
            t.progress = r
            if die_at is not None and r == die_at:
                os._exit(KILLED)
            w.allreduce(gradient(seed, r, worker_id, dim), key="grad", round_no=r)
            rep = w.last
            out.append({"round": r, "lost": rep.lost, "k": rep.contributors, "bitmap": rep.bitmaps,
                        "digest": rep.chunk_digests(), "norms": rep.norms,
                        "seconds": rep.seconds, "bytes_up": rep.bytes_up, "bytes_down": rep.bytes_down})
            if not quiet:
                print(f"worker {worker_id} round {r + 1}/{rounds} {rep.seconds * 1e3:.1f} ms "
                      f"lost={rep.lost}", file=sys.stderr, flush=True)
        t.barrier("end")
        counters = dict(t.stats.counters)
        counters["resumes"] = t.resumes
        announced = t.job.to_msg()
    finally:
        t.close()
    if report is not None:
        report.put((worker_id, out, counters, announced))
    return out, counters, announced


def _worker_entry(*args, **kwargs):
    try:
        worker_loop(*args, **kwargs)
    except Exception as exc:  # reported to the parent, which fails the launch
        args[-2].put((args[1], f"{type(exc).__name__}: {exc}", None, None))


def _by_round(per_worker: dict) -> dict:
    """{rank: {round: report}} from {rank: [report, ...]} (a rejoined rank reports fewer)."""
    return {i: {rep["round"]: rep for rep in reps} for i, reps in per_worker.items()}


def reference_digests(job: JobConfig, seed: int, round_no: int, dim: int, reports: dict) -> list:
    """Per-chunk crc32 of the exact aggregate each reported bitmap should have produced.

    Every rank's contribution is recomputed from (seed, rank, round) — test gradients and
    per-round randomness — so ranks that did not report (another host's, or a crashed
    incarnation's) are checked too, with the shared norms of any rank's report."""
    n = job.num_workers
    grads = [gradient(seed, round_no, i, dim) for i in range(n)]
    per = job.elems_per_packet
    if job.codec == "none":
        payloads = None
    else:
        from worker.client import round_rng
        cfg = job.thc_config()
        tab = np.asarray(job.table, dtype=np.int64)
        shared = next(r["norms"] for r in reports.values() if r.get("norms") is not None)
        # a rank encodes with the norms it ended up with (its own, if it lost the NORM result)
        norms = [np.asarray(reports[i]["norms"] if i in reports else shared) for i in range(n)]
        payloads = [tab[thc.WorkerRound(cfg, grads[i]).encode(norms[i], round_rng(seed, i, round_no), round_no)]
                    for i in range(n)]
    lane = LANE_DTYPES[job.lane_bits]
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
                s = np.zeros(count, np.float32)
                for w in members:
                    s = s + grads[w][off:off + count]
                by_bitmap[bm] = zlib.crc32(s.astype(">f4").tobytes())
            else:
                s = sum(payloads[w][off:off + count] for w in members)
                by_bitmap[bm] = zlib.crc32(s.astype(lane).tobytes())
        results.append(by_bitmap)
    return results


def check_blob_rounds(job: JobConfig, seed: int, dim: int, per_worker: dict) -> dict:
    """Decode–sum–re-encode codecs: each round's downlink payload must equal the in-process
    aggregate of the same seeds (full rounds; rounds a worker lost are counted as lost)."""
    from compression import registry
    from compression.codec import Context, combine_preliminary
    from worker.client import round_rng
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


def check_rounds(job: JobConfig, seed: int, dim: int, per_worker: dict) -> dict:
    """Compare every reported chunk with the reference; returns exact/lost/mismatch counts.

    A round is exact only if every chunk every rank reported for it arrived and matched."""
    if job.blob:
        return check_blob_rounds(job, seed, dim, per_worker)
    reports = _by_round(per_worker)
    rounds = max((max(r) + 1 for r in reports.values() if r), default=0)
    exact_rounds, mismatched, lost = 0, 0, 0
    for r in range(rounds):
        have = {i: reps[r] for i, reps in reports.items() if r in reps}
        if not have:
            continue
        ref = reference_digests(job, seed, r, dim, have)
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


def parse_ps(ps: str, control_port=None) -> list:
    """'host:port[,host:port…]' → [(host, data port, control port)]."""
    shard_list = []
    for item in ps.split(","):
        host, _, port = item.strip().rpartition(":")
        shard_list.append((host, int(port), control_port if control_port and not shard_list
                           else int(port) + 1))
    return shard_list


def run_launch(*, workers=4, rounds=10, dim=1 << 16, codec="thc", bits=4, granularity=30, p="1/32",
               quorum=1.0, loss=0.0, duplicate=0.0, reorder=0.0, straggler_delay_ms=0.0,
               straggler_rank=None, straggler_prob=1.0, policy="retransmit", seed=0, ps=None,
               engine="c", timeout_ms=50.0, window=None, slots=512, lane_bits=8, verbose=False,
               ps_control_port=None, check=True, shards=1, batched=True, rank_base=0,
               local_workers=None, expect=None, keys=None, kill=None, restart=False,
               lease_s=None) -> dict:
    """Start a PS with `shards` shards (unless `ps` = "host:port[,host:port…]") and worker
    processes for ranks rank_base … rank_base + local_workers − 1 of an n = `workers` job;
    returns the JSON summary, whose `ok` is False when any chunk was inexact or, under
    `retransmit`, lost, or when a worker failed.

    With `ps`, the workers propose this job to a PS that has none and insist on `expect`
    (default: every field of this job); the check uses the job the PS announced.
    `kill` = (rank, round) makes that rank's process die at the start of that round;
    with `restart` it is started again and rejoins the running job.
    batched=False makes the workers use one system call per datagram instead of
    sendmmsg/recvmmsg."""
    from worker.transport import Faults
    local_workers = workers - rank_base if local_workers is None else local_workers
    if not (0 <= rank_base and 1 <= local_workers and rank_base + local_workers <= workers):
        raise ValueError(f"ranks {rank_base}..{rank_base + local_workers - 1} do not fit a job of "
                         f"{workers} workers")
    job = JobConfig(num_workers=workers, codec=codec, bits=bits, granularity=granularity, p=p,
                    quorum=quorum, seed=seed, slots=slots, lane_bits=lane_bits)
    servers = []
    if ps is None:
        from ps_server.server import PSServer
        extra = {} if lease_s is None else {"lease_s": lease_s}
        for _ in range(shards):
            servers.append(PSServer(job, ("127.0.0.1", 0), control_port=0, engine=engine, keys=keys,
                                    **extra).start())
        shard_list = [("127.0.0.1", s.data_addr[1], s.control_port) for s in servers]
    else:
        shard_list = parse_ps(ps, ps_control_port)
    if expect is None:
        expect = job.to_msg()
    single_threaded_children()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = {}
    t0 = time.perf_counter()
    ranks = range(rank_base, rank_base + local_workers)

    def spawn(i, die_at=None, rejoin=False):
        faults = Faults(drop_out=loss, drop_in=loss, duplicate=duplicate, reorder=reorder, seed=seed)
        delay = straggler_delay_ms if (straggler_rank is None or straggler_rank == i) else 0.0
        args = (shard_list, i, rounds, dim, seed, policy, faults, delay,
                straggler_prob, timeout_ms, window, q, not verbose)
        proc = ctx.Process(target=_worker_entry, args=args, daemon=True,
                           kwargs={"batched": batched, "expect": expect, "propose": job,
                                   "keys": None if keys is None else str(keys), "die_at": die_at,
                                   "rejoin": rejoin})
        proc.start()
        procs[i] = proc

    for i in ranks:
        spawn(i, kill[1] if kill is not None and kill[0] == i else None)
    per_worker, counters, errors, announced = {}, {}, [], None
    restarted = 0
    try:
        while len(per_worker) + len(errors) < local_workers:
            try:
                wid, out, ctr, ann = q.get(timeout=0.5)
            except Exception:
                for i, proc in list(procs.items()):
                    if proc.exitcode == KILLED and i not in per_worker:
                        if restart:
                            restarted += 1
                            spawn(i, rejoin=True)
                        else:
                            errors.append(f"worker {i}: killed at round {kill[1]} (fault injection)")
                            procs.pop(i)
                    elif proc.exitcode not in (None, 0, KILLED) and i not in per_worker and q.empty():
                        errors.append(f"worker {i}: exited with status {proc.exitcode}")
                        procs.pop(i)
                if not any(p.is_alive() for p in procs.values()) and q.empty() \
                        and len(per_worker) + len(errors) < local_workers:
                    missing = [i for i in ranks if i not in per_worker]
                    errors.append(f"workers {missing} ended without a report")
                continue
            if ctr is None:
                errors.append(f"worker {wid}: {out}")
            elif ctr.get("rejoin_refused"):        # restarted after its job had ended
                per_worker[wid], counters[wid] = [], ctr
            else:
                per_worker[wid], counters[wid], announced = out, ctr, ann
    except KeyboardInterrupt:
        errors.append("interrupted")
    finally:
        for proc in procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
        elapsed = time.perf_counter() - t0
        ps_stats = _merge_stats([s.stats() for s in servers]) if servers else None
        for s in servers:
            s.stop()
    if not per_worker:
        raise RuntimeError("launch failed: " + ("; ".join(errors) or "no worker reported"))
    used = JobConfig.from_msg(announced) if announced else job
    result = check_rounds(used, seed, dim, per_worker) if check else \
        {"rounds": rounds, "exact_rounds": None, "mismatched_chunks": None, "lost_chunks": None}
    total = lambda key: int(sum(c.get(key, 0) for c in counters.values()))
    per_worker = {i: out for i, out in per_worker.items() if out}
    problems = list(errors)
    if check and result["mismatched_chunks"]:
        problems.append(f"{result['mismatched_chunks']} chunks differ from the reference")
    if check and policy == "retransmit" and result["lost_chunks"]:
        problems.append(f"{result['lost_chunks']} chunks lost under retransmit")
    first = next(iter(per_worker.values()))
    return {**result, "ok": not problems, "problems": problems, "workers": workers,
            "ranks": sorted(per_worker), "dim": dim, "codec": used.codec, "quorum": used.quorum,
            "loss": loss, "policy": policy, "seconds": elapsed, "restarted_workers": restarted,
            "mean_round_ms": 1e3 * float(np.mean([r["seconds"] for w in per_worker.values() for r in w]
                                                  or [0.0])),
            "retransmissions": total("retransmissions"), "timeouts": total("timeouts"),
            "lost_chunks_reported": total("lost_chunks"), "straggler_notices": total("straggler_notices"),
            "resynced_chunks": total("resynced_chunks"), "ps_restarts_survived": total("resumes"),
            "rejoin_refused": total("rejoin_refused"),
            "injected": {k: total(k) for k in ("injected_drops_out", "injected_drops_in",
                                                 "injected_duplicates", "injected_reorders")},
            "drops": ps_stats["drops"] if ps_stats else None, "ps": ps_stats,
            "bytes_up_per_round": first[0]["bytes_up"] if first else 0,
            "bytes_down_per_round": first[0]["bytes_down"] if first else 0}


def _merge_stats(stats: list) -> dict:
    """Counters of several shards added up."""
    out = {k: sum(s[k] for s in stats) for k in stats[0] if k != "drops"}
    out["drops"] = {k: sum(s["drops"][k] for s in stats) for k in stats[0]["drops"]}
    out["shards"] = len(stats)
    return out


def summary_json(doc: dict) -> str:
    return json.dumps(doc)
