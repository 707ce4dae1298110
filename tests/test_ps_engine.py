"""The C engine against the reference PS: identical outputs on identical packet sequences."""
import zlib

import numpy as np
import pytest

from thc_ps.proto import headers as H
from thc_ps.proto.job import JobConfig
from thc_ps.proto.packing import pack_indices, unpack_lanes
from thc_ps.ps_server.reference import ReferencePS
from thc_ps.ps_server.server import make_engine

ADDRS = [("127.0.0.1", 5000 + i) for i in range(4)]
NONCE = 0xC0FFEE42                                  # the job's identity
TOKENS = [0x1000 + 77 * i for i in range(4)]        # each registration's token


def stable_seed(*parts) -> int:
    """A seed that is the same in every process (hash() of a str is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def engines_for(job):
    return ReferencePS(job, NONCE), make_engine(job, "c", NONCE)


def job_for(codec="thc", quorum=1.0, lane_bits=8, bits=4, granularity=30):
    return JobConfig(num_workers=4, codec=codec, slots=4, norm_slots=2, elems_per_packet=16,
                     quorum=quorum, lane_bits=lane_bits, bits=bits, granularity=granularity)


def data_packet(job, rng, worker, slot, rnd, offset=0, count=16, ptype=H.DATA):
    if ptype == H.NORM:
        payload = rng.random(count).astype(">f4").tobytes()
        bits, op = 32, H.OP_MAX_U32
    elif job.codec == "thc":
        payload = pack_indices(rng.integers(0, 1 << job.bits, count).astype(np.uint8), job.bits).tobytes()
        bits, op = job.bits, job.op
    else:
        payload = rng.standard_normal(count).astype(">f4").tobytes()
        bits, op = 32, job.op
    return H.build(H.Header(type=ptype, job_id=job.job_id, worker_id=worker, num_workers=4,
                            elem_bits=bits, slot=slot, round=rnd, offset=offset, count=count, op=op,
                            nonce=NONCE, token=TOKENS[worker]), payload)


def corrupt(pkt, rng):
    kind = rng.integers(0, 12)
    b = bytearray(pkt)
    if kind == 0:
        return bytes(b[:int(rng.integers(0, len(b)))])
    if kind == 1:
        b[2] = 9                     # version
    elif kind == 2:
        b[8:10] = b"\x77\x77"        # job
    elif kind == 3:
        b[10:12] = b"\x00\x63"       # slot out of range
    elif kind == 4:
        b[5] = 40                    # worker id out of range
    elif kind == 5:
        b[20:22] = b"\x00\x05"       # count disagrees with payload
    elif kind == 6:
        b[7] = 7                     # elem bits
    elif kind == 7:
        b[3] = H.RESULT              # workers never send results
    elif kind == 9:
        b[32:36] = b"\x0b\xad\xf0\x0d"  # another job's (or a stale) nonce
    elif kind == 10:
        b[36:40] = b"\x00\x00\x00\x01"  # a token the sender was not given
    elif kind == 11:
        b[12:16] = (int.from_bytes(b[12:16], "big") + H.ROUND_WINDOW + 7).to_bytes(4, "big")  # far ahead
    else:
        b[6] = 3                     # num_workers mismatch
    return bytes(b)


def sequence(job, seed, length=3000):
    """Random traffic: valid rounds with loss, duplicates, late and stale rounds, garbage."""
    rng = np.random.default_rng(seed)
    rounds = np.ones(job.slots + job.norm_slots, dtype=np.int64)
    seq = []
    for _ in range(length):
        slot = int(rng.integers(0, job.slots + job.norm_slots))
        ptype = H.NORM if slot >= job.slots else H.DATA
        w = int(rng.integers(0, 4))
        r = int(rounds[slot] + rng.choice([-2, -1, 0, 0, 0, 0, 1]))
        if rng.random() < 0.08:
            rounds[slot] += 1
        pkt = data_packet(job, np.random.default_rng(abs(r) * 31 + w * 7 + slot), w, slot, max(r, 0),
                          offset=16 * (r % 3), ptype=ptype)
        addr = ADDRS[w]
        u = rng.random()
        if u < 0.1:
            pkt = corrupt(pkt, rng)
        elif u < 0.13:
            addr = ("127.0.0.9", 5000 + w)           # unregistered source
        seq.append((pkt, addr))
    return seq


def register_all(engine):
    for i, (ip, port) in enumerate(ADDRS):
        engine.register(i, ip, port, TOKENS[i])


def run(engine, seq):
    register_all(engine)
    return [engine.process(p, a) for p, a in seq]


@pytest.mark.parametrize("codec,quorum,lane_bits,bits,g", [
    ("thc", 1.0, 8, 4, 30), ("thc", 0.75, 8, 4, 30), ("thc", 1.0, 16, 3, 100),
    ("thc", 0.5, 32, 2, 10), ("none", 1.0, 8, 4, 30), ("thc", 1.0, 16, 8, 300), ("thc", 1.0, 7, 5, 31),
    ("thc", 0.75, 8, 6, 63), ("thc", 1.0, 16, 7, 200)])
def test_c_engine_matches_reference(codec, quorum, lane_bits, bits, g):
    job = job_for(codec, quorum, lane_bits, bits, g)
    seed = stable_seed(codec, quorum, lane_bits, bits)
    seq = sequence(job, seed=seed)
    ref, fast = engines_for(job)
    out_ref, out_c = run(ref, seq), run(fast, seq)
    assert out_ref == out_c, f"sequence seed {seed}"
    assert ref.stats() == fast.stats(), f"sequence seed {seed}"
    s = fast.stats()
    assert s["rounds_completed"] > 20 and s["stragglers_notified"] > 0 and s["results_resent"] > 0
    assert s["notices"] > 0
    assert all(s["drops"][k] > 0 for k in ("malformed", "wrong_version", "unknown_job",
                                           "slot_out_of_range", "worker_out_of_range",
                                           "unregistered", "stale", "ahead"))


@pytest.mark.parametrize("kind", ["c", "python"])
def test_round_rules(kind):
    """Basic reduction, duplicate, retransmission after completion, stale → straggler, shadow copy."""
    job = job_for()
    e = make_engine(job, kind, NONCE)
    register_all(e)
    rng = np.random.default_rng(1)
    tab = np.asarray(job.table)
    pkts = [data_packet(job, rng, w, 2, 5) for w in range(4)]
    assert e.process(pkts[0], ADDRS[0]) == []
    assert e.process(pkts[0], ADDRS[0]) == []            # duplicate while incomplete: dropped
    assert e.process(pkts[1], ADDRS[1]) == []
    assert e.process(pkts[2], ADDRS[2]) == []
    out = e.process(pkts[3], ADDRS[3])
    assert [a for _, a in out] == ADDRS                  # fan-out to every worker
    h, payload = H.parse(out[0][0])
    expect = sum(tab[np.frombuffer(bytes(H.parse(p)[1]), np.uint8).repeat(2).reshape(-1, 2)
                     .__rshift__(np.array([4, 0], np.uint8)).__and__(15).ravel()] for p in pkts)
    assert (h.type, h.contributors, h.bitmap, h.round) == (H.RESULT, 4, 0b1111, 5)
    assert unpack_lanes(bytes(payload), 8).tolist() == expect.tolist()
    again = e.process(pkts[1], ADDRS[1])                 # resend after completion: unicast
    assert len(again) == 1 and again[0][1] == ADDRS[1] and H.parse(again[0][0])[0].flags & H.F_RESENT
    e.process(data_packet(job, rng, 0, 2, 6), ADDRS[0])  # next round starts
    shadow = e.process(pkts[2], ADDRS[2])                # round 5 resend: shadow copy still answers
    assert bytes(H.parse(shadow[0][0])[1]) == bytes(payload)
    e.process(data_packet(job, rng, 1, 2, 8), ADDRS[1])  # two rounds on: no shadow for 5 any more
    note = e.process(pkts[3], ADDRS[3])
    h, _ = H.parse(note[0][0])
    assert (h.type, h.round, h.worker_id) == (H.STRAGGLER, 8, 3)


@pytest.mark.parametrize("kind", ["c", "python"])
def test_a_rank_whose_packet_for_a_slot_is_missing_gets_a_notice(kind):
    """Loss notices (docs/protocol.md §3): a slot one contribution short of its quorum without
    rank w, and w's contribution to the next slot at the round that follows: the PS tells w
    (alone) for that slot, naming its round, offset, count, bitmap and contributors — checked
    when w's next packet arrives and when another rank's leaves the slot one short; never for
    a slot w is in, one waiting for two ranks, one whose next slot holds w at another round,
    a NORM slot, or from a switch's rules (notices=False)."""
    job = job_for()
    rng = np.random.default_rng(3)

    def fresh(notices=True):
        if notices:
            e = make_engine(job, kind, NONCE)
        elif kind == "python":
            e = ReferencePS(job, NONCE, notices=False)
        else:
            from thc_ps.ps_server._fastpath import Engine
            e = Engine(job_id=1, num_workers=4, slots=4, norm_slots=2, elems_per_packet=16, bits=4, lane_bits=8,
                       op=job.op, quorum_count=4, table=list(job.table), nonce=NONCE, notices=False)
        register_all(e)

        def send(w, slot, rnd, **kw):
            return [(H.parse(p)[0], a) for p, a in e.process(data_packet(job, rng, w, slot, rnd, **kw), ADDRS[w])]
        return e, send

    # rank 1 behind: its packet for slot 1 lost, the others' there; its packet for slot 2 arrives
    e, send = fresh()
    for w in (0, 2, 3):
        assert send(w, 1, 7, offset=16) == []
    out = send(1, 2, 7, offset=32)
    assert [(h.type, a) for h, a in out] == [(H.NOTICE, ADDRS[1])]
    h = out[0][0]
    assert (h.worker_id, h.slot, h.round, h.offset, h.count, h.bitmap, h.contributors) == (1, 1, 7, 16, 16, 0b1101, 3)
    assert (h.nonce, h.job_id, h.op, h.payload_len, h.token) == (NONCE, 1, job.op, 0, 0)
    assert send(1, 2, 7, offset=32) == []                       # a duplicate: no news
    assert [h.type for h, _ in send(1, 1, 7, offset=16)] == [H.RESULT] * 4     # the resend completes slot 1
    assert e.stats()["notices"] == 1
    # rank 1 ahead: its packet for slot 2 arrived, for slot 1 not; the others' arrive, and the
    # one that leaves slot 1 one short carries the notice to rank 1 (not before: two missing)
    e, send = fresh()
    assert send(1, 2, 7, offset=32) == [] and send(2, 1, 7, offset=16) == [] and send(3, 1, 7, offset=16) == []
    assert [(h.type, h.slot, a) for h, a in send(0, 1, 7, offset=16)] == [(H.NOTICE, 1, ADDRS[1])]
    # the next slot holds the missing rank at another round (an older phase's): no notice
    e, send = fresh()
    for w in range(4):
        send(w, 2, 6, offset=32)                                # slot 2 round 6, complete
    for w in (0, 2, 3):
        assert send(w, 1, 7, offset=16) == []
    assert e.stats()["notices"] == 0
    # the last data slot's next is slot 0, a round on
    e, send = fresh()
    for w in (0, 1, 2):
        send(w, 3, 7, offset=48)
    assert [(h.type, h.slot, h.round, a) for h, a in send(3, 0, 8)] == [(H.NOTICE, 3, 7, ADDRS[3])]
    # NORM phases (one chunk each) and a switch's rules: none
    e, send = fresh()
    for w in (0, 2, 3):
        send(w, job.slots, 2, count=4, ptype=H.NORM)
    assert send(1, job.slots + 1, 2, count=4, ptype=H.NORM) == [] and e.stats()["notices"] == 0
    e, send = fresh(notices=False)
    for w in (0, 2, 3):
        send(w, 1, 1, offset=16)
    assert send(1, 2, 1, offset=32) == [] and e.stats()["notices"] == 0
    # the PS takes no NOTICE (workers send DATA and NORM only): dropped as malformed
    forged = H.build(H.Header(type=H.NOTICE, job_id=1, worker_id=0, num_workers=4, slot=1, round=7,
                              nonce=NONCE, token=TOKENS[0]))
    assert e.process(forged, ADDRS[0]) == [] and e.stats()["drops"]["malformed"] == 1


