"""p4testgen's input/output tests of both switch programs, replayed against the software PS.

With p4testgen (found by p4/tools.py): each program's tests are generated with the
committed seed and test budget below, every test is replayed against the twin
(thc_ps.ps_server.reference) — none may diverge, and enough of them must be compared rather than
set aside — a twin with an off-by-one in its round rule must fail the replay, and the bmv2
program's tests must pass on simple_switch (root, bmv2's tools).  Without p4testgen those
skip with one line; the readers of p4testgen's formats, the replay's envelope and its
refusals are checked here on tests written by hand in those formats."""
import difflib
import re
import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from thc_ps.p4 import replay, testgen, tools
from thc_ps.p4.control import compile_program
from thc_ps.proto import headers as H
from thc_ps.proto.packing import pack_indices
from thc_ps.ps_server.reference import ReferencePS

#: The committed generation budget of this test per (target, tables, ports) (bigger runs:
#: `thc p4 testgen`, docs/p4.md): "job", the tables hold fixed jobs; "free", p4testgen chooses
#: every entry (bmv2 only: its tests also run on simple_switch; on Tofino nearly every
#: free-tables test holds a thc_job entry no job writes, docs/p4.md).  Tofino's greedy search
#: spends its budget on second passes; the front ports alone ("0:15") give first passes.
SEED = 1
MAX_TESTS = {("bmv2", "free", ""): 40, ("bmv2", "job", ""): 30, ("tofino", "job", ""): 40,
             ("tofino", "job", "0:15"): 20}

NO_TESTGEN = (f"p4testgen not found on {tools.where_text()} (see `thc p4 doctor`)"
              if tools.find_tool("p4testgen") is None else "")
needs_testgen = pytest.mark.skipif(bool(NO_TESTGEN), reason=NO_TESTGEN)

PS_MAC, WORKER_MAC = "00:00:00:00:00:fe", "00:00:00:00:00:01"
JOB_ID, NONCE, TOKEN, N = 7, 0x1234, 0x99, 4


def frame(h: H.Header, payload: bytes = b"", sport: int = 5001, reply: bool = False) -> bytes:
    """A frame built with scapy, independently of the replay's own envelope."""
    ends = (("10.0.0.254", "10.0.0.1", 9000, sport, PS_MAC, WORKER_MAC) if reply
            else ("10.0.0.1", "10.0.0.254", sport, 9000, WORKER_MAC, PS_MAC))
    src, dst, sp, dp, smac, dmac = ends
    return bytes(Ether(src=smac, dst=dmac) / IP(src=src, dst=dst) / UDP(sport=sp, dport=dp, chksum=0)
                 / H.build(h, payload))


def data_packet(rnd: int, slot: int = 3, worker: int = 1) -> bytes:
    h = H.Header(type=H.DATA, job_id=JOB_ID, worker_id=worker, num_workers=N, elem_bits=4, slot=slot, round=rnd,
                 offset=64, count=32, op=H.OP_LOOKUP_SUM, nonce=NONCE, token=TOKEN)
    return frame(h, pack_indices((np.arange(32) % 16).astype(np.uint8), 4).tobytes())


def ptf(entries, registers, in_port, pkt, eg_port=None, exp=None, masks=()) -> str:
    """One test class as p4testgen's Tofino PTF back end writes it."""
    lines = ["class Test1(AbstractTest):", "    # Current statement coverage: 0.25", "    '''",
             "    [Table Branch] ThcIngress.thc_job", "    '''", "", "    def setupCtrlPlane(self):"]
    lines += [f"        self.setRegisterValue('{r}', {v!r}, {i})" for r, i, v in registers]
    for table, keys, action, data in entries:
        lines.append(f"        self.insertTableEntry('{table}', [{', '.join(keys)}], '{action}', ["
                     + ", ".join(f"gc.DataTuple('{p}', {v})" for p, v in data) + "])")
    lines += ["        pass", "", "    def sendPacket(self):", f"        ig_port = {in_port}", f"        pkt = {pkt!r}",
              "        send_packet(self, ig_port, pkt)", "", "    def verifyPackets(self):"]
    if exp is None:
        lines.append("        pass")
    else:
        lines += [f"        eg_port = {eg_port}", f"        exp_pkt = {exp!r}", "        exp_pkt = Mask(exp_pkt)"]
        lines += [f"        exp_pkt.set_do_not_care({a}, {b})" for a, b in masks]
        lines.append("        verify_packet(self, exp_pkt, eg_port)")
    return "\n".join(lines) + "\n"


