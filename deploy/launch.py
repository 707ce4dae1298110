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
from proto.packing import pack_indices


def gradient(seed: int, round_no: int, worker: int, dim: int) -> np.ndarray:
    """The deterministic test gradient of (seed, round, worker).

    Values are multiples of 2^-10 below 2^7 in magnitude, so float32 sums of up to 32 of
    them are exact in any order: the uncompressed baseline can be checked bit for bit too.
    """
    rng = np.random.default_rng(np.random.SeedSequence([seed, round_no, worker, 0x6AD]))
    x = rng.standard_normal(dim) * rng.lognormal(0, 1)
    return (np.round(np.clip(x, -127, 127) * 1024) / 1024).astype(np.float32)


def worker_loop(shards, worker_id, rounds, dim, seed, policy, faults,
                straggler_delay_ms, straggler_prob, timeout_ms, window, report=None, quiet=True,
                bind_port=0, batched=True):
    """Run `rounds` allreduces of test gradients against the PS shards [(host, data, control)].

    Returns (per-round reports, transport counters).
    """
    from worker.client import Worker
    from worker.transport import Transport
    t = Transport(shards[0][0], shards[0][1], worker_id, control_port=shards[0][2], policy=policy,
                  faults=faults, timeout_ms=timeout_ms, window=window, shards=shards, bind_port=bind_port,
                  batched=batched)
    w = Worker(t, error_feedback=False, seed=seed, straggler_delay_ms=straggler_delay_ms,
               straggler_prob=straggler_prob)
    out = []
    try:
        t.call({"type": "barrier", "name": "start", "worker_id": worker_id})
        for r in range(rounds):
            w.allreduce(gradient(seed, r, worker_id, dim), key="grad")
            rep = w.last
            out.append({"round": r, "lost": rep.lost, "k": rep.contributors, "bitmap": rep.bitmaps,
                        "digest": rep.digests, "norms": rep.norms,
                        "seconds": rep.seconds, "bytes_up": rep.bytes_up, "bytes_down": rep.bytes_down})
            if not quiet:
                print(f"worker {worker_id} round {r + 1}/{rounds} {rep.seconds * 1e3:.1f} ms "
                      f"lost={rep.lost}", file=sys.stderr, flush=True)
        t.call({"type": "barrier", "name": "end", "worker_id": worker_id})
        counters = dict(t.stats.counters)
    finally:
        t.close()
    if report is not None:
        report.put((worker_id, out, counters))
    return out, counters


def _worker_entry(*args, **kwargs):
    try:
        worker_loop(*args, **kwargs)
    except Exception as exc:  # reported to the parent, which fails the launch
        args[-2].put((args[1], f"{type(exc).__name__}: {exc}", None))


def reference_digests(job: JobConfig, seed: int, round_no: int, dim: int, reports: dict) -> list:
    """Per-chunk crc32 of the exact aggregate each worker should have received (None = skip)."""
    n = job.num_workers
    grads = [gradient(seed, round_no, i, dim) for i in range(n)]
    per = job.elems_per_packet
    if job.codec == "none":
        payloads = None
        total = None
    else:
        cfg = thc.ThcConfig(bits=job.bits, granularity=job.granularity, p=job.p,
                            lane_bits=job.lane_bits, block_log2=job.block_log2, seed=job.seed)
        layout = thc.make_layout(dim, cfg.block_log2)
        tab = np.asarray(job.table, dtype=np.int64)
        values = []
        for i in range(n):
            norms = np.asarray(reports[i]["norms"])
            rng = reports[i]["rng"]
            z = thc.encode(grads[i], norms, cfg, layout, round_no, rng.random(layout.padded_dim, dtype=np.float32))
            values.append(tab[z])
        payloads = values
    results = []
    total_len = payloads[0].size if payloads is not None else dim
    for c, off in enumerate(range(0, total_len, per)):
        count = min(per, total_len - off)
        by_bitmap = {}
        for i in range(n):
            bm = reports[i]["bitmap"][c]
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
                by_bitmap[bm] = zlib.crc32(s.astype({8: ">u1", 16: ">u2", 32: ">u4"}[job.lane_bits]).tobytes())
        results.append(by_bitmap)
    return results


def check_blob_rounds(job: JobConfig, seed: int, dim: int, per_worker: dict) -> dict:
    """Decode–sum–re-encode codecs: each round's downlink payload must equal the in-process
    aggregate of the same seeds (full rounds; rounds a worker lost are counted as lost)."""
    from compression import registry
    from compression.codec import Context, combine_preliminary
    n = job.num_workers
    codec = registry.get(job.codec, **job.codec_params)
    rngs = [np.random.default_rng(np.random.SeedSequence([seed, i])) for i in range(n)]
    states = [codec.new_state() for _ in range(n)]
    ps_state = codec.new_ps_state()
    rounds = len(per_worker[0])
    exact, mismatched, lost = 0, 0, 0
    for r in range(rounds):
        grads = [gradient(seed, r, i, dim) for i in range(n)]
        stats = [codec.preliminary(g, s) for g, s in zip(grads, states)]
        shared = combine_preliminary(stats)
        if shared is not None:
            shared = np.asarray(shared, dtype=np.float32).astype(np.float64)
        ctx = Context("grad", dim, r + 1, shared, n)
        ups = [codec.encode(g, s, rng, ctx) for g, s, rng in zip(grads, states, rngs)]
        ps_ctx = Context(str(dim), dim, r + 1, None, n)       # the PS knows a tensor by its size
        want = zlib.crc32(codec.aggregate(ups, ps_state, ps_ctx))
        ok = True
        for i in range(n):
            if per_worker[i][r]["bitmap"][0] == 0:
                lost += 1
            elif per_worker[i][r]["digest"][0] != want:
                mismatched += 1
                ok = False
        exact += ok
    return {"rounds": rounds, "exact_rounds": exact, "mismatched_chunks": mismatched, "lost_chunks": lost}


