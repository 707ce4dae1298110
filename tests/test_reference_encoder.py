"""A THC encoder written from docs/protocol.md alone (§1 header, §2 payloads, §3 slots and
rounds, §4 steps 1–6, §5 streams) must send, byte for byte, the packets a real `Worker` sends
for the same seed, rank and rounds: NORM and DATA, headers, packing and the stochastic
rounding stream included.

The real worker talks to a real PS's control plane (registration, heartbeats) but sends its
data plane to a fake PS here on loopback, which records the first copy of every datagram and
answers it (NORM_RESULT with other ranks' larger maxima for some blocks, RESULT with the
lanes), so the whole allreduce runs.  Nothing of the project's encoder is used by the
reference: it has its own norms, RHT, clamp and map, SplitMix64 uniforms, rounding, packing
and header code, and it takes the generator constants from the document's text.
"""
import math
import re
import socket
import statistics
import struct
import threading
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.server import PSServer

DOC = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
HDR = struct.Struct("!HBBBBBBHHIIHHIBBHII")          # §1, the 19 fields in order, 40 bytes
DATA, RESULT, NORM, NORM_RESULT = 1, 2, 4, 5
OP_LOOKUP_SUM, OP_MAX_U32 = 1, 3
MASK = (1 << 64) - 1


# ---------------------------------------------------------------- constants, from the document
def _doc_constants():
    """γ, the mix function's (shift, multiplier) steps, and the per-round stream's tag, as §5
    writes them."""
    gamma = int(re.search(r"γ = (0x[0-9a-f]+)", DOC).group(1), 16)
    mix = re.search(r"mix\(z\):(.*)", DOC).group(1)
    shifts = [int(v) for v in re.findall(r"z \^= z >> (\d+)", mix)]
    mults = [int(v, 16) for v in re.findall(r"z \*= (0x[0-9a-f]+)", mix)]
    tag = int(re.search(r"\| \[s, rank, r, (0x[0-9A-Fa-f]+)\] \|", DOC).group(1), 16)
    lanes = {"sixteen": 16}[re.search(r"(\w+) float64 partial sums S_k", DOC).group(1)]
    assert len(shifts) == 3 and len(mults) == 2
    return gamma, shifts, mults, tag, lanes


GAMMA, SHIFTS, MULTS, TAG, LANES = _doc_constants()