def tna_entries(quorum_cb: int = 4 << 24):
    key = "gc.KeyTuple"
    return [("pipe.ThcIngress.thc_job", [f"{key}('hdr.thc.job_id', 0x0007)", f"{key}('hdr.thc.nonce', 0x00001234)"],
             "ThcIngress.set_job", [("n", 4), ("quorum", 4), ("quorum_cb", quorum_cb), ("ps_mac", 0xFE),
                                    ("recirc_port", 68)]),
            ("pipe.ThcIngress.job_size", [f"{key}('hdr.thc.job_id', 7)", f"{key}('hdr.thc.nonce', 0x1234)",
                                          f"{key}('hdr.thc.num_workers', 4)"], "ThcIngress.n_matches", []),
            ("pipe.ThcIngress.worker_range", [f"{key}('hdr.thc.worker_id', low=0, high=3)"],
             "ThcIngress.worker_in_range", []),
            ("pipe.ThcIngress.slot_range", [f"{key}('hdr.thc.type', 1)", f"{key}('hdr.thc.slot', low=0, high=9)"],
             "ThcIngress.slot_in_range", []),
            ("pipe.ThcIngress.workers", [f"{key}('hdr.ipv4.src', 0x0a000001)", f"{key}('hdr.udp.src_port', 5001)",
                                         f"{key}('hdr.thc.token', 0x99)", f"{key}('hdr.thc.worker_id', 1)"],
             "ThcIngress.set_worker", [("me", 2)])]


def straggler(rnd: int) -> bytes:
    return frame(H.Header(type=H.STRAGGLER, job_id=JOB_ID, worker_id=1, num_workers=N, slot=3, round=rnd, offset=64,
                          op=H.OP_LOOKUP_SUM, nonce=NONCE), reply=True)


# ---------------------------------------------------------------------------- without p4testgen

def test_stf_is_read_back_field_for_field():
    stf = """# p4testgen seed: 1
# Current node coverage: 0.42
# Traces
# [Parser] ThcParser

# Table ThcIngress.workers
add "ThcIngress.workers" "hdr.thc.job_id":0x0007 "hdr.ipv4.src":0x0A000001 "hdr.udp.src_port":0x1389 \
"hdr.thc.token":0x00000099 "ThcIngress.set_worker"("wid":0x01)
add "ThcIngress.tern" 3 "meta.x":0b1*0* "ThcIngress.a"()
setdefault "ThcIngress.l2" "ThcIngress.forward"("port":0x002)

packet 2 00112233445566778899AABB0800
expect 5 0011*2334455$
"""
    t = testgen.parse_stf(stf.replace("\\\n", ""), "thc_1")
    w, tern, default = t.entries
    assert (w.table, w.action, w.params) == ("ThcIngress.workers", "ThcIngress.set_worker", (("wid", 1),))
    assert [(k.field, k.kind, k.value) for k in w.keys] == [("hdr.thc.job_id", "exact", 7),
                                                              ("hdr.ipv4.src", "exact", 0x0A000001),
                                                              ("hdr.udp.src_port", "exact", 5001),
                                                              ("hdr.thc.token", "exact", 0x99)]
    assert (tern.priority, tern.keys[0].kind, tern.keys[0].value, tern.keys[0].mask) == (3, "ternary", 0b1000, 0b1010)
    assert tern.keys[0].matches(0b1101) and not tern.keys[0].matches(0b0101)
    assert default.default and default.params == (("port", 2),)
    assert (t.in_port, t.packet) == (2, bytes.fromhex("00112233445566778899AABB0800"))
    assert (t.out_port, t.expected, t.care) == (5, bytes.fromhex("001102334455"), bytes.fromhex("ffff0fffffff"))
    assert t.coverage == 0.42 and t.trace == ("[Parser] ThcParser",)