def test_norm_max_and_float_sum():
    job = job_for("none")
    e = make_engine(job, "c", NONCE)
    register_all(e)
    vals = [np.array([1.5, 2.0, 0.25], np.float32) * (i + 1) for i in range(4)]
    outs = []
    for i in range(4):
        pkt = H.build(H.Header(type=H.NORM, job_id=1, worker_id=i, num_workers=4, elem_bits=32,
                               slot=job.slots, round=1, count=3, op=H.OP_MAX_U32, nonce=NONCE,
                               token=TOKENS[i]), vals[i].astype(">f4").tobytes())
        outs = e.process(pkt, ADDRS[i])
    got = np.frombuffer(bytes(H.parse(outs[0][0])[1]), ">f4")
    assert got.tolist() == np.max(vals, axis=0).tolist()
    for i in range(4):
        pkt = H.build(H.Header(type=H.DATA, job_id=1, worker_id=i, num_workers=4, elem_bits=32, slot=0,
                               round=1, count=3, op=H.OP_FLOAT_SUM, nonce=NONCE,
                               token=TOKENS[i]), vals[i].astype(">f4").tobytes())
        outs = e.process(pkt, ADDRS[i])
    assert np.frombuffer(bytes(H.parse(outs[0][0])[1]), ">f4").tolist() == sum(vals).tolist()


