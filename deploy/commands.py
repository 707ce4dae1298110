"""Bodies of the `thc` subcommands; argument parsing stays in cli.py."""
from __future__ import annotations

import sys
from pathlib import Path


def nmse_codecs():
    from thc_ps.compression.nmse import all_codecs
    return all_codecs()


def job_codecs():
    from thc_ps.compression import registry
    return registry.names()


def cmd_table(args) -> dict:
    from thc_ps.proto.tables import solve_table
    return solve_table(args.bits, args.granularity, args.p).to_json()


def cmd_nmse(args) -> dict:
    from thc_ps.compression import nmse
    params = {}
    if args.codec in ("thc", "uhc", "casq"):
        params["bits"] = args.bits
    if args.codec == "thc":
        params.update(granularity=args.granularity, p=args.p, block_log2=args.block_log2, tail_log2=args.tail_log2)
    if args.codec == "topk":
        params["topk"] = args.topk
    return nmse.run(args.codec, workers=args.workers, dim=args.dim, dist=args.dist,
                    copies=args.copies, trials=args.trials, seed=args.seed, **params)


def cmd_demo_nmse(args) -> None:
    from thc_ps.compression import nmse
    print(f"NMSE of one round, lognormal gradient copied to {args.workers} workers, d={args.dim}",
          flush=True)
    print(f"{'codec':<10}{'NMSE':>12}{'bits up':>10}{'bits down':>11}")
    for codec in nmse.CODECS:
        r = nmse.run(codec, workers=args.workers, dim=args.dim, trials=args.trials)
        print(f"{codec:<10}{r['nmse']:>12.4g}{r['bits_up']:>10.2f}{r['bits_down']:>11.2f}", flush=True)
    sys.stdout.flush()


def _job(args, **more):
    """The job of the command line's job options (and `more` JobConfig fields), validated.
    A result group of "auto" (launch, train) is chosen here: thc_ps.deploy.launch.one_host_group."""
    from thc_ps.deploy.launch import one_host_group
    from thc_ps.proto.job import JobConfig
    return JobConfig(num_workers=args.workers, codec=args.codec, bits=args.bits,
                     granularity=args.granularity, p=args.p, lane_bits=args.lane_bits,
                     quorum=args.quorum, seed=args.seed, block_log2=args.block_log2,
                     tail_log2=args.tail_log2, rotation=args.rotation,
                     result_group=one_host_group(args.result_group, own_ps=not getattr(args, "ps", None)),
                     **more)


def cmd_keys(args) -> None:
    from thc_ps.proto.keys import create_keys
    d = create_keys(args.dir)
    print(f"wrote CURVE keys to {d}: give the PS host the directory (thc ps --keys {d}) and each "
          f"worker host {d}/client.key_secret and {d}/server.key (thc worker --keys DIR)")


def cmd_ps(args) -> None:
    """The PS service: shards bound and served until SIGTERM/Ctrl-C (at once) or, after a
    drain (SIGUSR1, or `thc status --drain`), until the running jobs have ended."""
    import json
    import signal
    import threading
    import time

    from thc_ps.ps_server.server import PSServer
    job = _job(args, slots=args.slots) if args.workers else None   # validated here, before binding
    host, port = args.bind
    if args.control_port and args.shards > 1 and args.control_port + 2 * (args.shards - 1) > 65535:
        raise ValueError("--control-port leaves no room for the shards' control ports")
    if port + 2 * (args.shards - 1) > 65535:
        raise ValueError(f"port {port} leaves no room for {args.shards} shards (data ports PORT, PORT+2, ...)")
    servers = []
    metrics = _bind_metrics(servers, args.metrics) if args.metrics else None    # refused before any PS binds
    drain = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, lambda *_: drain.set())
    say = lambda m: print(m, flush=True)
    try:
        for s in range(args.shards):
            cport = args.control_port + 2 * s if args.control_port else None
            servers.append(_bind_ps(PSServer, job, host, port + 2 * s, cport, say, args))
            what = (f"n={job.num_workers}, codec={job.codec}, b={job.bits}, g={job.granularity}, "
                    f"lanes={job.lane_bits} bits, quorum={job.quorum}") if job else \
                "any job (each job's first worker proposes it)"
            say(f"PS shard {s}: data udp://{host}:{port + 2 * s}, control tcp://{host}:"
                f"{servers[-1].control_port}{' (CURVE)' if args.keys else ''}, {what}; "
                f"{args.slot_space} slots shared by the jobs running at once")
        if metrics is not None:
            metrics.start()
            say(f"metrics: http://{metrics.address[0]}:{metrics.address[1]}/metrics, health /healthz")
        last, printed = time.monotonic(), [None] * len(servers)
        while not all(s.wait(0.5) for s in servers):
            if drain.is_set():
                drain.clear()
                for s in servers:
                    s.drain("SIGUSR1")
            if args.stats_every and time.monotonic() - last >= args.stats_every:
                last = time.monotonic()
                for i, s in enumerate(servers):
                    line = json.dumps(s.stats())
                    if line != printed[i]:            # an idle PS says nothing new
                        printed[i] = line
                        say(f"stats shard {i}: {line}")
    except KeyboardInterrupt:
        pass
    finally:
        if metrics is not None:
            metrics.stop()
        for i, s in enumerate(servers):
            say(f"final stats shard {i}: {json.dumps(s.stats())}")
            s.stop()