def test_ptf_is_read_back_field_for_field():
    text = ptf(tna_entries(), [("pipe.ThcIngress.round_reg", 3, 10),
                               ("pipe.ThcIngress.shadow_reg", 3, [("pipe.ThcIngress.shadow_reg.cb", 5),
                                                                  ("pipe.ThcIngress.shadow_reg.offset", 64)])],
               5, b"\x01\x02", 68, b"\x0a\x0b\x0c", masks=((4, 8),))
    (t,) = testgen.parse_ptf(text)
    assert t.register("round_reg") == {3: 10} and t.register("shadow_reg") == {3: {"cb": 5, "offset": 64}}
    (wr,) = t.table("worker_range")
    assert (wr.keys[0].kind, wr.keys[0].value, wr.keys[0].high) == ("range", 0, 3)
    assert t.table("thc_job")[0].param("quorum_cb") == 4 << 24
    assert (t.in_port, t.packet, t.out_port, t.expected) == (5, b"\x01\x02", 68, b"\x0a\x0b\x0c")
    assert t.care == bytes([0xF0, 0x0F, 0xFF]) and t.coverage == 0.25
    bad = text.replace("        pass\n", "        x = self.bfrt_info\n", 1)
    with pytest.raises(ValueError, match="not read"):
        testgen.parse_ptf(bad)


def test_the_replay_matches_a_hand_built_answer_and_names_the_field_that_differs():
    """Pass 1 of the Tofino program on a slot at round 9: a round-5 packet gets a STRAGGLER
    carrying round 9 (built here with scapy, not by the replay's envelope); the same test
    expecting round 8 diverges on exactly that field."""
    pkt = data_packet(5)
    registers = [("pipe.ThcIngress.round_reg", 3, 10)]
    (ok,) = replay.replay(testgen.parse_ptf(ptf(tna_entries(), registers, 5, pkt, 5, straggler(9))), "tofino")
    assert (ok.verdict, ok.what) == (replay.MATCH, "STRAGGLER")
    (bad,) = replay.replay(testgen.parse_ptf(ptf(tna_entries(), registers, 5, pkt, 5, straggler(8))), "tofino")
    assert bad.verdict == replay.DIVERGED and bad.diffs == ("thc.round: switch 0x8, twin 0x9",)
    (port,) = replay.replay(testgen.parse_ptf(ptf(tna_entries(), registers, 5, pkt, 6, straggler(9))), "tofino")
    assert port.diffs == ("port: switch 6, twin 5",)


def test_the_replay_derives_what_pass_1_hands_to_pass_2():
    """The current round with workers 0 and 2 in: worker 1's packet goes to the
    recirculation port with count 3, bitmap 0b111 and 'not seen before' in the bridge."""
    pkt = data_packet(5)
    registers = [("pipe.ThcIngress.round_reg", 3, 6), ("pipe.ThcIngress.offset_reg", 3, 64),
                 ("pipe.ThcIngress.arrived_reg", 3, 0b101), ("pipe.ThcIngress.contrib_reg", 3, 2 << 24 | 0b101)]
    bridge = replay.bridge_bytes({"pass2": 1, "kind": replay.K_SAME, "port": 5, "me": 2, "cb": 3 << 24 | 0b111})
    (ok,) = replay.replay(testgen.parse_ptf(ptf(tna_entries(), registers, 5, pkt, 68,
                                                bridge + replay.fix_checksum(pkt))), "tofino")
    assert ok.verdict == replay.MATCH and ok.what == "pass 1: the current round, to pass 2"
    seen = replay.bridge_bytes({"pass2": 1, "kind": replay.K_SAME, "port": 5, "me": 2, "cb": 3 << 24 | 0b111,
                                "seen": 2})
    (bad,) = replay.replay(testgen.parse_ptf(ptf(tna_entries(), registers, 5, pkt, 68,
                                                 seen + replay.fix_checksum(pkt))), "tofino")
    assert bad.diffs == ("bridge.seen: switch 0x2, twin 0x0",)
    late = [("pipe.ThcIngress.arrived_reg", 3, 0b1101) if r[0].endswith("arrived_reg") else r for r in registers]
    (aside,) = replay.replay(testgen.parse_ptf(ptf(tna_entries(), late, 5, pkt, 68, bridge)), "tofino")
    assert aside.verdict == replay.SET_ASIDE and "arrived" in aside.reason