# ---------------------------------------------------------------- the reference encoder (§4, §5)
def ref_mix(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        for k, shift in enumerate(SHIFTS):
            z = z ^ (z >> np.uint64(shift))
            if k < len(MULTS):
                z = z * np.uint64(MULTS[k])
    return z


def ref_uniforms(key: int, count: int) -> np.ndarray:
    """u_k = bits_k · 2^−24, bits_k from h_k = mix(K + (⌊k/2⌋ + 1)·γ) (§5)."""
    k = np.arange(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = ref_mix(np.uint64(key) + ((k >> np.uint64(1)) + np.uint64(1)) * np.uint64(GAMMA))
    bits = np.where(k % np.uint64(2) == 0, h >> np.uint64(40), (h >> np.uint64(8)) & np.uint64(0xFFFFFF))
    return bits.astype(np.float32) * np.float32(2.0 ** -24)


def ref_blocks(d: int, block_log2: int, tail_log2: int, tensors=None) -> list:
    """(start, length, padded length) of each RHT block (§4 step 1); `tensors`: the sizes of
    the tensors x holds back to back, each cut on its own (none: x is one tensor)."""
    if tensors is not None:
        out, at = [], 0
        for n in tensors:
            out += [(at + s, k, p) for s, k, p in ref_blocks(n, block_log2, tail_log2)] if n else []
            at += n
        return out
    cap = 1 << block_log2
    whole = d - d % cap
    out = [(start, cap, cap) for start in range(0, whole, cap)]
    r = d - whole
    if 0 < r <= 1 << tail_log2:
        out.append((whole, r, 1 << (r - 1).bit_length()))
    elif r:
        big_r = -(-r // (1 << tail_log2)) << tail_log2
        start = whole
        for k in reversed(range(big_r.bit_length())):
            if big_r >> k & 1:
                out.append((start, min(1 << k, d - start), 1 << k))
                start += 1 << k
    return out


def ref_norm(block: np.ndarray) -> np.float32:
    """§4 step 2: sixteen float64 lanes, each in increasing i, then added left to right."""
    lane = [0.0] * LANES
    for i, v in enumerate(block.tolist()):        # Python floats are float64; v² is exact
        lane[i % LANES] += v * v
    q = 0.0
    for s in lane:
        q += s
    return np.float32(math.sqrt(q))


def ref_signs(seed: int, r: int, j: int, p: int) -> np.ndarray:
    rng = np.random.default_rng(np.random.SeedSequence([seed % 2 ** 32, r % 2 ** 32, j]))
    bits = np.unpackbits(np.frombuffer(rng.bytes(-(-p // 8)), np.uint8))[:p]
    return bits.astype(bool)                        # True: −1


def ref_rotate(block: np.ndarray, p: int, minus: np.ndarray) -> np.ndarray:
    """§4 step 3 in float32: signs, butterfly stages h = 1, 2, 4, …, then × float32(1/√P)."""
    v = np.zeros(p, np.float32)
    v[:block.size] = block
    v = np.where(minus, -v, v).astype(np.float32)
    h = 1
    while h < p:
        pairs = v.reshape(-1, 2, h)
        lo, hi = pairs[:, 0, :].copy(), pairs[:, 1, :].copy()
        pairs[:, 0, :], pairs[:, 1, :] = lo + hi, lo - hi
        h *= 2
    return v * np.float32(1.0 / math.sqrt(p))


def ref_indices(rot: np.ndarray, big_l: float, p: int, job: dict, u: np.ndarray, divide=False) -> np.ndarray:
    """§4 steps 4–5: clamp, map to [0, g], stochastic rounding to table indices.  `divide`:
    (y − T[i]) / (T[i+1] − T[i]) instead of the product with w_i (what the document said
    before it named the operations)."""
    g, table = job["granularity"], np.asarray(job["table"], np.int64)
    tp = statistics.NormalDist().inv_cdf(1.0 - float(Fraction(job["p"])) / 2.0)
    big_m = (tp * big_l) / math.sqrt(p)
    if big_m > 0:
        m, sigma = np.float32(big_m), np.float32(g / (2.0 * big_m))
        a = np.minimum(np.maximum(rot, -m), m)
        y = np.minimum(np.maximum((a + m) * sigma, np.float32(0)), np.float32(g))
    else:
        y = np.full(p, np.float32(g / 2), np.float32)
    c = np.floor(y).astype(np.int64)
    i = np.minimum(np.searchsorted(table, c, side="right") - 1, table.size - 2)
    width = (table[i + 1] - table[i]).astype(np.float32)
    f = (y - table[i].astype(np.float32)) / width if divide else (y - table[i].astype(np.float32)) * (np.float32(1) / width)
    return (i + (u < f)).astype(np.uint8)


def ref_residual(rot: np.ndarray, z: np.ndarray, big_l: float, p: int, job: dict) -> np.ndarray:
    """§4 step 8: e = R − (T[Z]·c − m), c = float32(2M/g), m = float32(M), in float32."""
    g, table = job["granularity"], np.asarray(job["table"], np.float32)
    tp = statistics.NormalDist().inv_cdf(1.0 - float(Fraction(job["p"])) / 2.0)
    big_m = (tp * big_l) / math.sqrt(p)
    c, m = (np.float32(2.0 * big_m / g), np.float32(big_m)) if big_m > 0 else (np.float32(0), np.float32(0))
    return rot - (table[z] * c - m)


def ref_pack(z: np.ndarray, b: int) -> bytes:
    """§2: b-bit indices MSB first, the last byte's unused low bits 0."""
    bits = ((z.astype(np.uint16)[:, None] >> np.arange(b - 1, -1, -1)) & 1).astype(np.uint8)
    return np.packbits(bits.ravel()).tobytes()


def ref_code(values) -> bytes:
    """§2 NORM: order-preserving codes, big-endian."""
    u = np.asarray(values, np.float32).view(np.uint32)
    return np.where(u >> 31, ~u, u | np.uint32(0x80000000)).astype(">u4").tobytes()


class RefWorker:
    """The data plane of one rank, from the document: the packets of each allreduce."""

    def __init__(self, job: dict, rank: int, nonce: int, token: int, worker_seed: int, per_round: bool,
                 error_feedback: bool = False):
        self.job, self.rank, self.nonce, self.token = job, rank, nonce, token
        self.fixed = job["rotation"] == "job"          # one sign diagonal, residual kept rotated (§4 steps 3, 8)
        self.residual = {} if error_feedback else None
        self.S, self.Sn = job["slots"], job["norm_slots"]
        self.rounds = [0] * (self.S + self.Sn)       # slot round counters, 0 before first use
        self.phase = 0
        self.worker_seed, self.per_round = worker_seed, per_round
        self.stream = np.random.PCG64(np.random.SeedSequence([worker_seed, rank])) if not per_round else None

    def header(self, type_, op, elem_bits, slot, rnd, offset, count, payload) -> bytes:
        j = self.job
        return HDR.pack(0x5448, 2, type_, 0, self.rank, j["num_workers"], elem_bits, j["job_id"], slot, rnd,
                        offset, count, len(payload), 0, 0, op, 0, self.nonce, self.token) + payload

    def use(self, slot: int) -> int:
        self.rounds[slot] = (self.rounds[slot] + 1) % 2 ** 32
        return self.rounds[slot]

    def key(self, r: int) -> int:
        if self.per_round:
            return int(np.random.PCG64(np.random.SeedSequence([self.worker_seed, self.rank, r, TAG])).random_raw())
        return int(self.stream.random_raw())

    def allreduce(self, x: np.ndarray, r: int, others_max, tensors=None) -> tuple:
        """(NORM packet, DATA packets) of allreduce r; `others_max(j, l)` is L_j given ℓ_j;
        `tensors`: the sizes of the tensors x holds (§4 step 1)."""
        job = self.job
        blocks = ref_blocks(x.size, job["block_log2"], job["tail_log2"], tensors)
        rots = []
        for j, (s, n, p) in enumerate(blocks):
            rot = ref_rotate(x[s:s + n], p, ref_signs(job["seed"], 0 if self.fixed else r, j, p))
            if self.fixed and self.residual is not None and j in self.residual:
                rot = rot + self.residual[j]
            rots.append(rot)
        norms = [ref_norm(rots[j] if self.fixed else x[s:s + n]) for j, (s, n, _) in enumerate(blocks)]
        norm_slot = self.S + self.phase % self.Sn
        norm_pkt = self.header(NORM, OP_MAX_U32, 32, norm_slot, self.use(norm_slot), 0, len(norms),
                               ref_code(norms))
        self.phase += 1
        padded = sum(p for _, _, p in blocks)
        u = ref_uniforms(self.key(r), padded)
        z, off = [], 0
        for j, (_, _, p) in enumerate(blocks):
            big_l = float(others_max(j, norms[j]))
            z.append(ref_indices(rots[j], big_l, p, job, u[off:off + p]))
            if self.fixed and self.residual is not None:
                self.residual[j] = ref_residual(rots[j], z[-1], big_l, p, job)
            off += p
        z = np.concatenate(z)
        b, per = job["bits"], job["elems_per_packet"]
        packed, data = ref_pack(z, b), []
        base = list(self.rounds)
        for c, start in enumerate(range(0, padded, per)):
            count = min(per, padded - start)
            slot = c % self.S
            rnd = (base[slot] + 1 + c // self.S) % 2 ** 32
            data.append(self.header(DATA, OP_LOOKUP_SUM, b, slot, rnd, start, count,
                                    packed[start * b // 8:-(-(start + count) * b // 8)]))
        for slot in range(self.S):
            self.rounds[slot] = base[slot] + len(range(slot, -(-padded // per), self.S))
        self.phase += 1
        return norm_pkt, data, z


# ---------------------------------------------------------------- a fake PS data plane
def others_max(j: int, own: np.float32) -> np.float32:
    """The NORM_RESULT the fake PS returns: another rank had a 1.25× larger norm in even blocks."""
    return np.float32(own * np.float32(1.25)) if j % 2 == 0 else own


class FakePS:
    """Records every datagram's first copy by (type, slot, round) and answers it."""

    def __init__(self, job: JobConfig):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.addr = self.sock.getsockname()
        self.job = job
        self.table = np.asarray(job.table, np.uint8)
        self.first: dict = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                data, src = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            h = HDR.unpack_from(data)
            type_, worker, slot, rnd, offset, count, op = h[2], h[4], h[8], h[9], h[10], h[11], h[15]
            self.first.setdefault((type_, slot, rnd), data)
            payload = data[HDR.size:]
            if type_ == NORM:
                codes = np.frombuffer(payload, ">u4")
                vals = np.where(codes >> 31, codes & np.uint32(0x7FFFFFFF), ~codes).astype(np.uint32).view(np.float32)
                out, kind, bits = ref_code([others_max(j, v) for j, v in enumerate(vals)]), NORM_RESULT, 32
            else:
                z = np.unpackbits(np.frombuffer(payload, np.uint8)).reshape(-1, h[6])[:count]
                idx = (z.astype(np.int64) << np.arange(h[6] - 1, -1, -1)).sum(axis=1)
                out, kind, bits = self.table[idx].tobytes(), RESULT, 8
            reply = HDR.pack(0x5448, 2, kind, 0, 0, self.job.num_workers, bits, h[7], slot, rnd, offset, count,
                             len(out), 1 << worker, 1, op, 0, h[17], 0) + out
            self.sock.sendto(reply, src)

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def _gradient(r: int, d: int) -> np.ndarray:
    """Heavy-tailed float32 values (norms whose float32 sums would round differently), with
    one all-zero block in round 1 (M = 0: every y = g/2)."""
    rng = np.random.default_rng(100 + r)
    x = (rng.standard_normal(d) * rng.lognormal(0, 2, d)).astype(np.float32)
    if r == 1:
        x[2048:4096] = 0
    return x


@pytest.mark.parametrize("bits,per_round,rotation,tail_log2,tensors",
                         [(4, True, "round", 11, None), (2, False, "round", 6, None), (4, True, "job", 6, None),
                          (2, False, "job", 11, None), (4, False, "job", 6, (7, 0, 2100, 1000, 1893)),
                          (4, True, "round", 11, (3000, 2000)), (5, True, "round", 11, None),
                          (5, False, "job", 6, (7, 0, 2100, 1000, 1893))])
def test_reference_encoder_sends_the_real_workers_packets(bits, per_round, rotation, tail_log2, tensors):
    """Under `rotation` `job` the worker keeps error feedback (§4 step 8): its residuals reach
    the later rounds' norms and indices, so the packets check them too.  d = 5000 in blocks of
    2^11 leaves a rest of 904: one block of 1024 with tail_log2 11, four of 512, 256, 128 and
    64 with tail_log2 6 (§4 step 1).  With `tensors` the worker is given the sizes of the
    tensors x holds, and each is cut on its own: (7, 0, 2100, 1000, 1893) in 8 | – | 2048 + 64
    | 1024 | 1024 + 512 + 256 + 128 (5064 coordinates); (3000, 2000) in 2048 + 1024 | 2048.
    5-bit indices (g = 31, the library's table without error feedback) are packed block by
    block by the worker's C kernels, 8 indices to 5 bytes; here they meet §2's bit packing."""
    from thc_ps.worker.client import Worker
    from thc_ps.worker.transport import Transport
    job = JobConfig(num_workers=2, bits=bits, granularity=31 if bits == 5 else 30, seed=11, block_log2=11,
                    tail_log2=tail_log2, slots=3, norm_slots=3, rotation=rotation)
    feedback = rotation == "job"
    rank, worker_seed, d, rounds = 1, 5, 5000, 3
    server = PSServer(job, ("127.0.0.1", 0), control_port=0).start()
    fake = FakePS(job)
    t = None
    try:
        t = Transport(fake.addr[0], fake.addr[1], rank, control_port=server.control_port)
        w = Worker(t, error_feedback=feedback, seed=worker_seed, per_round_rng=per_round)
        sess, announced = t.sessions[0], t.job.to_msg()
        ref = RefWorker(announced, rank, sess["nonce"], sess["token"], worker_seed, per_round, feedback)
        want = {}
        for r in range(rounds):
            x = _gradient(r, d)
            w.allreduce(x, segments=tensors)
            norm_pkt, data_pkts, _ = ref.allreduce(x, r, others_max, tensors)
            for pkt in [norm_pkt] + data_pkts:
                h = HDR.unpack_from(pkt)
                want[(h[2], h[8], h[9])] = pkt
        got = dict(fake.first)
    finally:
        if t is not None:
            t.close()
        fake.close()
        server.stop()
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for key in sorted(want):
        assert got[key] == want[key], f"packet (type, slot, round) {key} differs from the document's"
    padded = {(11, None): 5120, (6, None): 5056, (6, (7, 0, 2100, 1000, 1893)): 5064,
              (11, (3000, 2000)): 5120}[tail_log2, tensors]
    assert sum(p for _, _, p in ref_blocks(d, 11, tail_log2, tensors)) == padded
    assert len(want) == rounds * (1 + -(-padded // announced["elems_per_packet"]))


def test_the_end_to_end_data_would_show_each_former_ambiguity():
    """The gradients above are sharp where the document used to be vague: for them a float32
    dot (a BLAS's order) gives other block norms, and numpy's float32 draws other indices than
    the key's counter stream; so an encoder that did either would fail there."""
    job = JobConfig(num_workers=2, seed=11, block_log2=11).to_msg()
    blas, drawn = 0, 0
    for r in range(3):
        x = _gradient(r, 5000)
        for j, (s, n, p) in enumerate(ref_blocks(x.size, job["block_log2"], job["tail_log2"])):
            blk = x[s:s + n]
            own = ref_norm(blk)
            blas += int(own != np.float32(math.sqrt(float(np.dot(blk, blk)))))
            rot = ref_rotate(blk, p, ref_signs(job["seed"], r, j, p))
            key = int(np.random.PCG64(np.random.SeedSequence([5, 1, r, TAG])).random_raw())
            z = ref_indices(rot, float(own), p, job, ref_uniforms(key, p))
            numpy_u = np.random.default_rng(np.random.SeedSequence([5, 1, r, TAG])).random(p, dtype=np.float32)
            drawn += int(np.sum(z != ref_indices(rot, float(own), p, job, numpy_u)))
    assert blas >= 1 and drawn > 100, (blas, drawn)


def test_the_rounding_threshold_is_the_product_with_the_float32_reciprocal():
    """§4 step 5 to the last bit, where random data almost never reaches: grid values y in a
    table interval of width 3 for which (y − T[i])·float32(1/3) and (y − T[i])/3 differ, with
    u between the two.  The C quantizer and the numpy encode path both follow the document."""
    from thc_ps.compression import _kernels as K
    from thc_ps.compression.thc import stochastic_round
    from thc_ps.proto.tables import lower_interval_index
    job = JobConfig(num_workers=2).to_msg()
    table = np.asarray(job["table"], np.int64)
    assert table[1] - table[0] == 3
    g = job["granularity"]
    # M = g/2 makes m = 15 and σ = 1: y = float32(r + 15) for r in [−15, −12)
    r = (np.float32(-15) + np.arange(1, 3 * 2 ** 20, 97, dtype=np.float32) * np.float32(2.0 ** -20)).astype(np.float32)
    y = (r + np.float32(15)).astype(np.float32)
    mul = y * (np.float32(1) / np.float32(3))
    div = y / np.float32(3)
    pick = mul != div
    assert pick.sum() > 100
    r, y, u = r[pick], y[pick], np.minimum(mul, div)[pick]      # u < f for exactly one of the two
    big_l = (g / 2) / statistics.NormalDist().inv_cdf(1 - 1 / 64)         # t_p·L/√1 = 15, σ = 1
    assert np.float32(statistics.NormalDist().inv_cdf(1 - 1 / 64) * big_l) == 15
    want = ref_indices(r, big_l, 1, job, u)
    assert np.array_equal(want, (mul[pick] > div[pick]).astype(np.uint8))
    got_c = np.empty(r.size, np.uint8)
    K.quantize(r, g / 2, g, bytes(table.astype(np.uint8)), u, got_c)
    got_numpy = stochastic_round(y, table, lower_interval_index(table), u)
    assert np.array_equal(got_c, want) and np.array_equal(got_numpy, want)
