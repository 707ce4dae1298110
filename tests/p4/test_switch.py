"""The THC P4 program under bmv2: one behaviour per test, each checked against the software PS
(thc_ps.ps_server.reference) fed the same packets — same packets in, same out.  Every test runs once
per control plane (`control`: simple_switch + Thrift CLI, simple_switch_grpc + P4Runtime)."""
import itertools

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from thc_ps.p4 import entries as E
from thc_ps.p4.control import WorkerPort, apply, events, switch_job
from thc_ps.p4.harness.veth_switch import VethSwitch
from thc_ps.proto import headers as H
from thc_ps.proto.packing import pack_indices
from thc_ps.proto.scapy_layers import THC
from thc_ps.p4.spec import MAX_JOBS
from thc_ps.ps_server.reference import ReferencePS

pytestmark = pytest.mark.bmv2

N = 4
PS_IP, PS_MAC, PS_PORT = "10.0.0.254", "00:00:00:00:00:fe", 9000
WORKERS = [WorkerPort(i, f"10.0.0.{i + 1}", 5000 + i, f"00:00:00:00:00:{i + 1:02x}", i + 1) for i in range(N)]
OTHER_MAC = "00:00:00:00:00:99"     # a plain host on port N + 1
NONCE = 0x5EED1234                  # the job's identity, as the control plane would draw it
TOKENS = [0x7000 + 13 * i for i in range(N)]
#: A second job on the switch, same workers, partial aggregation: its own id, region and cell.
QUORUM_JOB_ID, QUORUM_BASE, QUORUM_CELL = 2, 16, 2


def make_switch(thc_json, jobs, control):
    """The switch with `jobs` programmed in one batch: [(job, base, cell)], every worker in each."""
    sw = VethSwitch(thc_json, N + 1, control=control)
    writes = [("insert", e) for e in E.l2_entries({OTHER_MAC: N + 1, WORKERS[0].mac: 1})]
    for job, base, cell in jobs:
        writes += E.job_writes(job, PS_MAC, NONCE, base, cell, epoch=cell)
        writes += [("insert", e) for w in WORKERS
                   for e in (E.worker_entry(w, TOKENS[w.worker_id], job.job_id), E.replica_entry(w, cell))]
        writes.append(("modify", E.McGroup(cell, tuple((w.switch_port, E.rid(cell, w.worker_id)) for w in WORKERS))))
    apply(sw.control, writes)
    return sw


def reset(sw, jobs, epochs):
    """Each job's slots unused again (a new epoch in its config entry: no register is
    written) and every counter zero."""
    writes = [("modify", E.config_entry(job, PS_MAC, NONCE, base, cell, next(epochs))) for job, base, cell in jobs]
    apply(sw.control, writes + [("modify", E.CounterCells(c, 0, n)) for c, n in E.COUNTERS.items()])


def reference(job):
    ps = ReferencePS(job, NONCE, notices=False)       # a switch sends no loss notices
    for w in WORKERS:
        ps.register(w.worker_id, w.ip, w.udp_port, TOKENS[w.worker_id])
    return ps


def datagram(job, worker, slot, rnd, rng, offset=0, kind=H.DATA):
    if kind == H.NORM:
        payload = H.float_to_ordered(np.array([rng.random() * 10], np.float32)).astype(">u4").tobytes()
        return H.build(H.Header(type=H.NORM, job_id=job.job_id, worker_id=worker, num_workers=N,
                                elem_bits=32, slot=slot, round=rnd, offset=offset, count=1,
                                op=H.OP_MAX_U32, nonce=NONCE, token=TOKENS[worker]), payload)
    z = rng.integers(0, 16, job.elems_per_packet).astype(np.uint8)
    return H.build(H.Header(type=H.DATA, job_id=job.job_id, worker_id=worker, num_workers=N, elem_bits=4,
                            slot=slot, round=rnd, offset=offset, count=job.elems_per_packet,
                            op=H.OP_LOOKUP_SUM, nonce=NONCE, token=TOKENS[worker]), pack_indices(z, 4).tobytes())


def frame(worker, dgram):
    w = WORKERS[worker]
    return bytes(Ether(dst=PS_MAC, src=w.mac) / IP(src=w.ip, dst=PS_IP) /
                 UDP(sport=w.udp_port, dport=PS_PORT, chksum=0) / dgram)