def test_kernel_simd_equals_scalar():
    from thc_ps.ps_server._fastpath import lookup_accumulate
    rng = np.random.default_rng(3)
    tab = [0, 3, 5, 7, 9, 11, 13, 14, 15, 17, 19, 21, 23, 25, 27, 30]
    for count in (1, 63, 64, 65, 4097):
        z = rng.integers(0, 16, count).astype(np.uint8)
        packed = pack_indices(z, 4).tobytes()
        a, b = np.zeros(count, np.uint8), np.zeros(count, np.uint8)
        lookup_accumulate(a, packed, tab, 4)
        lookup_accumulate(b, packed, tab, 4, True)
        assert a.tolist() == b.tolist() == np.asarray(tab)[z].tolist()
        # set: a round's first contribution overwrites whatever the accumulator held
        for force_scalar in (False, True):
            c = rng.integers(0, 256, count).astype(np.uint8)
            lookup_accumulate(c, packed, tab, 4, force_scalar, True)
            assert c.tolist() == np.asarray(tab)[z].tolist()
            lookup_accumulate(c, packed, tab, 4, force_scalar)
            assert c.tolist() == (2 * np.asarray(tab)[z]).tolist()
    for lane, bits in ((np.uint16, 4), (np.uint32, 3), (np.uint8, 2)):   # the generic scalar path
        z = rng.integers(0, 1 << bits, 301).astype(np.uint8)
        packed = pack_indices(z, bits).tobytes()
        c = rng.integers(0, 200, 301).astype(lane)
        lookup_accumulate(c, packed, tab, bits, False, True)
        assert c.tolist() == np.asarray(tab)[z].tolist()


