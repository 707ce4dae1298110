"""Two THC jobs at once in one bmv2 switch, programmed by the control plane `thc p4 run` uses
(thc_ps.p4.control.SwitchEngine): each job in its own region of the slot registers, job cell
(multicast group, counters) and lookup tables.  Every packet — interleaved, random, with
packets of the wrong job, the wrong region, the wrong nonce or token — gives the same output
as the software PS's twin (thc_ps.ps_server.engine.JobTable over thc_ps.ps_server.reference.ReferencePS in
the same regions of one SlotSpace), and the counters agree block by block.  Once per control
plane (`control`); and a batch the switch rejects through P4Runtime (a full table, a P4Info
that is not the loaded program's) leaves nothing of the job, whose next start is exact."""
import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from thc_ps.p4 import entries as E
from thc_ps.p4.control import SwitchEngine, SwitchRejected, WorkerPort, apply, events, switch_job
from thc_ps.p4.harness.veth_switch import VethSwitch
from thc_ps.p4.spec import DROPS, MAX_JOBS, SLOTS
from thc_ps.proto import headers as H
from thc_ps.proto.job import JobConfig
from thc_ps.proto.packing import pack_indices
from thc_ps.ps_server.engine import JobTable
from thc_ps.ps_server.reference import ReferencePS, SlotSpace

pytestmark = pytest.mark.bmv2

PS_IP, PS_MAC, PS_PORT = "10.0.0.254", "00:00:00:00:00:fe", 9000
HOSTS = 5
PORTS = [WorkerPort(i, f"10.0.0.{i + 1}", 5000 + i, f"00:00:00:00:00:{i + 1:02x}", i + 1) for i in range(HOSTS)]
TOPOLOGY = {w.ip: (w.switch_port, w.mac) for w in PORTS}


class Job:
    """One job as both sides see it: config, nonce, tokens, which host each rank is on, region."""

    def __init__(self, config, nonce, hosts, base):
        self.config, self.nonce, self.hosts, self.base = config, nonce, hosts, base
        self.tokens = [(nonce * 7 + 101 * r) & 0xFFFFFFFF for r in range(config.num_workers)]

    def host(self, rank):
        return PORTS[self.hosts[rank]]

    def datagram(self, rank, slot, rnd, rng, kind=H.DATA, **override):
        c = self.config
        fields = dict(job_id=c.job_id, worker_id=rank, num_workers=c.num_workers, slot=slot, round=rnd,
                      offset=32 * (rnd % 3), nonce=self.nonce, token=self.tokens[rank])
        if kind == H.NORM:
            payload = H.float_to_ordered(np.array([rng.random() * 10], np.float32)).astype(">u4").tobytes()
            fields.update(type=H.NORM, elem_bits=32, count=1, op=H.OP_MAX_U32)
        else:
            payload = pack_indices(rng.integers(0, 16, c.elems_per_packet).astype(np.uint8), 4).tobytes()
            fields.update(type=H.DATA, elem_bits=4, count=c.elems_per_packet, op=H.OP_LOOKUP_SUM)
        fields.update(override)
        return H.build(H.Header(**fields), payload)


def start(switch, table, space, job):
    """Program `job` on the switch (the SwitchEngine path) and in the software twin."""
    engine = switch.start_job(job.config, job.nonce, job.base)
    ps = ReferencePS(job.config, job.nonce, space, job.base, notices=False)    # a switch sends no notices
    table.add(job.config.job_id, ps)
    for rank in range(job.config.num_workers):
        w = job.host(rank)
        engine.register(rank, w.ip, w.udp_port, job.tokens[rank])
        ps.register(rank, w.ip, w.udp_port, job.tokens[rank])
    return engine, ps


def exchange(sw, table, host, dgram):
    """One datagram from `host` into both: their outputs as sorted [(dest ip, port, THC bytes)]."""
    sw.send(host.switch_port, bytes(Ether(dst=PS_MAC, src=host.mac) / IP(src=host.ip, dst=PS_IP) /
                                    UDP(sport=host.udp_port, dport=PS_PORT, chksum=0) / dgram))
    got = []
    for port, raw in sw.drain(0.25):
        pkt = Ether(raw)
        if UDP in pkt and pkt[UDP].sport == PS_PORT:
            dest = PORTS[port - 1]
            assert pkt[Ether].dst == dest.mac and pkt[IP].dst == dest.ip, "a replica left by the wrong port"
            got.append((pkt[IP].dst, pkt[UDP].dport, bytes(pkt[UDP].payload)))
    want = [(a[0], a[1], p) for p, a in table.process(dgram, (host.ip, host.udp_port))]
    assert sorted(got) == sorted(want)
    return got


