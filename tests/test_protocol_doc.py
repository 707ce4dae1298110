"""docs/protocol.md is the contract: its generated tables match the code, its replies list the
fields the PS sends, its random streams reproduce the project's values from their description
alone, and a worker written from it alone (`SpecWorker`, no project imports) joins a real job
beside a real worker and gets exact sums."""
import math
import socket
import struct
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from proto import control, protodoc
from proto.job import JobConfig
from ps_server.server import PSServer

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def test_generated_tables_match_the_code():
    text = DOC.read_text()
    assert protodoc.render(text) == text, "docs/protocol.md is stale: python -m proto.protodoc --write"
    assert protodoc.main(["--check"]) == 0


def test_every_request_field_and_error_code_is_documented():
    text = DOC.read_text()
    for kind, spec in control.SCHEMA.items():
        assert f"`{kind}`" in text
        for name in spec:
            assert name in protodoc.REQUEST_FIELDS, f"{kind}.{name} has no meaning in proto/protodoc.py"
    for code in control.ERROR_CODES:
        assert f"`{code}`" in text


def test_documented_replies_are_what_the_ps_sends():
    server = PSServer(JobConfig(num_workers=2), ("127.0.0.1", 0), control_port=0).start()
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.control_port}")
    try:
        def ask(msg):
            sock.send(msgpack.packb(msg, use_bin_type=True))
            assert sock.poll(5000)
            return msgpack.unpackb(sock.recv(), raw=False)
        config = ask({"type": "register", "worker_id": 0, "data_addr": ["127.0.0.1", 5555]})
        assert set(config) == set(protodoc.CONFIG_REPLY)
        assert set(config["job"]) == set(protodoc.JOB_FIELDS)
        status = ask({"type": "heartbeat", "worker_id": 0, "session": config["session"]})
        assert set(protodoc.STATUS_REPLY) - {"stalled", *protodoc.STATUS_LISTING} == set(status)
        listing = ask({"type": "status"})                 # anyone: the one job and the listing
        assert set(protodoc.STATUS_REPLY) - {"stalled"} == set(listing)
        assert [j["job_number"] for j in listing["jobs"]] == [config["job_number"]]
        err = ask({"type": "heartbeat", "worker_id": 1, "session": b"\0" * 16})
        assert set(err) == {"type", "message", "code", "incarnation"} and err["code"] == "unknown_session"
    finally:
        sock.close(0)
        server.stop()


# ---------------------------------------------------------------- random streams, from the doc
def _rng(*ints):
    return np.random.default_rng(np.random.SeedSequence(list(ints)))


