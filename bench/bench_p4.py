"""Packets per second through bmv2 simple_switch running p4/thc.p4 (a correctness target:
bmv2 is slow by design), and the program's resource summary from the compiled JSON.

Needs root, simple_switch and p4c-bm2-ss (PATH or /opt/p4tools/bin).

    .venv/bin/python bench/bench_p4.py [--rounds 200]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from p4.control import compile_program, job_commands, switch_job, worker_commands
from p4.harness.veth_switch import VethSwitch
from tests.p4.test_switch import N, PS_MAC, WORKERS, datagram, frame


def resources(json_path: Path) -> dict:
    doc = json.loads(Path(json_path).read_text())
    regs = doc.get("register_arrays", [])
    pipes = doc.get("pipelines", [])
    tables = [t for p in pipes for t in p.get("tables", [])]
    return {"register_arrays": len(regs),
            "register_bits": sum(r["size"] * r["bitwidth"] for r in regs),
            "tables": len(tables), "actions": len(doc.get("actions", [])),
            "lanes_per_packet": 32}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp())
    json_path = compile_program(out)
    print("resources:", json.dumps(resources(json_path)))
    job = switch_job(N, slots=64, norm_slots=8)
    sw = VethSwitch(json_path, N + 1)
    try:
        cmds = job_commands(job, PS_MAC)
        for h, w in enumerate(WORKERS):
            cmds += worker_commands(w, h)
        sw.cli.run(cmds)
        rng = np.random.default_rng(0)
        frames = [frame(w, datagram(job, w, r % 64, r // 64 + 1, rng)) for r in range(args.rounds)
                  for w in range(N)]
        received = 0
        t = time.perf_counter()
        for i, f in enumerate(frames):
            sw.send(i % N + 1, f)
            if i % 64 == 63:
                received += len(sw.drain(0.0, 0.05))
        received += len(sw.drain(1.0, 30))
        dt = time.perf_counter() - t
        print(f"{len(frames)} DATA packets in, {received} RESULT packets out in {dt:.2f} s: "
              f"{len(frames) / dt:.0f} packets/s in, {args.rounds * 32 / dt:.0f} coordinates/s aggregated "
              f"(expected {args.rounds * N} results)")
    finally:
        sw.close()


if __name__ == "__main__":
    main()