def test_wide_index_lookup_equals_the_table_on_every_path():
    """Indices of b != 4 bits into byte lanes: widened tile by tile (512 indices: counts on
    either side of a tile and of a 64-lane step), looked up by vpermb (b <= 6 on the VBMI path)
    or byte by byte, on every lane-widening path this CPU has; set and add."""
    from thc_ps.ps_server._fastpath import lanes_path, lookup_accumulate
    rng = np.random.default_rng(8)
    for bits in (1, 2, 3, 5, 6, 7, 8):
        tab = rng.integers(0, 128, 1 << bits).tolist()       # any byte values: sums of two fit
        for count in (1, 7, 8, 63, 64, 65, 511, 512, 513, 4097):
            z = rng.integers(0, 1 << bits, count).astype(np.uint8)
            packed = pack_indices(z, bits).tobytes()
            want = np.asarray(tab)[z]
            for path in range(lanes_path() + 1):
                c = rng.integers(0, 256, count).astype(np.uint8)
                lookup_accumulate(c, packed, tab, bits, False, True, path)
                assert c.tolist() == want.tolist(), (bits, count, path)
                lookup_accumulate(c, packed, tab, bits, False, False, path)
                assert c.tolist() == (2 * want).tolist(), (bits, count, path)
    with pytest.raises(ValueError, match="path"):
        lookup_accumulate(np.zeros(8, np.uint8), bytes(5), list(range(32)), 5, False, False, lanes_path() + 1)


