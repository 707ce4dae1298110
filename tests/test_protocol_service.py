"""docs/protocol.md beyond one job on one PS, each rule checked against what the code does: a
restarted PS needs the job again (§7), several shards (§9), the generator of §4 step 8
(`--error-feedback`), and the BLOB payloads of §2, decoded by parsers written from the
document alone (struct and numpy, no project code) and compared with the codecs' own decode."""
import struct
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.server import PSServer
from tests.test_ps_faults import restart_in_process
from thc_ps.worker.transport import Transport


def _ask(endpoint: str, msg: dict) -> dict:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(msgpack.packb(msg, use_bin_type=True))
        assert sock.poll(5000), msg
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close(0)


# ---------------------------------------------------------------- §7: register again after a restart
def test_a_restarted_ps_needs_the_job_sent_again():
    """§7: after a restart any rank may be the first to register again, and a PS started without
    job options refuses one that brings no `job`; with `job` (the config reply's map) it starts
    the job again.  The project's worker sends it (ranks that never proposed the job too)."""
    server = PSServer(None, ("127.0.0.1", 0), control_port=0, lease_s=0.5).start()
    ctl = lambda: f"tcp://127.0.0.1:{server.control_port}"
    first = _ask(ctl(), {"type": "register", "worker_id": 0, "data_addr": ["127.0.0.1", 5000],
                         "job_name": "again", "job": {"num_workers": 2}})
    assert first["type"] == "config"
    joiner = Transport("127.0.0.1", server.data_addr[1], 1, control_port=server.control_port, job_name="again",
                       expect={"num_workers": 2}, heartbeat=False)      # never proposed the job
    try:
        server = restart_in_process(server, None)
        refused = _ask(ctl(), {"type": "register", "worker_id": 0, "data_addr": ["127.0.0.1", 5000],
                               "job_name": "again", "expect": {"num_workers": 2}})
        assert refused["code"] == "refused" and "the register request's `job` field" in \
            refused["message"], refused
        joiner.session.register(0)      # the rank that never proposed: it sends its job again
        assert server.status()["jobs"][0]["job_name"] == "again" and server.status()["jobs"][0]["live"] == [1]
        again = _ask(ctl(), {"type": "register", "worker_id": 0, "data_addr": ["127.0.0.1", 5000],
                             "job_name": "again", "job": first["job"], "expect": {"num_workers": 2}})
        assert again["type"] == "config" and again["incarnation"] != first["incarnation"]
        assert {k: v for k, v in again["job"].items() if k != "job_id"} == \
            {k: v for k, v in first["job"].items() if k != "job_id"}
    finally:
        joiner.close(leave=False)
        server.stop()