def test_entries_no_job_writes_are_set_aside_with_the_reason():
    pkt = data_packet(5)
    (t,) = replay.replay(testgen.parse_ptf(ptf(tna_entries(quorum_cb=3 << 24), [], 5, pkt)), "tofino")
    assert t.verdict == replay.SET_ASIDE and t.reason == "thc_job: quorum_cb 0x3000000 ≠ quorum 4 << 24"
    stf = (f'add "ThcIngress.thc_config" "hdr.thc.job_id":0x0007 "ThcIngress.set_config"("nonce":0x1234,"n":4,'
           f'"quorum":4,"base":0,"data_slots":8,"norm_slots":2,"group":1,"event_base":16,"ps_mac":0xfe,"epoch":0)\n'
           f"packet 1 {pkt.hex()}\n")
    (e,) = replay.replay([testgen.parse_stf(stf, "thc_1")], "bmv2")
    assert e.verdict == replay.SET_ASIDE and e.reason.startswith("thc_config: epoch 0")
    (ok,) = replay.replay([testgen.parse_stf(stf.replace('"epoch":0', '"epoch":3'), "thc_1")], "bmv2")
    assert (ok.verdict, ok.what) == (replay.MATCH, "dropped: unregistered")


def test_testgen_refuses_bad_input_before_running(tmp_path):
    with pytest.raises(ValueError, match="unknown p4testgen target 'psa': one of bmv2, tofino, tofino2"):
        testgen.generate("psa", tmp_path)
    with pytest.raises(ValueError, match="no P4 program at"):
        testgen.generate("bmv2", tmp_path, program=tmp_path / "missing.p4")
    with pytest.raises(ValueError, match="holds committed files"):
        testgen.generate("bmv2", testgen.HERE)          # p4/: the committed programs
    cli = subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", "p4", "testgen", "--target", "psa"],
                         capture_output=True, text=True)
    assert cli.returncode == 2 and "invalid choice: 'psa'" in cli.stderr


def test_a_job_tables_build_holds_what_the_control_plane_writes():
    """`--tables job`: every entry the control plane writes for the fixed jobs is compiled into
    its table as a const entry, and nothing else of the program changes."""
    for name in ("bmv2", "tofino"):
        program = testgen.target(name).program.read_text()
        fixed = testgen.fixed_entries(name)
        text = testgen.job_program(program, fixed)
        ops = difflib.SequenceMatcher(None, program.splitlines(), text.splitlines(), autojunk=False).get_opcodes()
        assert {op for op, *_ in ops} == {"equal", "insert"}          # only lines added
        added = [line.strip() for op, _, _, j1, j2 in ops if op == "insert" for line in text.splitlines()[j1:j2]]
        tables = {e.table for e in fixed}
        assert added.count("const entries = {") == added.count("}") == len(tables)
        assert len(added) == len(fixed) + 2 * len(tables)
        for e in fixed:
            keys = [f"{v[0]} .. {v[1]}" if isinstance(v, tuple) else str(v) for _, v in e.match]
            row = (keys[0] if len(keys) == 1 else f"({', '.join(keys)})") + \
                f" : {e.action.rpartition('.')[2]}({', '.join(str(v) for _, v in e.params)});"
            block = text[text.index(f"table {e.table.rpartition('.')[2]} {{"):]
            assert row in block[:block.index("\n    }")], (e.table, row)
    assert {e.table.rpartition(".")[2] for e in testgen.fixed_entries("bmv2")} >= {"thc_config", "workers", "lut0"}
    with pytest.raises(ValueError, match="the program has no table nowhere"):
        testgen.job_program(program, [replace(fixed[0], table="ThcIngress.nowhere")])