def _bind_metrics(servers: list, addr: tuple):
    """The metrics endpoint (ps_server/metrics.py) bound on addr, serving `servers` once they
    start; an address in use or that does not resolve is refused (exit 2) before any PS binds."""
    from thc_ps.ps_server.metrics import MetricsServer
    try:
        return MetricsServer(servers, *addr)
    except OSError as exc:
        raise ValueError(f"--metrics {addr[0]}:{addr[1]}: cannot serve metrics there: "
                         f"{exc.strerror or exc}") from None


def _bind_ps(PSServer, job, host: str, port: int, cport, say, args):
    """One PS shard, started; a bind failure names the plane and the address."""
    import zmq
    try:
        return PSServer(job, (host, port), control_port=cport, engine=args.engine, log=say, keys=args.keys,
                        lease_s=args.lease_s, rejoin_grace_s=args.rejoin_grace_s,
                        slot_space=args.slot_space).start()
    except zmq.ZMQError as exc:
        raise OSError(f"cannot bind the control plane tcp://{host}:{cport or port + 1}: "
                      f"{zmq.strerror(exc.errno)}") from None
    except OSError as exc:
        raise OSError(f"cannot bind the data plane udp://{host}:{port}: {exc.strerror or exc}") from None


def _stated_job(args) -> dict:
    """The job options given on a worker's command line: what it insists on."""
    stated = {"num_workers": args.workers, "codec": args.codec, "bits": args.bits,
              "granularity": args.granularity, "p": None if args.p is None else str(args.p),
              "lane_bits": args.lane_bits, "quorum": args.quorum, "block_log2": args.block_log2,
              "tail_log2": args.tail_log2,
              "rotation": args.rotation, "result_group": args.result_group}
    return {k: v for k, v in stated.items() if v is not None}


def cmd_worker(args) -> dict:
    import os

    from thc_ps.deploy.launch import worker_loop
    from thc_ps.proto.job import JobConfig
    from thc_ps.worker.transport import Faults
    if args.rank is not None:
        rank = args.rank
    elif "RANK" in os.environ:
        from thc_ps.worker.launch_env import from_env
        rank = from_env().rank          # started by torchrun
    else:
        rank = 0
    expect = _stated_job(args)
    propose = JobConfig(seed=args.seed, **expect) if "num_workers" in expect else None
    shards = [(h, p, args.control_port or p + 1, args.control_host or h) for h, p in args.ps]
    out, counters, announced = worker_loop(
        shards, rank, args.rounds, args.dim, args.seed, args.loss_policy,
        Faults(drop_out=args.loss, drop_in=args.loss, seed=args.seed), args.straggler_delay_ms, 1.0,
        args.timeout_ms, 64, None, False, bind_port=args.bind_port, expect=expect, propose=propose,
        keys=args.keys, job_name=args.job, fixed_timeout=args.fixed_timeout, ps_wait_s=args.ps_wait_s,
        error_feedback=args.error_feedback)
    lost = sum(r["lost"] for r in out)
    if args.report:
        import json
        with open(args.report, "w") as f:
            json.dump({"rank": rank, "rounds": out, "transport": counters, "job": announced}, f)
    problems = [f"{lost} chunks lost under retransmit"] if lost and args.loss_policy == "retransmit" else []
    if counters.get("ended_while_away"):
        problems.append(f"rank {rank}'s job ended while it was away (its lease had expired); it ran "
                        f"{len(out)} of {args.rounds} rounds")
    return {"ok": not problems, "problems": problems, "rank": rank, "rounds": len(out), "lost_chunks": lost,
            "mean_round_ms": 1e3 * sum(r["seconds"] for r in out) / max(len(out), 1),
            "transport": counters}