@pytest.fixture
def two_jobs(thc_json, control):
    sw = VethSwitch(thc_json, HOSTS, control=control)
    try:
        switch = SwitchEngine(sw.control, TOPOLOGY, PS_MAC)
        space, table = SlotSpace(SLOTS), JobTable()
        a = Job(switch_job(3, slots=6, norm_slots=2, job_id=5, granularity=30), 0xA11CE, [0, 1, 2], base=10)
        b = Job(switch_job(2, slots=4, norm_slots=2, job_id=9, granularity=50, seed=3), 0xB0B, [3, 4], base=40)
        jobs = {"a": (a, *start(switch, table, space, a)), "b": (b, *start(switch, table, space, b))}
        yield sw, switch, table, space, jobs
    finally:
        sw.close()


def random_packet(job, other, rng, rounds):
    """A packet of `job`: mostly good traffic (loss, duplicates, late, stale rounds), some with
    another job's id, a slot past the region, another job's nonce or another rank's token."""
    c = job.config
    rank = int(rng.integers(0, c.num_workers))
    norm = rng.random() < 0.15
    slot = int(c.slots + rng.integers(0, c.norm_slots)) if norm else int(rng.integers(0, c.slots))
    r = max(1, int(rounds[slot] + rng.choice([-2, -1, 0, 0, 0, 1])))
    if rng.random() < 0.2:
        rounds[slot] += 1
    kind = H.NORM if norm else H.DATA
    roll = rng.random()
    if roll < 0.04:
        return rank, job.datagram(rank, slot, r, rng, kind, job_id=other.config.job_id)
    if roll < 0.08:
        return rank, job.datagram(rank, c.slots + c.norm_slots + int(rng.integers(0, 30)), r, rng, kind)
    if roll < 0.11:
        return rank, job.datagram(rank, slot, r, rng, kind, nonce=other.nonce)
    if roll < 0.14 and c.num_workers > 1:
        return rank, job.datagram(rank, slot, r, rng, kind, token=job.tokens[(rank + 1) % c.num_workers])
    return rank, job.datagram(rank, slot, r, rng, kind)


def counters_agree(sw, table, jobs, switch_engines):
    assert {k: v for k, v in events(sw.control, 0).items() if k in DROPS and v} == \
        {k: v for k, v in table.drops.items() if v}
    for job, engine, ps in switch_engines:
        mine = engine.stats()
        assert mine["drops"] == {k: ps.stats.drops.get(k, 0) for k in DROPS}, job.config.job_id
        assert mine["rounds_completed"] == ps.stats.counters["rounds_completed"]


@pytest.mark.parametrize("seed", [0, 1])
def test_two_jobs_interleaved_match_the_software_ps(two_jobs, seed):
    sw, switch, table, space, jobs = two_jobs
    (a, ea, pa), (b, eb, pb) = jobs["a"], jobs["b"]
    rng = np.random.default_rng(seed)
    rounds = {"a": np.ones(8, np.int64), "b": np.ones(6, np.int64)}
    outputs = {"a": 0, "b": 0}
    for _ in range(110):
        name = "a" if rng.random() < 0.55 else "b"
        job, other = (a, b) if name == "a" else (b, a)
        rank, dgram = random_packet(job, other, rng, rounds[name])
        outputs[name] += len(exchange(sw, table, job.host(rank), dgram))
    assert outputs["a"] > 10 and outputs["b"] > 5
    counters_agree(sw, table, jobs, [(a, ea, pa), (b, eb, pb)])
    # each job's registers outside its region are untouched: a fresh round in b's slots sums
    # only b's packets
    rng2 = np.random.default_rng(99)
    pkts = [b.datagram(rank, 1, 1000, rng2) for rank in range(2)]
    exchange(sw, table, b.host(0), pkts[0])
    full = exchange(sw, table, b.host(1), pkts[1])
    assert len(full) == 2 and H.parse(full[0][2])[0].contributors == 2


def test_a_job_ends_and_another_takes_its_region_and_cell(two_jobs):
    sw, switch, table, space, jobs = two_jobs
    (a, ea, pa), (b, eb, pb) = jobs["a"], jobs["b"]
    rng = np.random.default_rng(5)
    for rank in range(3):                          # a leaves sums and rounds in its region
        exchange(sw, table, a.host(rank), a.datagram(rank, 2, 7, rng))
    assert ea.stats()["rounds_completed"] == 1
    cell = ea.cell
    ea.close()
    table.remove(a.config.job_id)
    pa.close()
    assert exchange(sw, table, a.host(0), a.datagram(0, 2, 8, rng)) == []    # a's packets: no job
    assert events(sw.control, 0)["unknown_job"] == 1
    c = Job(switch_job(2, slots=6, norm_slots=2, job_id=5, granularity=40, seed=8), 0xC0FFEE, [0, 1], base=10)
    ec, pc = start(switch, table, space, c)
    assert ec.cell == cell and ec.stats()["rounds_completed"] == 0         # counters cleared
    # the old job's packet with the old nonce is not the new job's; rounds start from 1
    assert exchange(sw, table, a.host(0), a.datagram(0, 2, 8, rng)) == []
    for rnd in (1, 2):
        out = [exchange(sw, table, c.host(rank), c.datagram(rank, 2, rnd, rng)) for rank in range(2)]
        assert out[0] == [] and len(out[1]) == 2 and H.parse(out[1][0][2])[0].contributors == 2
    for rank in range(2):                          # b still runs beside it
        out = exchange(sw, table, b.host(rank), b.datagram(rank, 0, 1, rng))
    assert len(out) == 2
    counters_agree(sw, table, jobs, [(c, ec, pc), (b, eb, pb)])