def test_a_job_tables_run_is_read_back_with_its_fixed_entries(tmp_path):
    """p4testgen lists no entry of a const table: the reader adds the fixed jobs' entries, so
    the replay sees the job the build held (here rank 0 of job 1 sends a round's first DATA)."""
    (job, ports), _ = testgen.fixed_jobs("bmv2")
    w = ports[0]
    h = H.Header(type=H.DATA, job_id=job.job_id, worker_id=0, num_workers=job.num_workers, elem_bits=4, slot=1,
                 round=3, offset=32, count=32, op=H.OP_LOOKUP_SUM, nonce=testgen.NONCE,
                 token=testgen.token(job.job_id, 0))
    pkt = bytes(Ether(src=w.mac, dst=testgen.PS_MAC) / IP(src=w.ip, dst="10.0.0.254")
                / UDP(sport=w.udp_port, dport=9000, chksum=0)
                / H.build(h, pack_indices((np.arange(32) % 16).astype(np.uint8), 4).tobytes()))
    (tmp_path / "thc_1.stf").write_text(f"packet {w.switch_port} {pkt.hex()}\n")
    (tmp_path / testgen.SUMMARY).write_text('{"tables": "free"}')
    (bare,) = testgen.read_tests(tmp_path, "bmv2")
    assert bare.entries == () and replay.replay([bare], "bmv2")[0].what == "THC, no such job: dropped"
    (tmp_path / testgen.SUMMARY).write_text('{"tables": "job"}')
    (test,) = testgen.read_tests(tmp_path, "bmv2")
    assert len(test.entries) == len(testgen.fixed_entries("bmv2"))
    (outcome,) = replay.replay([test], "bmv2")
    assert (outcome.verdict, outcome.what) == (replay.MATCH, "aggregated"), outcome.line()
    wrong = test.packet.replace(testgen.token(job.job_id, 0).to_bytes(4, "big"), b"\x00\x00\x00\x01")
    (stray,) = replay.replay([replace(test, packet=wrong)], "bmv2")
    assert (stray.verdict, stray.what) == (replay.MATCH, "dropped: unregistered"), stray.line()


# ---------------------------------------------------------------------------- with p4testgen

@pytest.fixture(scope="module", params=sorted(MAX_TESTS), ids=lambda p: "-".join(filter(None, p)))
def generated(request, tmp_path_factory):
    if NO_TESTGEN:
        pytest.skip(NO_TESTGEN)
    name, tables, ports = request.param
    out = tmp_path_factory.mktemp(f"testgen-{name}-{tables}")
    gen = testgen.generate(name, out, MAX_TESTS[request.param], SEED, tables=tables, ports=ports or None)
    return name, gen, testgen.read_tests(out, name)


def _slots_compared(gen):
    """Only the tests of a build whose tables hold real jobs reach those jobs' slots: with free
    tables p4testgen's entries are ones no job writes (docs/p4.md)."""
    if gen.tables != "job":
        pytest.skip("free tables: no generated test reaches a job's slot (the job-tables run does)")
    if gen.target.startswith("tofino") and f"{testgen.TESTGEN_RECIRC_PORT}:" not in gen.ports:
        pytest.skip("first passes only: the slot's round rule and lanes are pass 2's (the full run has them)")


@needs_testgen
def test_generated_tests_replay_against_the_software_ps(generated):
    name, gen, tests = generated
    assert gen.tests == len(tests) > 0 and 0 < gen.covered <= gen.coverable
    outcomes = replay.replay(tests, name)
    doc = replay.summary(outcomes)
    print(gen.line())
    print(replay.summary_text(doc))
    diverged = [o.line() for o in outcomes if o.verdict == replay.DIVERGED]
    assert not diverged, diverged


@needs_testgen
def test_most_generated_tests_are_compared_not_set_aside(generated):
    """With free tables most of p4testgen's entries are no job's (a quarter must still be
    compared); with the tables of real jobs nearly every test is."""
    name, gen, tests = generated
    doc = replay.summary(replay.replay(tests, name))
    assert doc[replay.MATCH] >= len(tests) * (0.9 if gen.tables == "job" else 0.25), doc


class OffByOneTwin(ReferencePS):
    """The software PS with its round rule off by one: a packet one round behind its slot is
    taken for stale, not for the previous round whose kept result it may ask for again."""

    def _round_step(self, st, h):
        if st.active and h.round + 1 == st.round:
            return self._straggler(st, h)
        return super()._round_step(st, h)


@needs_testgen
def test_a_twin_with_an_off_by_one_round_rule_fails_the_tofino_replay(generated):
    name, gen, tests = generated
    if name != "tofino":
        pytest.skip("the bmv2 program's registers start at zero under p4testgen: no test has a previous round")
    _slots_compared(gen)
    already = {o.test for o in replay.replay(tests, name) if o.verdict == replay.DIVERGED}
    outcomes = replay.replay(tests, name, twin=OffByOneTwin)
    broken = [o for o in outcomes if o.verdict == replay.DIVERGED and o.test not in already]
    print("\n".join(o.line() for o in broken))
    assert broken