# ---------------------------------------------------------------- §9: shards
def _doc_placement(nchunks: int, shards: int, slots: int) -> dict:
    """§3/§9 from the text: {(shard, slot): uses} of a DATA phase of `nchunks` chunks."""
    L = min(64, -(-nchunks // shards))
    uses: dict = {}
    for c in range(nchunks):
        j = c // L
        pos = (j // shards) * L + c % L
        key = (j % shards, pos % slots)
        uses[key] = uses.get(key, 0) + 1
    return uses


def test_sharded_control_flow_as_documented():
    """§9 on two shards with the project's worker: registered on both with each shard's own
    nonce, token and session; heartbeats on both; NORM at shard 0 only; DATA chunks in runs,
    each shard's slot rounds as §3 counts them; the start barrier at shard 0 only; leave on
    both (the job ends on each)."""
    shards = [PSServer(None, ("127.0.0.1", 0), control_port=0, lease_s=1.0).start() for _ in range(2)]
    job = JobConfig(num_workers=1, codec="thc", slots=40)
    t = Transport("127.0.0.1", 0, 0, shards=[("127.0.0.1", s.data_addr[1], s.control_port) for s in shards],
                  propose=job)
    try:
        from thc_ps.worker.client import Worker
        sess = t.sessions
        assert sess[0]["nonce"] != sess[1]["nonce"] and sess[0]["token"] != sess[1]["token"]
        assert sess[0]["session"] != sess[1]["session"] and sess[0]["incarnation"] != sess[1]["incarnation"]
        assert sess[0]["job"]["job_id"] == sess[1]["job"]["job_id"]
        t.barrier("start")
        per = sess[0]["job"]["elems_per_packet"]   # 2288: 5-bit lanes for 1·30
        d = 1432 * 150                  # RHT blocks of 2^17, 2^16, 2^14, 2^12: 95 chunks of 2288
        Worker(t).allreduce(np.random.default_rng(1).standard_normal(d).astype(np.float32))
        nchunks = -(-((1 << 17) + (1 << 16) + (1 << 14) + (1 << 12)) // per)
        assert (per, nchunks) == (2288, 95)
        want = _doc_placement(nchunks, 2, 40)
        for h, server in enumerate(shards):
            j = next(iter(server.jobs.values()))
            base, data, norm = j.region.base, j.region.data, j.region.norm
            rounds = [server.space.slot_state(base + s)[1] for s in range(data + norm)]
            assert rounds[:data] == [want.get((h, s), 0) for s in range(data)], h
            # NORM phase 0 (chunk 0): shard 0's norm slot S + 0, and no other
            assert rounds[data:] == ([1] + [0] * (norm - 1) if h == 0 else [0] * norm), h
            assert ("start" in j.released) == (h == 0)
            assert j.members[0].state == "live"
        time.sleep(1.5)                 # heartbeats renew the lease on both shards (1 s lease)
        assert all(next(iter(s.jobs.values())).live() == [0] for s in shards)
    finally:
        t.close()
    try:
        for _ in range(50):
            if not any(s.jobs for s in shards):
                break
            time.sleep(0.1)
        assert [s.stats()["jobs_ended"] for s in shards] == [1, 1]
    finally:
        for s in shards:
            s.stop()


# ---------------------------------------------------------------- §4 step 8: the generator
@pytest.mark.parametrize("rotation", ["job", "round"])
def test_the_error_feedback_generator_is_checked_exactly(rotation):
    """`thc launch/worker --error-feedback` (§4 step 8): ranks keep their residual, the exact
    check replays it and finds every round exact; checked without the residual the same
    reports differ from round 1 on (the residual changes what goes on the wire)."""
    from thc_ps.deploy.launch import check_rounds, worker_loop
    from thc_ps.worker.transport import Faults
    job = JobConfig(num_workers=2, rotation=rotation, seed=4)
    server = PSServer(job, ("127.0.0.1", 0), control_port=0).start()
    shard = [("127.0.0.1", server.data_addr[1], server.control_port)]
    out, dim, rounds = {}, 40_000, 5

    def rank(i):
        out[i] = worker_loop(shard, i, rounds, dim, 4, "retransmit", Faults(), 0.0, 1.0, 50.0, None,
                             error_feedback=True)[0]

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    finally:
        server.stop()
    with_ef = check_rounds(job, 4, dim, out, error_feedback=True)
    assert with_ef == {"rounds": rounds, "exact_rounds": rounds, "mismatched_chunks": 0, "lost_chunks": 0}
    without = check_rounds(job, 4, dim, out)
    assert without["exact_rounds"] == 1 and without["mismatched_chunks"] > 0, without


def test_the_error_feedback_generator_refuses_what_it_cannot_replay():
    from thc_ps.deploy.launch import run_launch
    for kw in ({"kill": (1, 2)}, {"quorum": 0.5}, {"codec": "none"}):
        with pytest.raises(ValueError, match="every rank must run every round"):
            run_launch(workers=2, rounds=4, dim=1000, error_feedback=True, **kw)


# ---------------------------------------------------------------- §2: BLOB payloads, from the doc
def msb_fields(buf: bytes, bits: int, count: int) -> np.ndarray:
    """`count` fields of `bits` bits, MSB first (§2's packing)."""
    flat = np.unpackbits(np.frombuffer(buf, np.uint8))[:count * bits].reshape(count, bits).astype(np.int64)
    return flat @ (1 << np.arange(bits - 1, -1, -1))


def lanes(buf: bytes, d: int) -> tuple:
    """(k, Y) of a down payload of uhc/terngrad: u8 k, u8 L, d big-endian L-bit lanes."""
    k, width = buf[0], buf[1]
    assert len(buf) == 2 + d * width // 8
    return k, np.frombuffer(buf, f">u{width // 8}", d, 2).astype(np.int64)


class Bits:
    """An MSB-first bit reader."""

    def __init__(self, buf: bytes):
        self.bits, self.pos = np.unpackbits(np.frombuffer(buf, np.uint8)), 0

    def read(self, n: int) -> int:
        v = 0
        for b in self.bits[self.pos:self.pos + n]:
            v = (v << 1) | int(b)
        self.pos += n
        return v


def canonical(lengths) -> dict:
    """{(length, code): symbol}: symbols with a code ordered by (length, symbol), each code the
    last plus one, shifted left by any growth in length, from 0."""
    table, code, prev = {}, 0, 0
    for length, sym in sorted((int(n), s) for s, n in enumerate(lengths) if n > 0):
        code <<= length - prev
        table[(length, code)] = sym
        code, prev = code + 1, length
    return table


def huffman(bits: Bits, table: dict) -> int:
    code, length = 0, 0
    while (length, code) not in table:
        code, length = (code << 1) | bits.read(1), length + 1
        assert length <= 32
    return table[(length, code)]


def decode_3lc(p: bytes, d: int) -> np.ndarray:
    cid, flags, n, m, nbody = struct.unpack_from("<BBIfI", p)
    assert cid == 3 and n == d and len(p) == 14 + nbody
    body = p[14:]
    if flags & 2:
        return np.frombuffer(body, "<f4").astype(np.float32)
    v = -(-n // 5)
    if flags & 1:
        body = b"".join(bytes([121]) * (b - 241) if b >= 243 else bytes([b]) for b in body)
    assert len(body) == v
    digits = np.array([[(b // 3 ** (4 - k)) % 3 for k in range(5)] for b in body])   # [byte j, digit k]
    elements = digits.T.ravel() if not flags & 4 else digits.ravel()   # planar: k·V + j; consecutive: 5j + k
    return (np.float32(m) * (elements[:n] - 1).astype(np.float32)).astype(np.float32)


def fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def decode_casq(p: bytes, d: int) -> np.ndarray:
    magic, kind, b, n, seed = struct.unpack_from("<BBBII", p)
    assert magic == 0x43 and n == d
    if kind == 2:
        return np.frombuffer(p, "<f4", n, 11).astype(np.float32)
    k = 1 << b
    sizes = np.frombuffer(p, "<u4", k, 11).astype(np.int64)
    off = 11 + 4 * k
    stream = np.unpackbits(np.frombuffer(p, np.uint8, -(-n * b // 8), off), bitorder="little")
    ids = stream[:n * b].reshape(n, b).astype(np.int64) @ (1 << np.arange(b))
    values = np.frombuffer(p, "<f4", int(sizes.sum()), off + -(-n * b // 8))
    assert len(p) == off + -(-n * b // 8) + 4 * int(sizes.sum())
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return np.array([values[starts[c] + fmix32(i ^ seed) % sizes[c]] for i, c in enumerate(ids)], np.float32)


def decode_fastsgd(p: bytes, d: int) -> np.ndarray:
    tag, l, m, tau1, count, s, b = struct.unpack_from("<BBBBIfd", p)
    assert tag == 0x46
    vb = np.frombuffer(p, np.uint8, count, 20)
    mag64 = float(s) * np.power(b, -(1.0 + (vb & 0x7F)))
    mag = mag64.astype(np.float32)
    mag = np.where(mag.astype(np.float64) > mag64, np.nextafter(mag, np.float32(0)), mag)   # toward zero
    bits, key, out = Bits(p[20 + count:]), 0, np.zeros(d, np.float32)
    for j in range(count):
        f = bits.read(l)
        key += bits.read(-(-(f + 1) * m // (1 << l)))
        out[key] = -mag[j] if vb[j] & 0x80 else mag[j]
    return out


def splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & (2 ** 64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2 ** 64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2 ** 64 - 1)
    return z ^ (z >> 31)


def decode_skcompress(p: bytes, d: int) -> np.ndarray:
    magic, version, _, rows, log2g, dim, count, _, _, seed = struct.unpack_from("<4sBBBBQIHHQ", p)
    assert magic == b"SKC1" and version == 1 and dim == d
    g, pos, out, seen = 1 << log2g, 32, np.zeros(d, np.float32), 0
    for sign in (-1.0, 1.0):
        q_s, groups = struct.unpack_from("<HH", p, pos)
        mids = np.frombuffer(p, "<f8", q_s, pos + 4)
        pos += 4 + 8 * q_s
        for _ in range(groups):
            grp, n_g, t = struct.unpack_from("<HII", p, pos)
            lens = p[pos + 10:pos + 10 + g]
            (c,) = struct.unpack_from("<I", p, pos + 10 + g)
            pos += 14 + g
            cells_bits, table = Bits(p[pos:pos + c]), canonical(lens)
            cells = np.array([huffman(cells_bits, table) for _ in range(rows * t)]).reshape(rows, t)
            pos += c
            param = p[pos]
            m_int, scheme_b = 1 << ((param >> 6) + 1), bool(param & 0x20)
            pos += 1
            klens = p[pos:pos + m_int] if scheme_b else None
            pos += m_int if scheme_b else 0
            a, plen = struct.unpack_from("<II", p, pos)
            prefix, payload = Bits(p[pos + 8:pos + 8 + a]), Bits(p[pos + 8 + a:pos + 8 + a + plen])
            pos += 8 + a + plen
            ktable, key = canonical(klens) if scheme_b else None, 0
            for _ in range(n_g):
                ci = (huffman(prefix, ktable) if scheme_b else prefix.read(m_int.bit_length() - 1)) + 1
                key += payload.read(ci * 32 // m_int)
                rank = max(cells[r, splitmix64((key + (r + 1) * 0x9E3779B97F4A7C15 + seed) % 2 ** 64) % t]
                           for r in range(rows))
                out[key] = np.float32(sign * mids[grp * g + rank])
                seen += 1
    assert pos == len(p) and seen == count
    return out


def _payloads(name: str, d: int, n: int = 3):
    """The up payloads of n ranks, the PS's down payload, shared and k, from the real codec."""
    from thc_ps.compression import registry
    from thc_ps.compression.codec import Context, combine_preliminary
    codec = registry.get(name)
    rng = np.random.default_rng(11)
    xs = []
    for _ in range(n):
        x = (rng.standard_normal(d) * rng.lognormal(0, 1, d)).astype(np.float32)
        x[rng.random(d) < 0.3] = 0.0            # the sparse codecs' zeros
        xs.append(x)
    states = [codec.new_state() for _ in range(n)]
    stats = [codec.preliminary(x, s) for x, s in zip(xs, states)]
    shared = combine_preliminary([None if st is None else np.asarray(st, np.float32) for st in stats])
    ctx = Context("t", d, 1, shared, n)
    ups = [codec.encode(x, s, np.random.default_rng([7, i]), ctx) for i, (x, s) in enumerate(zip(xs, states))]
    down = codec.aggregate(ups, codec.new_ps_state(), Context(str(d), d, 1, None, n))
    return codec, ups, down, shared, ctx


DECODERS = {"3lc": decode_3lc, "casq": decode_casq, "fastsgd": decode_fastsgd, "skcompress": decode_skcompress,
            "topk": None}


@pytest.mark.parametrize("name", ["uhc", "terngrad", "topk", "3lc", "casq", "fastsgd", "skcompress"])
def test_blob_payloads_decode_as_documented(name):
    """Every BLOB codec's up and down payloads, read as §2 "BLOB payloads, codec by codec"
    says, give what the codec decodes (bit for bit); the homomorphic ones' down lanes are the
    sums of the up fields."""
    d = 3000
    codec, ups, down, shared, ctx = _payloads(name, d)
    from thc_ps.compression.codec import Context
    got = codec.decode(down, Context("t", d, 1, shared, len(ups)))
    if name in ("uhc", "terngrad"):
        bits, g = (4, 15) if name == "uhc" else (2, 2)
        fields = [msb_fields(u, bits, d) for u in ups]
        assert all(len(u) == -(-d * bits // 8) and f.max() <= g for u, f in zip(ups, fields))
        k, y = lanes(down, d)
        width = down[1]
        assert k == len(ups) and width == min(w for w in (8, 16, 32) if k * g <= 2 ** w - 1)
        assert np.array_equal(y, sum(fields))
        if name == "uhc":
            lo, hi = -shared[0], shared[1]
            want = (lo + y / k * ((hi - lo) / g)).astype(np.float32)
        else:
            want = ((y - k) * (shared[0] / k)).astype(np.float32)
        assert np.array_equal(want, got)
        return
    decode = DECODERS[name]
    if name == "topk":
        def decode(p, dim):
            (kk,) = struct.unpack_from(">I", p)
            idx = np.frombuffer(p, ">u4", kk, 4)
            assert len(p) == 4 + 8 * kk and (np.diff(idx.astype(np.int64)) > 0).all()
            out = np.zeros(dim, np.float32)
            out[idx] = np.frombuffer(p, ">f4", kk, 4 + 4 * kk)
            return out
    assert np.array_equal(decode(down, d), got)
    for u in ups:                   # up payloads have the down payloads' format
        assert np.array_equal(decode(u, d), codec.decode(u, ctx))