def cmd_status(args):
    """The jobs a running PS serves: running (workers, region, rounds, counters) and queued.
    With --drain, first tells every shard to drain (`drain`, authenticated as any request)."""
    import json

    from thc_ps.deploy.launch import ask_ps, fetch_status
    for host, port in args.ps if args.drain else ():
        endpoint = f"tcp://{host}:{args.control_port or port + 1}"
        reply = ask_ps((host, port, args.control_port or port + 1), {"type": "drain"}, args.keys, args.timeout_s)
        if reply is None:
            raise RuntimeError(f"no reply to drain from the PS control plane at {endpoint} within "
                               f"{args.timeout_s:g} s (is a PS running there, its control port reachable?)")
        if reply.get("type") != "ok":
            raise RuntimeError(f"the PS at {endpoint} refused drain: {reply.get('message')}")
    docs = []
    for host, port in args.ps:
        doc = fetch_status((host, port, args.control_port or port + 1), args.keys, args.timeout_s)
        if doc is None:
            if args.drain:          # drained already: nothing ran, so it stopped at once
                docs.append({"draining": True, "stopped": True})
                continue
            why = (f"no status reply from the PS control plane at tcp://{host}:{args.control_port or port + 1} "
                   f"within {args.timeout_s:g} s (is a PS running there, its control port reachable?)")
            if args.json:
                return {"ok": False, "problems": [why]}
            raise RuntimeError(why)
        docs.append(doc)
    if args.json:
        print(json.dumps(docs if len(docs) > 1 else docs[0]))
        return None
    for (host, port), doc in zip(args.ps, docs):
        print(format_status(f"{host}:{port}", doc))
    return None


def _job_round(progress: dict) -> str:
    """A job's round from its live ranks' `progress` (the step each reported; -1: none yet)."""
    steps = sorted(v for v in progress.values() if v >= 0)
    if not steps:
        return "not started"
    return f"round {steps[0]}" if steps[0] == steps[-1] else f"rounds {steps[0]}..{steps[-1]}"


def format_status(where: str, doc: dict) -> str:
    """A status reply as the lines `thc status` prints: a job by its number (the one its
    workers and the PS's log name), its round (the step its ranks report: a training step or
    a `thc launch` round; the counters' rounds_completed counts slot rounds), and its
    counters."""
    if doc.get("stopped"):
        return f"PS {where}: drained and stopped (no job was running)"
    jobs, queued = doc.get("jobs", []), doc.get("queued", [])
    lines = [f"PS {where}: {len(jobs)} job{'s' if len(jobs) != 1 else ''} running, {len(queued)} queued, "
             f"{doc['slots_free']} of {doc['slot_space']} slots free"
             + ("; DRAINING: it admits no new job and stops once the running ones end" if doc.get("draining") else "")]
    for j in jobs:
        r, st = j["region"], j["stats"]
        missing = ", ".join(str(m["rank"]) for m in j["missing"])
        lines.append(f"  job {j['job_number']} {j['job_name']!r}: {j['codec']}, "
                     f"live {len(j['live'])}/{j['num_workers']}"
                     + (f" (missing {missing})" if missing else "")
                     + f", {_job_round(j.get('progress', {}))}, slots {r['base']}..{r['base'] + r['data'] + r['norm'] - 1} "
                       f"({r['data']} data + {r['norm']} norm), "
                       f"packets in {st.get('packets_in', 0)}, drops {sum(st.get('drops', {}).values())}, "
                       f"age {j['age_s']:.0f} s" + (f"; STALLED: {j['stalled']}" if j.get("stalled") else ""))
    for q in queued:
        lines.append(f"  queued {q['job_name']!r}: {q['slots']} slots asked, ranks {q['ranks']}, "
                     f"waiting {q['waiting_s']:.0f} s")
    return "\n".join(lines)


