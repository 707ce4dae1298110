"""Time to program a job on the switch and to close it: Thrift CLI against P4Runtime, side by
side in one run, one bmv2 switch each (`simple_switch` and `simple_switch_grpc`, no ports:
only the control plane is measured).

A job is what `thc p4 run` writes for it (thc_ps.p4.control.SwitchEngine, the one code path of both
backends): `start` is SwitchEngine.start_job (its config entry, 32 × 16 lookup entries, its
multicast group, its counter block zeroed), `register` its 4 ranks' registrations (workers
entry, multicast replica, egress rewrite: one batch each), `close` SwitchJob.close.  For 1, 4
and 8 jobs at once: all started, all registered, all closed; each step timed per job.  The
two backends take turns in each repetition; medians over the repetitions.

Needs simple_switch, simple_switch_CLI, simple_switch_grpc and p4c-bm2-ss (`thc p4 doctor`),
and the P4Runtime client (`pip install '.[p4runtime]'`).

    .venv/bin/python bench/bench_p4_control.py [--repeat 5] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout
from thc_ps.p4.control import (SwitchCLI, SwitchEngine, ThriftControl, compile_program, free_port,  # noqa: E402
                        p4info_path, start_switch, start_switch_grpc, switch_job)
from thc_ps.p4.p4runtime import P4RuntimeControl  # noqa: E402

WORKERS = 4
TOPOLOGY = {f"10.0.{j}.{r + 1}": (r + 1, f"00:00:00:00:{j:02x}:{r + 1:02x}") for j in range(8) for r in range(WORKERS)}
JOBS = (1, 4, 8)


def one_round(engine: SwitchEngine, jobs: int) -> dict:
    """Seconds per job of each step, for `jobs` jobs at once."""
    t0 = time.perf_counter()
    started = [engine.start_job(switch_job(WORKERS, slots=64, norm_slots=8, job_id=10 + j), 0x1000 + j, 80 * j)
               for j in range(jobs)]
    t1 = time.perf_counter()
    for j, job in enumerate(started):
        for r in range(WORKERS):
            job.register(r, f"10.0.{j}.{r + 1}", 5000 + r, token=7 * r + j)
    t2 = time.perf_counter()
    for job in started:
        job.close()
    t3 = time.perf_counter()
    return {"start": (t1 - t0) / jobs, "register": (t2 - t1) / jobs, "close": (t3 - t2) / jobs}


def switches(json_path: Path):
    """{backend: (SwitchEngine, process)}: one bmv2 switch each."""
    thrift_port = free_port()
    ss = start_switch(json_path, {}, thrift_port=thrift_port)
    grpc, address = start_switch_grpc({})
    return {"thrift": (SwitchEngine(ThriftControl(SwitchCLI(thrift_port)), TOPOLOGY), ss),
            "p4runtime": (SwitchEngine(P4RuntimeControl(address, p4info_path(json_path), json_path), TOPOLOGY), grpc)}


def table(results: dict) -> str:
    lines = ["| jobs at once | control plane | start a job (ms) | register its 4 ranks (ms) | close it (ms) |",
             "|---|---|---|---|---|"]
    for n in JOBS:
        for kind in ("thrift", "p4runtime"):
            r = results[kind][str(n)]
            lines.append(f"| {n} | {kind} | {1e3 * r['start']:.0f} | {1e3 * r['register']:.0f} | "
                         f"{1e3 * r['close']:.0f} |")
    return "\n".join(lines)


def tracked(path: Path) -> bool:
    """Whether git tracks `path` (the results never overwrite a committed file)."""
    return subprocess.run(["git", "ls-files", "--error-unmatch", path.name], cwd=path.parent, capture_output=True,
                          ).returncode == 0 if path.parent.is_dir() else False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="repetitions (medians are reported)")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="write bench_p4_control.json and .md there (default: print only)")
    args = ap.parse_args(argv)
    outputs = [Path(args.out) / f"bench_p4_control.{ext}" for ext in ("json", "md")] if args.out else []
    if any(tracked(p) for p in outputs):
        ap.error(f"{args.out} holds committed results: give another --out")
    json_path = compile_program(Path(tempfile.mkdtemp(prefix="thc-bench-p4c-")))
    sw = switches(json_path)
    samples = {kind: {n: [] for n in JOBS} for kind in sw}
    try:
        for _ in range(args.repeat):
            for n in JOBS:
                for kind, (engine, _) in sw.items():
                    samples[kind][n].append(one_round(engine, n))
    finally:
        for engine, proc in sw.values():
            engine.control.close()
            proc.kill()
    results = {kind: {str(n): {step: statistics.median(s[step] for s in runs) for step in ("start", "register", "close")}
                      for n, runs in by_n.items()} for kind, by_n in samples.items()}
    text = table(results)
    print(text)
    if args.out:
        outputs[0].parent.mkdir(parents=True, exist_ok=True)
        outputs[0].write_text(json.dumps({"repeat": args.repeat, "workers": WORKERS, "results": results},
                                         indent=1) + "\n")
        outputs[1].write_text(text + "\n")
        print(f"wrote {outputs[0]} and {outputs[1].name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