def switch_out(sw, worker, dgram):
    """Send one datagram from `worker`; the switch's outputs as sorted [(dest ip, port, THC bytes)]."""
    sw.send(worker + 1, frame(worker, dgram))
    out = []
    for port, raw in sw.drain(0.25):
        pkt = Ether(raw)
        if THC not in pkt:
            continue
        ip, udp = pkt[IP], pkt[UDP]
        assert pkt[Ether].dst == WORKERS[port - 1].mac and port == WORKERS[port - 1].switch_port
        assert ip.src == PS_IP and udp.sport == PS_PORT
        out.append((ip.dst, udp.dport, bytes(udp.payload)))
    return sorted(out)


def ref_out(ps, worker, dgram):
    w = WORKERS[worker]
    return sorted((a[0], a[1], pkt) for pkt, a in ps.process(dgram, (w.ip, w.udp_port)))


def quorum_job():
    return switch_job(N, slots=8, norm_slots=2, quorum=0.75, job_id=QUORUM_JOB_ID)


JOBS = [(switch_job(N, slots=8, norm_slots=2), 0, 1), (quorum_job(), QUORUM_BASE, QUORUM_CELL)]


@pytest.fixture(scope="module")
def env(thc_json, control):
    sw = make_switch(thc_json, JOBS, control)
    sw.epochs = itertools.count(MAX_JOBS + 1)
    yield sw, JOBS[0][0]
    sw.close()


@pytest.fixture
def fresh(env):
    sw, job = env
    reset(sw, JOBS, sw.epochs)
    return sw, job, reference(job), np.random.default_rng(0)


def both(sw, ps, worker, dgram):
    got, want = switch_out(sw, worker, dgram), ref_out(ps, worker, dgram)
    assert got == want
    return got


def test_basic_reduction(fresh):
    sw, job, ps, rng = fresh
    pkts = [datagram(job, w, 3, 1, rng) for w in range(N)]
    for w in range(N - 1):
        assert both(sw, ps, w, pkts[w]) == []
    out = both(sw, ps, N - 1, pkts[N - 1])
    assert len(out) == N
    h, _ = H.parse(out[0][2])
    assert (h.type, h.contributors, h.bitmap) == (H.RESULT, N, 0b1111)


def test_straggler_notification(fresh):
    sw, job, ps, rng = fresh
    both(sw, ps, 0, datagram(job, 0, 2, 5, rng))
    out = both(sw, ps, 1, datagram(job, 1, 2, 3, rng))
    h, _ = H.parse(out[0][2])
    assert len(out) == 1 and (h.type, h.round, h.worker_id) == (H.STRAGGLER, 5, 1)


def test_ignored_duplicate(fresh):
    sw, job, ps, rng = fresh
    p = datagram(job, 0, 1, 1, rng)
    assert both(sw, ps, 0, p) == [] and both(sw, ps, 0, p) == []
    for w in range(1, N):
        out = both(sw, ps, w, datagram(job, w, 1, 1, rng))
    h, _ = H.parse(out[0][2])
    assert h.contributors == N      # the duplicate was not counted twice


def test_retransmission_after_completion(fresh):
    sw, job, ps, rng = fresh
    pkts = [datagram(job, w, 4, 1, rng) for w in range(N)]
    for w in range(N):
        full = both(sw, ps, w, pkts[w])
    again = both(sw, ps, 2, pkts[2])
    assert len(again) == 1 and again[0][0] == WORKERS[2].ip
    h, payload = H.parse(again[0][2])
    assert h.flags & H.F_RESENT and bytes(payload) == bytes(H.parse(full[0][2])[1])


def test_partial_aggregation_at_quorum(env):
    sw, _ = env
    job = quorum_job()
    reset(sw, JOBS, sw.epochs)
    ps, rng = reference(job), np.random.default_rng(1)
    both(sw, ps, 0, datagram(job, 0, 0, 1, rng))
    both(sw, ps, 1, datagram(job, 1, 0, 1, rng))
    out = both(sw, ps, 2, datagram(job, 2, 0, 1, rng))
    assert len(out) == N and H.parse(out[0][2])[0].contributors == 3
    late = both(sw, ps, 3, datagram(job, 3, 0, 1, rng))
    assert len(late) == 1 and late[0][0] == WORKERS[3].ip
    ev = events(sw.control, QUORUM_CELL)
    assert (ev["rounds_completed"], ev["partial_rounds"], ev["late"]) == (1, 1, 1)