def cmd_launch(args):
    from thc_ps.deploy.launch import run_launch
    from thc_ps.proto.job import AUTO_GROUP, LANE_AUTO
    job = _job(args, slots=args.slots)   # refuse a bad configuration before anything starts
    if args.straggler_rank is not None and not 0 <= args.straggler_rank < args.workers:
        raise ValueError(f"--straggler-rank must be in 0..{args.workers - 1}")
    local = args.local_workers or (args.workers if args.rank_base is None and args.node_rank is None
                                   else None)
    if local is None:
        raise ValueError("--rank-base/--node-rank need --local-workers (how many ranks this host runs)")
    base = args.rank_base if args.rank_base is not None else (args.node_rank or 0) * local
    if base + local > args.workers:
        raise ValueError(f"ranks {base}..{base + local - 1} do not fit a job of {args.workers} workers")
    if local < args.workers and args.ps is None:
        raise ValueError("running a share of the ranks needs --ps (the PS the other hosts use too)")
    if args.kill_rank is not None and not base <= args.kill_rank < base + local:
        raise ValueError(f"--kill-rank {args.kill_rank} is not one of this host's ranks {base}..{base + local - 1}")
    if args.kill_rank is None and (args.kill_at_round is not None or args.restart_killed):
        raise ValueError(f"{'--kill-at-round' if args.kill_at_round is not None else '--restart-killed'} "
                         f"needs --kill-rank (which rank dies)")
    kill_at = args.kill_at_round or 0
    if kill_at >= args.rounds:
        raise ValueError(f"--kill-at-round must be below --rounds ({args.rounds})")
    if args.shards > 1 and args.ps is not None:
        raise ValueError("--shards starts shards here; with --ps list the running shards' addresses instead")
    expect = None
    if args.ps is not None:
        # insist on the options given explicitly; the PS announces the rest
        # (and a result group only when one was named: "auto" takes the running PS's)
        insist = ("num_workers", "codec", "bits", "granularity", "p", "quorum", "block_log2", "tail_log2",
                  "rotation") \
            + (("result_group",) if args.result_group != AUTO_GROUP else ()) \
            + (("lane_bits",) if args.lane_bits != LANE_AUTO else ())
        expect = {k: v for k, v in job.to_msg().items() if k in insist}
    if not args.json:
        print(f"launching {'PS + ' if args.ps is None else ''}{local} of {args.workers} workers: "
              f"{args.rounds} rounds of d={args.dim}, codec={args.codec}, loss={args.loss}, "
              f"policy={args.loss_policy}, quorum={args.quorum}", flush=True)
    doc = run_launch(workers=args.workers, rounds=args.rounds, dim=args.dim, codec=args.codec,
                     bits=args.bits, granularity=args.granularity, p=args.p, quorum=args.quorum,
                     loss=args.loss, duplicate=args.duplicate, reorder=args.reorder,
                     straggler_delay_ms=args.straggler_delay_ms, straggler_rank=args.straggler_rank,
                     policy=args.loss_policy, seed=args.seed, ps=args.ps, engine=args.engine,
                     timeout_ms=args.timeout_ms, slots=args.slots, lane_bits=args.lane_bits,
                     verbose=args.verbose, shards=args.shards, rank_base=base, local_workers=local,
                     expect=expect, keys=args.keys, lease_s=args.lease_s, rejoin_grace_s=args.rejoin_grace_s,
                     stall_s=args.stall_s, kill=(args.kill_rank, kill_at) if args.kill_rank is not None else None,
                     restart=args.restart_killed, job_name=args.job, fixed_timeout=args.fixed_timeout,
                     block_log2=args.block_log2, tail_log2=args.tail_log2, rotation=args.rotation,
                     result_group=job.result_group,
                     serve_shard=args.serve_shard,
                     ps_wait_s=args.ps_wait_s, error_feedback=args.error_feedback)
    if args.json:
        return doc
    print(f"rounds {doc['rounds']}, exact {doc['exact_rounds']}, mismatched chunks "
          f"{doc['mismatched_chunks']}, lost chunks {doc['lost_chunks']}, retransmissions "
          f"{doc['retransmissions']}, mean round {doc['mean_round_ms']:.1f} ms")
    if doc.get("ps_job") is not None:
        print(f"PS counters of this job: {doc['ps_job']}")
    elif doc["ps"] is not None:
        print(f"PS counters (its lifetime totals, every job so far): {doc['ps']}")
    if doc["away_at_end"]:
        print(f"ranks {doc['away_at_end']} were away when the job ended (their leases had expired)")
    return {"ok": doc["ok"], "problems": doc["problems"]} if not doc["ok"] else None