def test_random_streams_as_documented():
    from compression.hadamard import rademacher_signs
    from deploy.launch import gradient
    from worker.client import round_rng
    seed, r, j, p = 7, 3, 1, 1000
    bits = np.unpackbits(np.frombuffer(_rng(seed % 2**32, r % 2**32, j).bytes(-(-p // 8)), np.uint8))[:p]
    assert np.array_equal(np.where(bits == 1, -1.0, 1.0).astype(np.float32), rademacher_signs(seed, r, j, p))
    u = _rng(seed, 2, r, 0x52).random(4096, dtype=np.float32)
    assert np.array_equal(u, round_rng(seed, 2, r).random(4096, dtype=np.float32))
    g = _rng(seed, r, 2, 0x6AD)
    z = g.standard_normal(5000)
    s = g.lognormal(0, 1)
    want = (np.round(np.clip(z * s, -127, 127) * 1024) / 1024).astype(np.float32)
    assert np.array_equal(want, gradient(seed, r, 2, 5000))


def _fwht(v):
    """Sylvester-order Walsh–Hadamard transform, normalized by 1/√P (float64)."""
    v = np.array(v, dtype=np.float64)
    h = 1
    while h < v.size:
        a = v.reshape(-1, 2 * h)
        left, right = a[:, :h].copy(), a[:, h:].copy()
        a[:, :h], a[:, h:] = left + right, left - right
        h *= 2
    return v / math.sqrt(v.size)


def spec_encode(x, max_norms, table, g, tp, block_log2, seed, r, u):
    """§4 of docs/protocol.md, steps 1–5, in float64."""
    cap, out, off = 1 << block_log2, [], 0
    for j, start in enumerate(range(0, x.size, cap)):
        blk = x[start:start + cap].astype(np.float64)
        P = 1 << max(0, (blk.size - 1).bit_length())
        padded = np.zeros(P)
        padded[:blk.size] = blk
        bits = np.unpackbits(np.frombuffer(_rng(seed % 2**32, r % 2**32, j).bytes(-(-P // 8)), np.uint8))[:P]
        R = _fwht(np.where(bits == 1, -1.0, 1.0) * padded)
        M = tp * max_norms[j] / math.sqrt(P)
        y = np.clip((np.clip(R, -M, M) + M) * g / (2 * M), 0, g) if M > 0 else np.full(P, g / 2)
        tab = np.asarray(table, dtype=np.float64)
        i = np.minimum(np.searchsorted(tab, np.floor(y), side="right") - 1, len(tab) - 2)
        up = u[off:off + P] < (y - tab[i]) / (tab[i + 1] - tab[i])
        out.append((i + up).astype(np.uint8))
        off += P
    return np.concatenate(out)


def test_thc_encoding_as_documented():
    from compression import thc
    from proto.tables import t_p
    cfg = thc.ThcConfig(seed=5, block_log2=10)
    x = np.random.default_rng(1).standard_normal(2500).astype(np.float32)
    layout = thc.make_layout(x.size, cfg.block_log2)
    norms = thc.block_norms(x, layout) * 1.1          # another rank's larger maximum
    u = _rng(5, 0, 4, 0x52).random(layout.padded_dim, dtype=np.float32)
    want = thc.encode(x, norms, cfg, layout, 4, u)
    got = spec_encode(x, norms, cfg.table.values, cfg.granularity, t_p(cfg.p), cfg.block_log2, 5, 4, u)
    # float64 here, float32 in the project: a draw may fall between the two roundings of y
    assert np.mean(got != want) < 1e-3 and np.abs(got.astype(int) - want).max() <= 1


# ---------------------------------------------------------------- a worker from the doc alone
class SpecWorker:
    """A THC worker written from docs/protocol.md only: msgpack over ZeroMQ REQ, the 40-byte
    header with struct, one NORM and one DATA phase per allreduce."""

    HDR = struct.Struct("!HBBBBBBHHIIHHIBBHII")

    def __init__(self, host, data_port, control_port, rank, expect):
        self.ctx = zmq.Context.instance()
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind((host, 0))
        self.udp.settimeout(0.05)
        self.ps, self.ctl = (host, data_port), f"tcp://{host}:{control_port}"
        self.rank, self.req = rank, self._sock()
        self.cfg = self.ask({"type": "register", "worker_id": rank,
                             "data_addr": list(self.udp.getsockname()), "expect": expect})
        assert self.cfg["type"] == "config", self.cfg
        self.job = self.cfg["job"]
        self.rounds = np.zeros(self.job["slots"] + self.job["norm_slots"], np.int64)
        self.phase = 0
        self.stop = threading.Event()
        self.beats = threading.Thread(target=self._heartbeats, daemon=True)
        self.beats.start()

    def _sock(self):
        s = self.ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.ctl)
        return s

    def ask(self, msg, sock=None, timeout_s=30):
        sock = sock or self.req
        if "type" in msg and msg["type"] not in ("register", "status"):
            msg = {**msg, "worker_id": self.rank, "session": self.cfg["session"]}
        sock.send(msgpack.packb(msg, use_bin_type=True))
        assert sock.poll(int(timeout_s * 1000)), msg
        return msgpack.unpackb(sock.recv(), raw=False)

    def _heartbeats(self):
        sock = self._sock()
        while not self.stop.wait(self.cfg["lease_s"] / 5):
            self.ask({"type": "heartbeat"}, sock)
        sock.close(0)

    def packet(self, type_, op, elem_bits, slot, rnd, offset, count, payload):
        j = self.job
        return self.HDR.pack(0x5448, 2, type_, 0, self.rank, j["num_workers"], elem_bits, j["job_id"], slot,
                             rnd, offset, count, len(payload), 0, 0, op, 0, self.cfg["nonce"],
                             self.cfg["token"]) + payload

    def run_phase(self, kind, chunks):
        """chunks: [(offset, count, payload)] of a NORM (kind 4) or DATA (kind 1) phase."""
        S, Sn = self.job["slots"], self.job["norm_slots"]
        sent = {}
        for c, (off, count, payload) in enumerate(chunks):
            slot = S + (self.phase + c) % Sn if kind == 4 else c % S
            self.rounds[slot] += 1
            op, bits = (3, 32) if kind == 4 else (1, self.job["bits"])
            sent[slot] = (c, self.packet(kind, op, bits, slot, int(self.rounds[slot]), off, count, payload))
        self.phase += 1
        results, deadline = {}, time.monotonic() + 30
        for _, pkt in sent.values():
            self.udp.sendto(pkt, self.ps)
        while len(results) < len(sent) and time.monotonic() < deadline:
            try:
                data, _ = self.udp.recvfrom(65536)
            except TimeoutError:
                for c, pkt in sent.values():     # resend what is missing, RETRANSMIT set
                    if c not in results:
                        self.udp.sendto(pkt[:4] + bytes([pkt[4] | 1]) + pkt[5:], self.ps)
                continue
            h = self.HDR.unpack_from(data)
            if h[0] != 0x5448 or h[17] != self.cfg["nonce"] or h[2] not in (2, 5) or h[8] not in sent:
                continue
            if h[9] == self.rounds[h[8]]:
                results[sent[h[8]][0]] = (h[13], h[14], data[40:40 + h[12]])   # bitmap, k, payload
        assert len(results) == len(sent), "a phase did not complete"
        return [results[c] for c in range(len(chunks))]

    @staticmethod
    def ordered(v):
        u = np.asarray(v, np.float32).view(np.uint32)
        return np.where(u >> 31, ~u, u | np.uint32(0x80000000)).astype(">u4")

    def close(self):
        self.stop.set()
        self.beats.join(5)
        self.ask({"type": "leave"})
        self.req.close(0)
        self.udp.close()


def test_a_worker_written_from_the_doc_joins_a_real_job():
    from compression import thc
    from worker.client import Worker, round_rng
    from worker.transport import Transport
    job = JobConfig(num_workers=2, seed=3)
    server = PSServer(job, ("127.0.0.1", 0), control_port=0).start()
    dim = 5000
    x_real = np.random.default_rng(2).standard_normal(dim).astype(np.float32)
    real_out = {}

    def real():
        t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port)
        w = Worker(t, error_feedback=False, seed=3, per_round_rng=True)
        t.barrier("start")
        real_out["avg"] = w.allreduce(x_real)
        real_out["norms"] = w.last.norms
        t.barrier("end")
        t.close()

    th = threading.Thread(target=real)
    th.start()
    spec = SpecWorker("127.0.0.1", server.data_addr[1], server.control_port, 1,
                      {"num_workers": 2, "codec": "thc", "bits": 4})
    try:
        assert spec.ask({"type": "barrier", "name": "start"})["type"] == "ok"
        # NORM phase: my norm 1e6, larger than the real worker's: the max is mine
        ((bitmap, k, payload),) = spec.run_phase(4, [(0, 1, spec.ordered([1e6]).tobytes())])
        assert bitmap == 0b11 and k == 2
        code = np.frombuffer(payload, ">u4")
        assert np.uint32(code[0]) >> 31 and (code & np.uint32(0x7FFFFFFF)).view(np.float32)[0] == np.float32(1e6)
        # DATA phase: my indices (arbitrary), packed MSB first, in chunks of elems_per_packet
        P = 1 << (dim - 1).bit_length()
        mine = np.random.default_rng(9).integers(0, 16, P).astype(np.uint8)
        packed = ((mine[0::2] << 4) | mine[1::2]).astype(np.uint8).tobytes()
        E = spec.job["elems_per_packet"]
        chunks = [(o, min(E, P - o), packed[o // 2:(o + min(E, P - o) + 1) // 2]) for o in range(0, P, E)]
        results = spec.run_phase(1, chunks)
        assert spec.ask({"type": "barrier", "name": "end"})["type"] == "ok"
    finally:
        spec.close()
        th.join(30)
        server.stop()
    # what the real worker sent, recomputed with the project's own encoder
    cfg = thc.ThcConfig.of_job(job)
    rnd = thc.WorkerRound(cfg, x_real)
    assert np.isclose(real_out["norms"][0], 1e6)
    z_real = rnd.encode(np.array([1e6]), round_rng(3, 0, 0), 0)
    table = np.asarray(spec.job["table"])
    lanes = np.concatenate([np.frombuffer(p, np.uint8) for _, _, p in results])
    assert all(b == 0b11 and k == 2 for b, k, _ in results)
    assert np.array_equal(lanes, table[mine] + table[z_real])
    assert real_out["avg"].shape == (dim,) and np.isfinite(real_out["avg"]).all()


@pytest.mark.parametrize("value", [0.0, -0.0, 1.5, -2.0, 3.4e38, float("inf")])
def test_norm_codes_order_like_the_floats(value):
    a, b = SpecWorker.ordered([value]), SpecWorker.ordered([np.nextafter(np.float32(value), np.float32(np.inf))])
    assert int(a[0]) <= int(b[0])
    from proto.headers import float_to_ordered
    assert int(float_to_ordered([value])[0]) == int(a[0])
