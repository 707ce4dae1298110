"""p4testgen's STF tests of p4/thc.p4 run on bmv2 `simple_switch` (veth pairs, Thrift CLI).

Per test: the switch's tables cleared and its registers zeroed (p4testgen's v1model model
starts every register at zero), the test's entries written with `table_add` (keys and
parameters in the order p4/entries.py's SCHEMA gives, which is the P4Info's: an STF test
lists them by name), its packet sent on its port, and every frame the switch emits
compared with the test's expectation under its care mask: exactly one frame on the
expected port, or none.  Ports are the veth pairs VethSwitch makes with the tests' port
numbers (511 is bmv2's drop port and gets none).

p4testgen drops a packet whose multicast group is set (it does not model bmv2's
replication), so a test whose packet completes a round expects nothing.  `run` then runs
it a second time with what the control plane writes for the job's registered workers — its
multicast group (a replica per worker, each on a port of its own) and their `replica_dest`
rewrites — and compares every replica with the software PS's RESULT to that worker
(thc_ps.p4.replay.fan_out).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from thc_ps.p4 import replay
from thc_ps.p4.control import reset_commands
from thc_ps.p4.entries import EGR, SCHEMA, McGroup, ip_int, rid
from thc_ps.p4.harness.veth_switch import VethSwitch
from thc_ps.p4.testgen import Entry, GenTest

DROP_PORT = 511


@dataclass
class SwitchRun:
    """One test on simple_switch: passed, or what came out instead."""

    test: str
    passed: bool
    detail: str = ""

    def line(self) -> str:
        return f"{self.test}: {'passed' if self.passed else 'FAILED: ' + self.detail}"


def _ordered(e: Entry) -> tuple[list, list]:
    keys, actions = SCHEMA.get(e.table, ((), {}))
    by_name = {k.field: k for k in e.keys}
    order = [name for name, *_ in keys] if set(by_name) == {name for name, *_ in keys} else [k.field for k in e.keys]
    if any(by_name[n].kind != "exact" for n in order):
        raise ValueError(f"{e.table}: only exact keys are written to bmv2 here (p4/thc.p4 has no other)")
    params = dict(e.params)
    names = [p for p, _ in actions[e.action]] if e.action in actions and set(params) == \
        {p for p, _ in actions[e.action]} else [p for p, _ in e.params]
    return [by_name[n].value for n in order], [params[p] for p in names]


def commands(test: GenTest) -> list[str]:
    """The test's entries as simple_switch_CLI commands."""
    out = []
    for e in test.entries:
        keys, params = _ordered(e)
        args = " ".join(str(v) for v in params)
        if e.default:
            out.append(f"table_set_default {e.table} {e.action} {args}".rstrip())
        else:
            out.append(f"table_add {e.table} {e.action} {' '.join(str(v) for v in keys)} => {args}".rstrip())
    return out


def ports(tests: list[GenTest]) -> list[int]:
    """Every port a test sends on, expects on or forwards to (not the drop port)."""
    used = {t.in_port for t in tests} | {t.out_port for t in tests if t.out_port is not None}
    used |= {v for t in tests for e in t.entries for p, v in e.params if p == "port" and e.table.endswith("l2")}
    return sorted(p for p in used if p != DROP_PORT)


def same(frame: bytes, expected: bytes, care: bytes | None) -> bool:
    care = care or b"\xff" * len(expected)
    return len(frame) == len(expected) and all((a ^ b) & m == 0 for a, b, m in zip(frame, expected, care))


#: Replica ports of the multicast runs (worker w on port REPLICA_PORTS[w]) and their MACs.
REPLICA_PORTS = tuple(range(100, 100 + 32))


def replica_mac(wid: int) -> int:
    return 0x02_00_00_00_01_00 | wid


def _replicas(sw, t: GenTest, rnd: tuple, quiet: float) -> SwitchRun:
    """The test again with the job's group and replica rewrites: each replica the twin's."""
    cell, ps_mac, workers, want = rnd
    group = McGroup(cell, tuple((REPLICA_PORTS[w], rid(cell, w)) for w, _, _ in workers))
    sw.cli.run(commands(t) + [f"table_add {EGR}.replica_dest {EGR}.set_dest {rid(cell, w)} => "
                              f"{replica_mac(w)} {ip_int(ip)} {port}" for w, ip, port in workers])
    sw.control.write([("insert", group)])
    try:
        sw.drain(0.05)
        sw.send(t.in_port, t.packet)
        got = sorted(sw.drain(quiet))
    finally:
        sw.control.write([("delete", group)])
    expected = sorted((REPLICA_PORTS[w], replay.fan_out(t.packet, want[(ip, port)], ps_mac, (replica_mac(w), ip, port)))
                      for w, ip, port in workers)
    bad = sorted({p for p, f in got if (p, f) not in expected} | {p for p, f in expected if (p, f) not in got})
    return SwitchRun(f"{t.name} (multicast to {len(workers)})", not bad,
                     f"replicas differ from the software PS's RESULT on ports {bad}" if bad else "")


def run(tests: list[GenTest], json_path: Path, quiet: float = 0.3) -> list[SwitchRun]:
    """Every test on one simple_switch (root: veth pairs), and each that completes a round
    again with its job's multicast group."""
    rounds = {t.name: replay.bmv2_round(t) for t in tests}
    replicas = {REPLICA_PORTS[w] for r in rounds.values() if r for w, _, _ in r[2]}
    sw = VethSwitch(json_path, sorted(set(ports(tests)) | replicas), control="thrift")
    results = []
    try:
        tables = sorted(SCHEMA)
        clear = [f"table_clear {name}" for name in tables] + [f"table_reset_default {name}" for name in tables]
        for t in tests:
            sw.cli.run(clear + reset_commands())
            sw.cli.run(commands(t))
            sw.drain(0.05)
            sw.send(t.in_port, t.packet)
            got = sw.drain(quiet)
            if t.expected is None:
                ok = not got
                detail = "" if ok else f"expected a drop, got {len(got)} frame(s) on port(s) {[p for p, _ in got]}"
            else:
                ok = len(got) == 1 and got[0][0] == t.out_port and same(got[0][1], t.expected, t.care)
                detail = "" if ok else (f"expected one frame on port {t.out_port}, got "
                                        + (", ".join(f"{len(f)} bytes on port {p}" for p, f in got) or "none"))
            results.append(SwitchRun(t.name, ok, detail))
            if rounds[t.name] is not None and rounds[t.name][2]:
                sw.cli.run(clear + reset_commands())
                results.append(_replicas(sw, t, rounds[t.name], quiet))
    finally:
        sw.close()
    return results