def test_the_switch_refuses_what_it_cannot_hold(two_jobs):
    sw, switch, table, space, jobs = two_jobs
    with pytest.raises(ValueError, match="past the switch's"):
        switch.start_job(switch_job(2, slots=64, norm_slots=8, job_id=11), 1, SLOTS - 10)
    with pytest.raises(ValueError, match="codec thc with b=4"):
        switch.start_job(JobConfig(num_workers=2, job_id=11, codec="none"), 1, 100)
    extra = [switch.start_job(switch_job(2, slots=4, norm_slots=1, job_id=20 + k), 7 + k, 100 + 5 * k)
             for k in range(MAX_JOBS - 2)]
    with pytest.raises(ValueError, match=f"holds {MAX_JOBS} jobs"):
        switch.start_job(switch_job(2, slots=4, norm_slots=1, job_id=40), 1, 200)
    extra[0].close()
    assert switch.start_job(switch_job(2, slots=4, norm_slots=1, job_id=40), 1, 200).cell == extra[0].cell


def leaves_nothing(ctl, job_id: int, cell: int) -> bool:
    """No entry of the job's id in the THC tables keyed by job id, no replica rewrite and no
    multicast group of its cell."""
    keyed = [t for t in E.THC_TABLES if t != E.REPLICA]
    return (not [t for t in keyed if any(k[0] == job_id for k in ctl.table_keys(t))]
            and not [k for k in ctl.table_keys(E.REPLICA) if k[0] // 32 == cell] and cell not in ctl.groups())


def third_job_is_exact(sw, switch, table, space, jobs, job_id):
    """A job started after the rejection, in the region and cell the rejected one would have
    had: every output equal to the software twin's."""
    c = Job(switch_job(2, slots=4, norm_slots=2, job_id=job_id, granularity=40, seed=2), 0xC0DE, [0, 1], base=60)
    ec, pc = start(switch, table, space, c)
    rng = np.random.default_rng(3)
    for rnd in (1, 2, 3):
        out = [exchange(sw, table, c.host(rank), c.datagram(rank, 1, rnd, rng)) for rank in range(2)]
        assert out[0] == [] and len(out[1]) == 2 and H.parse(out[1][0][2])[0].contributors == 2
    counters_agree(sw, table, jobs, [(c, ec, pc)] + [(j, e, p) for j, e, p in jobs.values()])


def test_a_full_table_rejects_a_job_through_p4runtime_and_leaves_nothing(two_jobs, control):
    if control != "p4runtime":
        pytest.skip("the P4Runtime control plane's rejections")
    sw, switch, table, space, jobs = two_jobs
    ctl = sw.control
    size = ctl.p4info.table(E.lut(7)).size
    fill = [("insert", E.entry(E.lut(7), (100 + k // 16, k % 16), f"{E.ING}.set_v7", (0,)))
            for k in range(size - len(ctl.table_keys(E.lut(7))))]
    apply(ctl, fill)                                    # lut7 is full now
    cell = min(set(range(1, 9)) - set(switch.cells))
    with pytest.raises(SwitchRejected) as exc:
        switch.start_job(switch_job(2, slots=4, norm_slots=2, job_id=12), 0xC0DE, 60)
    assert f"table {E.lut(7)} entry (hdr.thc.job_id=12, hdr.idx.z7=0)" in str(exc.value)
    assert "everything else of the batch was taken back" in str(exc.value)
    assert leaves_nothing(ctl, 12, cell) and cell not in switch.cells
    apply(ctl, [("delete", e) for _, e in fill])
    third_job_is_exact(sw, switch, table, space, jobs, 12)


def test_a_p4info_not_of_the_loaded_program_is_rejected_and_leaves_nothing(two_jobs, control):
    if control != "p4runtime":
        pytest.skip("the P4Runtime control plane's rejections")
    from thc_ps.p4.p4runtime import P4Info
    sw, switch, table, space, jobs = two_jobs
    ctl = sw.control
    right = ctl.p4info
    stale = type(right.message)()
    stale.CopyFrom(right.message)
    for t in stale.tables:                  # another build of the program: lut3 under another id
        if t.preamble.name == E.lut(3):
            t.preamble.id += 0x7F
    ctl.p4info = P4Info(stale)
    cell = min(set(range(1, 9)) - set(switch.cells))
    with pytest.raises(SwitchRejected, match=rf"rejected 16 of .*table {E.lut(3)} entry"):
        switch.start_job(switch_job(2, slots=4, norm_slots=2, job_id=13), 0xC0DE, 60)
    ctl.p4info = right
    assert leaves_nothing(ctl, 13, cell) and cell not in switch.cells
    third_job_is_exact(sw, switch, table, space, jobs, 13)