def cmd_train(args):
    from thc_ps.deploy import train
    from thc_ps.proto.packing import check_lane_capacity
    if args.lane_bits:          # a width given; auto is the narrowest that fits (JobConfig)
        check_lane_capacity(args.workers, args.granularity, args.lane_bits)   # any codec (JobConfig: thc only)
    cfg = train.TrainConfig(job=_job(args), epochs=args.epochs,
                            model=args.model, batch=args.batch, lr=args.lr, loss=args.loss,
                            loss_policy=args.loss_policy,
                            straggler_delay_ms=args.straggler_delay_ms,
                            straggler_prob=args.straggler_prob, sync_every=args.sync_every,
                            train_limit=args.train_limit, test_limit=args.test_limit,
                            straggler_count=args.straggler_count, ps=args.ps or "",
                            per_tensor=args.per_tensor, job_name=args.job or "", keys=args.keys or "",
                            grad_sync=args.grad_sync, bucket_cap_mb=args.bucket_cap_mb)
    if args.straggler_count and not 0 < args.straggler_count < args.workers:
        raise ValueError(f"--straggler-count must be in 1..{args.workers - 1}")
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else \
        (lambda m: print(m, flush=True))
    job = cfg.job
    where = f"{job.num_workers} workers here, through the PS at {cfg.ps}" if cfg.ps else \
        f"PS + {job.num_workers} workers on loopback"
    log(f"training {cfg.model} on Fashion-MNIST: {where}, codec={job.codec}"
        + (f" (b={job.bits}, g={job.granularity}, p={job.p})" if job.codec == "thc" else "")
        + f", {cfg.epochs} epochs")
    doc = train.run_with_baseline(cfg, log, baseline=not (args.no_baseline or args.ps))
    if args.json:
        slim = {k: v for k, v in doc.items() if k not in ("run", "baseline")}
        slim["epochs"] = doc["run"]["epochs"]
        slim["seconds"] = doc["run"]["seconds"]
        slim["bytes_up"], slim["bytes_down"] = doc["run"]["bytes_up"], doc["run"]["bytes_down"]
        if "baseline" in doc:
            slim["baseline_epochs"] = doc["baseline"]["epochs"]
        lost = sum(e.get("lost_chunks", 0) for e in doc["run"]["epochs"])
        slim["ok"] = not (lost and cfg.loss_policy == "retransmit")
        slim["problems"] = [] if slim["ok"] else [f"{lost} chunks lost under retransmit"]
        return slim
    train.print_comparison(doc)
    lost = sum(e.get("lost_chunks", 0) for e in doc["run"]["epochs"])
    if lost and cfg.loss_policy == "retransmit":
        return {"ok": False, "problems": [f"{lost} chunks lost under retransmit"]}
    return None


def cmd_experiment(args) -> None:
    from thc_ps.deploy import experiments
    from thc_ps.deploy.train import TrainConfig
    from thc_ps.proto.job import JobConfig
    strag = args.name == "stragglers"
    workers = args.workers or (10 if strag else 4)
    granularity = args.granularity or (20 if strag else 30)
    p = str(args.p) if args.p else ("1/512" if strag else "1/32")
    job = JobConfig(num_workers=workers, bits=args.bits, granularity=granularity, p=p, seed=args.seed,
                    rotation=args.rotation)
    base = TrainConfig(job=job, epochs=args.epochs, model=args.model, train_limit=args.train_limit,
                       test_limit=args.test_limit, per_tensor=args.per_tensor, eval_every=args.eval_every)
    command = experiments.main_command(sys.argv[2:] if sys.argv[1:2] == ["experiment"] else [args.name])
    log = lambda m: print(m, flush=True)
    out = Path(args.out).expanduser().resolve() if args.out else Path.cwd() / "thc-results" / args.name
    if args.name == "loss":
        path = experiments.loss(base, command, log, kernel=args.kernel_loss, out=out)
    elif strag:
        path = experiments.stragglers(base, command, log, delay_ms=args.delay_ms, out=out)
    elif args.name == "scale":
        path = experiments.scale(base, command, log, out=out)
    elif args.name == "codecs":
        path = experiments.codecs(base, command, log, out=out)
    elif args.name == "peers":
        path = experiments.peers(base, command, log, out=out, rates=args.peer_rates or (0,), target=args.target,
                                 methods=args.methods or experiments.PEER_METHODS,
                                 layouts=args.layouts or experiments.DEFAULT_LAYOUTS)
    elif args.name == "lm":
        from thc_ps.deploy import lm_experiment as lm
        cfg = lm.LMConfig(ranks=workers, steps=args.steps, seed=args.seed, eval_every=args.eval_every or 25,
                          rotation=args.rotation)
        path = lm.lm(cfg, command, log, out=out, rates=args.peer_rates or (100, 1000),
                     methods=args.methods or lm.METHODS, target=args.target_loss, layouts=args.layouts or ("colocated",))
    else:
        path = experiments.bandwidth(base, command, log, rates=args.rates, codecs=args.codecs, target=args.target, out=out)
    print(f"wrote {path}" + ("" if args.name == "lm" else " and its plot") + f" (and {Path(path).with_suffix('.json').name})")