def test_slot_reuse_and_shadow_copy(fresh):
    sw, job, ps, rng = fresh
    for rnd in (1, 2, 3):
        pkts = [datagram(job, w, 5, rnd, rng, offset=32 * rnd) for w in range(N)]
        for w in range(N):
            out = both(sw, ps, w, pkts[w])
        assert len(out) == N and H.parse(out[0][2])[0].round == rnd
    both(sw, ps, 0, datagram(job, 0, 5, 4, rng, offset=128))
    shadow = both(sw, ps, 1, pkts[1])        # round 3 resent while round 4 fills
    assert len(shadow) == 1 and H.parse(shadow[0][2])[0].round == 3


def test_norm_max(fresh):
    sw, job, ps, rng = fresh
    for w in range(N):
        out = both(sw, ps, w, datagram(job, w, job.slots, 1, rng, kind=H.NORM))
    assert len(out) == N and H.parse(out[0][2])[0].type == H.NORM_RESULT


def test_non_thc_traffic_is_forwarded(fresh):
    sw, _, _, _ = fresh
    f = bytes(Ether(dst=OTHER_MAC, src=WORKERS[0].mac) / IP(src=WORKERS[0].ip, dst="10.0.0.99") /
              UDP(sport=1234, dport=4321) / b"hello")
    sw.send(1, f)
    out = sw.drain(0.25)
    assert [(p, raw[:len(f)]) for p, raw in out] == [(N + 1, f)]


def test_malformed_and_unregistered_are_dropped(fresh):
    sw, job, ps, rng = fresh
    good = datagram(job, 0, 1, 1, rng)
    for bad in (good[:2] + b"\x09" + good[3:], good[:8] + b"\x00\x07" + good[8 + 2:],
                good[:10] + b"\x00\x63" + good[12:]):
        assert both(sw, ps, 0, bad) == []
    sw.send(1, bytes(Ether(dst=PS_MAC, src=WORKERS[0].mac) / IP(src="10.0.0.77", dst=PS_IP) /
                     UDP(sport=5000, dport=PS_PORT, chksum=0) / good))
    assert sw.drain(0.25) == []
    switch, mine = events(sw.control, 0), events(sw.control, 1)      # no job's; the job's (cell 1)
    assert (switch["wrong_version"], switch["unknown_job"]) == (1, 1)
    assert (mine["slot_out_of_range"], mine["unregistered"]) == (1, 1)
    assert mine["wrong_version"] == mine["unknown_job"] == switch["slot_out_of_range"] == 0


def test_differential_random_sequence(fresh):
    """Loss, duplicates, late and stale rounds: identical outputs from bmv2 and the software PS."""
    sw, job, ps, rng = fresh
    rounds = np.ones(job.slots, dtype=np.int64)
    compared = 0
    for _ in range(150):
        slot = int(rng.integers(0, 3))
        w = int(rng.integers(0, N))
        r = int(rounds[slot] + rng.choice([-2, -1, 0, 0, 0, 1]))
        if rng.random() < 0.15:
            rounds[slot] += 1
        got = both(sw, ps, w, datagram(job, w, slot, max(r, 1), rng, offset=32 * (max(r, 1) % 3)))
        compared += len(got)
    assert compared > 20


def test_job_nonce_token_and_round_window(fresh):
    """The switch checks the job identity like the software PS: another job's nonce, another
    rank's token and a round beyond the window are dropped and counted; the slot still works."""
    sw, job, ps, rng = fresh

    def patched(dgram, at, value):
        return dgram[:at] + value.to_bytes(4, "big") + dgram[at + 4:]
    good = datagram(job, 0, 2, 1, rng)
    assert both(sw, ps, 0, patched(good, 32, NONCE ^ 0xFF)) == []          # a previous job's nonce
    assert both(sw, ps, 0, patched(good, 36, TOKENS[1])) == []             # rank 1's token
    assert both(sw, ps, 0, patched(good, 12, 0xFFFFFFFF)) == []            # far-future round
    ev = events(sw.control, 1)                 # a known job id with a wrong nonce counts in its block
    assert (ev["unknown_job"], ev["unregistered"], ev["ahead"]) == (1, 1, 1)
    for w in range(N):
        out = both(sw, ps, w, datagram(job, w, 2, 1, rng))
    h, _ = H.parse(out[0][2])
    assert len(out) == N and (h.nonce, h.token, h.contributors) == (NONCE, 0, N)