@needs_testgen
def test_a_second_pass_whose_job_is_gone_is_dropped(tmp_path):
    """Found by p4testgen (docs/p4.md, divergence 3): a packet whose job is removed between its
    two passes.  Its second pass now drops it, as the PS drops an ended job's packet; without
    the verdict's job check the same generated tests diverge (the switch answers)."""
    program = testgen.target("tofino").program.read_text()
    held = "(meta.job_ok == 0 || hdr.thc.worker_id < meta.n && hdr.thc.num_workers == meta.n)"
    assert program.count(held) == 1
    gone = program.replace(held, "meta.job_ok == 0")         # every second pass: its job removed
    unchecked = re.sub(r"\n\s*\(0, K_\w+, _, _, _, _, _\) : set_verdict\(V_NO_JOB\);", "", gone)
    assert unchecked.count("V_NO_JOB);") == gone.count("V_NO_JOB);") - 3
    second = {}
    for label, text in (("checked", gone), ("unchecked", unchecked)):
        (tmp_path / f"{label}.p4").write_text(text)
        testgen.generate("tofino", tmp_path / label, 12, SEED, program=tmp_path / f"{label}.p4", tables="job")
        outcomes = replay.replay(testgen.read_tests(tmp_path / label, "tofino"), "tofino")
        second[label] = [o for o in outcomes if o.what == "pass 2, no such job: dropped"]
        print(label, replay.summary_text(replay.summary(outcomes)))
    assert len(second["checked"]) >= 3 and {o.verdict for o in second["checked"]} == {replay.MATCH}
    assert any(o.verdict == replay.DIVERGED for o in second["unchecked"])


@needs_testgen
def test_a_program_p4testgen_cannot_parse_is_refused(tmp_path):
    bad = tmp_path / "bad.p4"
    bad.write_text("#include <core.p4>\n#include <v1model.p4>\ncontrol C( { apply { } }\n")
    with pytest.raises(ValueError, match=r"p4testgen cannot compile .*bad\.p4"):
        testgen.generate("bmv2", tmp_path / "out", 1, 1, program=bad)


@needs_testgen
@pytest.mark.bmv2
def test_the_bmv2_programs_generated_tests_pass_on_simple_switch(generated, tmp_path):
    from thc_ps.p4.harness import testgen_switch
    name, gen, tests = generated
    if name != "bmv2" or gen.tables != "free":
        pytest.skip("simple_switch runs the v1model program's tests with free tables (a job-tables "
                    "build holds its jobs as const entries)")
    runs = testgen_switch.run(tests, compile_program(tmp_path))
    failed = [r.line() for r in runs if not r.passed]
    multicast = [r for r in runs if "(multicast to" in r.test]
    print(f"{len(runs) - len(multicast)} tests and {len(multicast)} multicast reruns on simple_switch")
    assert len(runs) - len(multicast) == len(tests) and not failed, failed


def test_the_cli_writes_tests_where_told_and_nowhere_else(tmp_path):
    if NO_TESTGEN:
        pytest.skip(NO_TESTGEN)
    out = tmp_path / "tg"
    cli = subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", "p4", "testgen", "--target", "bmv2", "--max-tests", "3",
                          "--seed", "2", "--out", str(out)], capture_output=True, text=True, timeout=1800)
    assert cli.returncode == 0, cli.stderr
    assert "statement coverage" in cli.stdout and "replayed 3 tests" in cli.stdout
    assert sorted(p.name for p in out.iterdir()) == ["program", "replay.json", "testgen.json", "thc_1.stf", "thc_2.stf",
                                                      "thc_3.stf"]
    again = subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", "p4", "testgen", "--target", "bmv2",
                            "--max-tests", "2", "--seed", "2", "--out", str(out)], capture_output=True, text=True,
                           timeout=1800)
    assert again.returncode == 0, again.stderr          # the earlier run's tests are replaced
    assert sorted(p.name for p in out.glob("*.stf")) == ["thc_1.stf", "thc_2.stf"]
    shutil.rmtree(out)