def cmd_bench(args) -> None:
    from thc_ps.deploy import bench_codecs
    # not docs/ (the committed table) unless the user says so
    out = Path(args.out).expanduser() if args.out else Path.cwd() / "thc-results" / "bench-codecs"
    out.mkdir(parents=True, exist_ok=True)
    path = bench_codecs.run(workers=args.workers, dims=[1 << k for k in args.dims],
                            e2e_dims=[1 << k for k in args.e2e_dims], rounds=args.rounds, out=out,
                            log=lambda m: print(m, flush=True))
    print(f"wrote {path}")


def _p4_doctor(args):
    import json

    from thc_ps.p4 import tools
    report = tools.doctor()
    if args.json:
        print(json.dumps(tools.doctor_json(report)))
    else:
        print(tools.doctor_text(report))
    if not report["bmv2_complete"]:
        raise SystemExit(1)


def _p4_testgen(args):
    import json

    from thc_ps.p4 import replay, testgen
    out = Path(args.out or f"build/p4/testgen/{args.target}")
    if args.switch and (args.target != "bmv2" or args.tables != "free"):
        raise ValueError("--switch runs the bmv2 program's tests on simple_switch with the entries p4testgen "
                         "chose: it needs --target bmv2 --tables free")
    gen = testgen.generate(args.target, out, args.max_tests, args.seed, args.program, tables=args.tables,
                           ports=args.port_ranges)
    print(gen.line(), flush=True)
    print(f"tests in {out}", flush=True)
    if args.no_replay:
        return None
    tests = testgen.read_tests(out, args.target)
    outcomes = replay.replay(tests, args.target)
    doc = replay.summary(outcomes)
    print(replay.summary_text(doc), flush=True)
    failed = doc[replay.DIVERGED] > 0
    if args.switch:
        from thc_ps.p4.control import compile_program
        from thc_ps.p4.harness import testgen_switch
        runs = testgen_switch.run(tests, compile_program(out / "build"))
        doc["simple_switch"] = {"passed": sum(r.passed for r in runs),
                                "failed": [r.line() for r in runs if not r.passed]}
        print(f"simple_switch: {doc['simple_switch']['passed']} of {len(runs)} tests passed", flush=True)
        for line in doc["simple_switch"]["failed"]:
            print(f"  {line}", flush=True)
        failed = failed or bool(doc["simple_switch"]["failed"])
    doc["outcomes"] = [o.__dict__ for o in outcomes]
    (out / "replay.json").write_text(json.dumps(doc, indent=1) + "\n")
    if failed:
        raise SystemExit(1)
    return None


def _p4_mininet(args):
    import json

    from thc_ps.deploy import mininet_run
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    doc = mininet_run.run(workers=args.workers, rounds=args.rounds, dim=args.dim, loss=args.loss,
                          straggler_delay_ms=args.straggler_delay_ms, straggler_rank=args.straggler_rank,
                          quorum=args.quorum, granularity=args.granularity, p=str(args.p),
                          policy=args.loss_policy, control=args.control_mode, timeout_ms=args.timeout_ms,
                          fixed_timeout=args.fixed_timeout,
                          build_dir=args.out, jobs=args.jobs, switch=args.switch_control,
                          lease_s=args.lease_s, log=log)
    print(json.dumps(doc) if args.json else mininet_run.summary_text(doc), flush=True)
    why = mininet_run.failed(doc)
    if why:
        print(f"thc p4 mininet: FAILED: {why}", file=sys.stderr)
        raise SystemExit(1)