def check_rounds(job: JobConfig, seed: int, dim: int, per_worker: dict) -> dict:
    """Compare every worker's every chunk with the reference; returns exact/lost/mismatch counts."""
    if job.blob:
        return check_blob_rounds(job, seed, dim, per_worker)
    n = job.num_workers
    rngs = {i: np.random.default_rng(np.random.SeedSequence([seed, i])) for i in range(n)}
    rounds = len(per_worker[0])
    exact_rounds, mismatched, lost = 0, 0, 0
    for r in range(rounds):
        reports = {i: dict(per_worker[i][r], rng=rngs[i]) for i in range(n)}
        ref = reference_digests(job, seed, r, dim, reports)
        ok = True
        for i in range(n):
            for c, digest in enumerate(reports[i]["digest"]):
                bm = reports[i]["bitmap"][c]
                if bm == 0:
                    lost += 1
                    continue
                if ref[c].get(bm) != digest:
                    mismatched += 1
                    ok = False
        exact_rounds += ok
    return {"rounds": rounds, "exact_rounds": exact_rounds, "mismatched_chunks": mismatched,
            "lost_chunks": lost}


def run_launch(*, workers=4, rounds=10, dim=1 << 16, codec="thc", bits=4, granularity=30, p="1/32",
               quorum=1.0, loss=0.0, duplicate=0.0, reorder=0.0, straggler_delay_ms=0.0,
               straggler_rank=None, straggler_prob=1.0, policy="retransmit", seed=0, ps=None,
               engine="c", timeout_ms=50.0, window=64, slots=512, lane_bits=8, verbose=False,
               ps_control_port=None, check=True, shards=1, batched=True) -> dict:
    """Start a PS with `shards` shards (unless `ps` = "host:port[,host:port…]") and N worker
    processes; returns the JSON summary.  batched=False makes the workers use one system call
    per datagram instead of sendmmsg/recvmmsg."""
    from worker.transport import Faults
    job = JobConfig(num_workers=workers, codec=codec, bits=bits, granularity=granularity, p=p,
                    quorum=quorum, seed=seed, slots=slots, lane_bits=lane_bits)
    servers = []
    if ps is None:
        from ps_server.server import PSServer
        for _ in range(shards):
            servers.append(PSServer(job, ("127.0.0.1", 0), control_port=0, engine=engine).start())
        shard_list = [("127.0.0.1", s.data_addr[1], s.control_port) for s in servers]
    else:
        shard_list = []
        for item in ps.split(","):
            host, _, port = item.strip().rpartition(":")
            shard_list.append((host, int(port), ps_control_port if ps_control_port and not shard_list
                               else int(port) + 1))
    single_threaded_children()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    t0 = time.perf_counter()
    for i in range(workers):
        faults = Faults(drop_out=loss, drop_in=loss, duplicate=duplicate, reorder=reorder, seed=seed)
        delay = straggler_delay_ms if (straggler_rank is None or straggler_rank == i) else 0.0
        args = (shard_list, i, rounds, dim, seed, policy, faults, delay,
                straggler_prob, timeout_ms, window, q, not verbose)
        proc = ctx.Process(target=_worker_entry, args=args, kwargs={"batched": batched}, daemon=True)
        proc.start()
        procs.append(proc)
    per_worker, counters, errors = {}, {}, []
    deadline = time.monotonic() + 600
    try:
        while len(per_worker) + len(errors) < workers and time.monotonic() < deadline:
            try:
                wid, out, ctr = q.get(timeout=1.0)
            except Exception:
                if not any(p.is_alive() for p in procs) and q.empty():
                    break
                continue
            if ctr is None:
                errors.append(f"worker {wid}: {out}")
            else:
                per_worker[wid], counters[wid] = out, ctr
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
        elapsed = time.perf_counter() - t0
        ps_stats = _merge_stats([s.stats() for s in servers]) if servers else None
        for s in servers:
            s.stop()
    if errors or len(per_worker) < workers:
        raise RuntimeError("launch failed: " + ("; ".join(errors) or "workers did not report in time"))
    check = check_rounds(job, seed, dim, per_worker) if check else \
        {"rounds": rounds, "exact_rounds": None, "mismatched_chunks": None, "lost_chunks": None}
    total = lambda key: int(sum(c[key] for c in counters.values()))
    return {**check, "workers": workers, "dim": dim, "codec": codec, "quorum": quorum,
            "loss": loss, "policy": policy, "seconds": elapsed,
            "mean_round_ms": 1e3 * float(np.mean([r["seconds"] for w in per_worker.values() for r in w])),
            "retransmissions": total("retransmissions"), "timeouts": total("timeouts"),
            "lost_chunks_reported": total("lost_chunks"), "straggler_notices": total("straggler_notices"),
            "resynced_chunks": total("resynced_chunks"),
            "injected": {k: total(k) for k in ("injected_drops_out", "injected_drops_in",
                                                 "injected_duplicates", "injected_reorders")},
            "drops": ps_stats["drops"] if ps_stats else None, "ps": ps_stats,
            "bytes_up_per_round": per_worker[0][0]["bytes_up"],
            "bytes_down_per_round": per_worker[0][0]["bytes_down"]}


def _merge_stats(stats: list) -> dict:
    """Counters of several shards added up."""
    out = {k: sum(s[k] for s in stats) for k in stats[0] if k != "drops"}
    out["drops"] = {k: sum(s["drops"][k] for s in stats) for k in stats[0]["drops"]}
    out["shards"] = len(stats)
    return out


def summary_json(doc: dict) -> str:
    return json.dumps(doc)