@pytest.mark.parametrize("codec", ["thc", "none", "topk"])
def test_random_bytes_never_crash_and_engines_agree(codec):
    """Fuzz: datagrams of random bytes, half of them behind a valid magic/version/job prefix
    and a registered source. Every one is dropped and counted; nothing is answered; C and
    Python engines agree (the BLOB codecs have only the Python path)."""
    job = job_for(codec)
    rng = np.random.default_rng(11)
    seq = []
    for _ in range(4000):
        b = bytearray(rng.bytes(int(rng.integers(0, 200))))
        if rng.random() < 0.5 and len(b) >= H.HEADER_SIZE:
            b[0:3] = b"TH" + bytes([H.VERSION])
            b[8:10] = job.job_id.to_bytes(2, "big")
            if rng.random() < 0.5:
                b[32:36] = NONCE.to_bytes(4, "big")
            b[5] = int(rng.integers(0, 4))
        seq.append((bytes(b), ADDRS[int(rng.integers(0, 4))]))
    engines = [ReferencePS(job, NONCE)] + ([make_engine(job, "c", NONCE)] if not job.blob else [])
    outs = [run(e, seq) for e in engines]
    stats = [e.stats() for e in engines]
    assert all(o == outs[0] for o in outs) and all(s == stats[0] for s in stats)
    s = stats[0]
    answered = sum(len(o) for o in outs[0])
    assert s["packets_in"] == len(seq)
    # random payloads can form a valid packet only by vanishing chance; all must be dropped
    assert answered == 0 and sum(s["drops"].values()) == len(seq), s["drops"]


@pytest.mark.parametrize("kind", ["c", "python"])
def test_job_identity_and_round_window(kind):
    """Only this job's nonce with the sender's own token is aggregated; one far-future round
    cannot wedge a slot (the reproduction: round 0xFFFFFFFF stopped a slot until restart)."""
    job = job_for()
    e = make_engine(job, kind, NONCE)
    register_all(e)
    rng = np.random.default_rng(5)
    stats = e.stats

    def pkt(w, rnd, nonce=NONCE, token=None):
        b = bytearray(data_packet(job, rng, w, 1, rnd))
        b[32:36] = nonce.to_bytes(4, "big")
        b[36:40] = (TOKENS[w] if token is None else token).to_bytes(4, "big")
        return bytes(b)

    assert e.process(pkt(0, 1, nonce=NONCE ^ 1), ADDRS[0]) == []          # a previous job's packet
    assert e.process(pkt(0, 1, token=TOKENS[1]), ADDRS[0]) == []          # another rank's token
    assert e.process(pkt(0, 0xFFFFFFFF), ADDRS[0]) == []                  # far future
    assert e.process(pkt(0, H.ROUND_WINDOW + 1), ADDRS[0]) == []          # just past the window
    d = stats()["drops"]
    assert (d["unknown_job"], d["unregistered"], d["ahead"]) == (1, 1, 2)
    outs = [e.process(pkt(w, 1), ADDRS[w]) for w in range(4)]             # the slot still works
    assert outs[:3] == [[], [], []] and len(outs[3]) == 4
    h, _ = H.parse(outs[3][0][0])
    assert (h.round, h.contributors, h.nonce, h.token) == (1, 4, NONCE, 0)
    assert e.process(pkt(2, 1 + H.ROUND_WINDOW), ADDRS[2]) == []          # within the window: accepted
    assert stats()["drops"]["ahead"] == 2
    e.unregister(2)                                                        # left, or lease expired
    assert e.process(pkt(2, 2 + H.ROUND_WINDOW), ADDRS[2]) == []
    assert stats()["drops"]["unregistered"] == 2