def _print_tofino_resources(pipe) -> None:
    """One line of the compiler's resource report (p4c-barefoot -g), when it wrote one."""
    from thc_ps.p4 import tofino_resources
    try:
        r = tofino_resources.summarize(pipe)
    except (OSError, ValueError, KeyError):
        return
    print(f"{r['stages_used']} of {r['stages']} MAU stages, {r['srams']} SRAM and {r['tcams']} TCAM blocks, "
          f"{r['stateful_alus']} stateful ALUs ({pipe}/logs/resources.json)")


def cmd_p4(args):
    from thc_ps.p4 import control, gen_p4
    if args.action == "doctor":
        return _p4_doctor(args)
    if args.action == "mininet":
        return _p4_mininet(args)
    if args.action == "testgen":
        return _p4_testgen(args)
    if args.action == "gen":
        rc = gen_p4.main(["--target", args.target] + (["--check"] if args.check else []))
        if rc:
            raise ValueError("a P4 program is out of date: run `thc p4 gen`")
        return None
    if args.action == "build":
        if args.target == "bmv2":
            print(f"compiled {control.compile_program(args.out)}")
            return None
        proc = control.compile_tofino(args.target, args.out)
        print((proc.stdout + proc.stderr).strip())
        if proc.returncode != 0:
            raise RuntimeError(f"p4c-barefoot --target {args.target} failed (status {proc.returncode})")
        print(f"compiled p4/tofino/thc_tna.p4 for {args.target} into {args.out}/{args.target} "
              f"(P4Info for a P4Runtime server: {args.out}/{args.target}/{control.TNA_P4INFO})")
        _print_tofino_resources(Path(args.out) / args.target / "pipe")
        return None
    ports = {}
    for item in args.iface:
        num, sep, iface = item.partition("=")
        if not sep or not num.isdigit():
            raise ValueError(f"--iface expects PORT=IFACE, got {item!r}")
        ports[int(num)] = iface
    topology = {}
    for item in args.worker_port:
        ip, sep, rest = item.partition("=")
        port, sep2, mac = rest.partition(",")
        if not sep or not sep2 or not port.isdigit():
            raise ValueError(f"--worker-port expects IP=PORT,MAC, got {item!r}")
        topology[ip] = (int(port), mac)
    if not ports and not args.attach:
        raise ValueError("thc p4 run needs at least one --iface PORT=IFACE (or --attach to a running switch)")
    if not topology:
        raise ValueError("thc p4 run needs --worker-port IP=PORT,MAC for every worker host")
    job = control.switch_job(args.workers, granularity=args.granularity, p=str(args.p), quorum=args.quorum)
    l2 = {}
    for item in args.l2:
        mac, sep, port = item.partition("=")
        if not sep or not port.isdigit():
            raise ValueError(f"--l2 expects MAC=PORT, got {item!r}")
        l2[mac] = int(port)
    kind, why = control.choose_control(args.switch_control)
    print(f"switch control plane: {kind} ({why})", flush=True)
    proc, ctl = None, None
    try:
        if kind == "p4runtime":
            from thc_ps.p4.p4runtime import P4RuntimeControl
            json_path = control.ensure_program(args.out)
            if args.attach:
                address = f"127.0.0.1:{args.grpc_port or 9559}"
            else:
                proc, address = control.start_switch_grpc(ports, args.grpc_port)
            ctl = P4RuntimeControl(address, control.p4info_path(json_path), json_path)
            where = f"P4Runtime server {address}"
        else:
            if not args.attach:
                proc = control.start_switch(control.compile_program(args.out), ports, thrift_port=args.thrift_port)
            ctl = control.ThriftControl(control.SwitchCLI(args.thrift_port))
            where = f"Thrift port {args.thrift_port}"
        from thc_ps.ps_server.server import PSServer
        host, cport = args.control
        server = PSServer(job, (host, 0), control_port=cport,
                          engine=control.SwitchEngine(ctl, topology, args.ps_mac, l2=l2),
                          log=lambda m: print(m, flush=True), lease_s=args.lease_s).start()
        where = f"{len(ports)} ports, {where}" if proc else f"attached to the switch on {where}"
        print(f"switch up: PS address {args.ps_ip}:{gen_p4.PORT}, control tcp://{host}:{cport}, {where}",
              flush=True)
        try:
            server.wait()
        except KeyboardInterrupt:
            pass
        print(f"final stats: {server.stats()}", flush=True)
        server.stop()
    finally:
        if ctl is not None:
            ctl.close()
        if proc is not None:
            proc.kill()
    return None