def model_answer(test, outcome):
    """The Tofino model of tests/p4/test_tna_model.py (TnaSlots, which the scripted sequence
    runs through) on one generated test the replay compared: its registers from the test's,
    then pass 1 or pass 2 of the test's packet.  Returns (model's answer, p4testgen's), each
    in the model's terms; None when the test is not one of the model's (validation, L2)."""
    from tests.p4.test_tna_model import TnaSlots
    pass2 = outcome.what.startswith("pass 2")
    if not (pass2 or outcome.what.startswith("pass 1") or outcome.what in ("STRAGGLER", "dropped in pass 1: ahead")):
        return None
    frame = test.packet[replay.BRIDGE_BYTES:] if pass2 else test.packet
    h = H.parse(replay.datagram(frame))[0]
    (job_entry,) = test.table("thc_job")
    n, quorum = job_entry.param("n"), job_entry.param("quorum")
    from thc_ps.p4.control import switch_job
    model = TnaSlots(switch_job(n, quorum=quorum / n, slots=max(h.slot + 1, 1), norm_slots=1))
    s = h.slot
    for name in ("round_reg", "offset_reg", "arrived_reg", "contrib_reg"):
        if s in test.register(name):
            getattr(model, name)[s] = test.register(name)[s]
    got = None
    if test.expected is not None:
        if test.out_port == job_entry.param("recirc_port") and not pass2:
            b = replay.bridge_fields(test.expected)
            got = {k: b[k] for k in ("kind", "cb", "seen", "shadow_cb", "off_old")}
        else:
            r, payload = H.parse(replay.datagram(test.expected))
            got = ("straggler", r.round) if r.type == H.STRAGGLER else \
                ("unicast", r.contributors << 24 | r.bitmap, tuple(np.frombuffer(bytes(payload), np.uint8)))
    if not pass2:
        where, result = model.pass1(h)
        if where == "done":
            return result[2], got
        kinds = {"first": replay.K_FIRST, "same": replay.K_SAME, "prev": replay.K_PREV}
        mine = {k: result.get(k, 0) for k in ("cb", "seen", "shadow_cb", "off_old")}
        return {"kind": kinds[result["kind"]], **mine}, got
    b = replay.bridge_fields(test.packet)
    bridge = {"kind": {replay.K_FIRST: "first", replay.K_SAME: "same", replay.K_PREV: "prev"}[b["kind"]],
              **{k: b[k] for k in ("me", "cb", "seen", "shadow_cb", "off_old")}}
    shadow = test.register("shadow_reg").get(s)
    if shadow is not None:
        model.shadow_reg[s] = (shadow["cb"], shadow["offset"])
    bank = (s << 1) | (h.round & 1)
    norm = h.type == H.NORM
    if norm:
        model.acc[bank] = np.array([test.register("norm_acc").get(bank, 0)], dtype=np.int64)
        values = np.array([int.from_bytes(frame[replay.PAYLOAD_AT:replay.PAYLOAD_AT + 4], "big")], dtype=np.int64)
    else:
        model.acc[bank] = np.array(replay._lanes(test, bank, False), dtype=np.uint8)
        table = replay.lookup_table(test, None)
        values = np.array([table.get(int(z), 0) for z in replay.indices(frame)], dtype=np.uint8)
    out = model.pass2(h, values, bridge)[2]
    if out is not None and out[0] == "mcast":
        out = None                                  # p4testgen drops a multicast packet
    return (out[0], out[1], tuple(int(x) for x in out[2])) if out and out[0] == "unicast" else out, got


@needs_testgen
def test_the_tofino_model_takes_every_generated_step_as_the_program_does(generated):
    """The model the scripted sequence runs through, step for step against p4testgen's
    execution of the Tofino program: from each compared test's registers, the model's pass
    1 or pass 2 gives p4testgen's expected output — so chaining the model's steps, which
    p4testgen cannot do, chains the program's."""
    name, gen, tests = generated
    if name != "tofino":
        pytest.skip("the model is of the Tofino program")
    _slots_compared(gen)
    checked = 0
    for test, outcome in zip(tests, replay.replay(tests, name)):
        if outcome.verdict not in (replay.MATCH, replay.UNMODELED):
            continue
        pair = model_answer(test, outcome)
        if pair is None:
            continue
        mine, got = pair
        assert mine == got, (test.name, outcome.what, mine, got)
        checked += 1
    print(f"model steps checked against p4testgen: {checked}")
    assert checked >= 5