def test_c_engine_constants_are_the_wire_contract():
    """The C engine's compiled-in header size, magic, version, type and op codes, round window
    and counter/drop names equal thc_ps.proto.headers and the reference's tables."""
    from thc_ps.ps_server import _fastpath as C
    from thc_ps.ps_server.reference import COUNTERS, DROP_REASONS
    for name in ("HEADER_SIZE", "MAGIC", "VERSION", "ROUND_WINDOW", "MAX_WORKERS", "DATA", "RESULT",
                 "STRAGGLER", "NORM", "NORM_RESULT", "F_RESENT", "OP_LOOKUP_SUM", "OP_FLOAT_SUM",
                 "OP_MAX_U32"):
        assert getattr(C, name) == getattr(H, name), name
    assert C.HEADER_SIZE == 40
    assert C.DROP_REASONS == DROP_REASONS and C.COUNTERS == COUNTERS
    e = make_engine(job_for(), "c", NONCE)
    assert set(e.stats()["drops"]) == set(DROP_REASONS)


@pytest.mark.parametrize("kind", ["c", "python"])
def test_engines_share_one_protocol(kind):
    """Both software engines are thc_ps.ps_server.engine.Engine: register/unregister by (rank, ip,
    port, token), stats() as a dict; an unregistered rank's packets are dropped as such."""
    from thc_ps.ps_server.engine import Engine
    job = job_for()
    e = make_engine(job, kind, NONCE)
    assert isinstance(e, Engine)
    register_all(e)
    rng = np.random.default_rng(9)
    e.unregister(2)
    assert e.process(data_packet(job, rng, 2, 1, 1), ADDRS[2]) == []
    st = e.stats()
    assert isinstance(st, dict) and st["drops"]["unregistered"] == 1 and st["packets_in"] == 1


def test_switch_engines_follow_the_protocol():
    """The switch engines have the same signatures (checked without bmv2: no switch is run)."""
    import inspect

    from thc_ps.p4.control import SwitchEngine, SwitchJob
    from thc_ps.p4.harness.static_control import StaticEngine
    from thc_ps.ps_server.engine import Engine, ExternalEngine
    for cls in (SwitchJob, StaticEngine, ReferencePS):
        # ReferencePS.stats is its Stats object, callable: checked on instances above
        for name in ("register", "unregister", "process", "serve", "region", "close") + \
                (("stats",) * (cls is not ReferencePS)):
            want = list(inspect.signature(getattr(Engine, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls, name)
    for cls in (SwitchEngine, StaticEngine):            # what the PS needs of a switch
        for name in ("start_job", "serve", "stats"):
            want = list(inspect.signature(getattr(ExternalEngine, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls, name)
    static = StaticEngine({0: ("10.0.0.1", 5000, 7)}, nonce=3)
    assert isinstance(static, ExternalEngine) and static.fixed_tokens == {0: 7}
    with pytest.raises(ValueError, match="not the address"):
        static.register(0, "10.0.0.2", 5000, 7)
