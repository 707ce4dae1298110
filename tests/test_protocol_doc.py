"""docs/protocol.md is the contract: its generated tables match the code, its replies list the
fields the PS sends, its random streams reproduce the project's values from their description
alone, and a worker written from it alone (`SpecWorker`, no project imports) joins a real job
beside a real worker and gets exact sums."""
import socket
import struct
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from thc_ps.deploy import protodoc
from thc_ps.proto import control
from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.server import PSServer

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def test_generated_tables_match_the_code():
    text = DOC.read_text()
    assert protodoc.render(text) == text, "docs/protocol.md is stale: python -m thc_ps.deploy.protodoc --write"
    assert protodoc.main(["--check"]) == 0


def test_every_request_field_and_error_code_is_documented():
    text = DOC.read_text()
    for kind, spec in control.SCHEMA.items():
        assert f"`{kind}`" in text
        for name in spec:
            assert name in protodoc.REQUEST_FIELDS, f"{kind}.{name} has no meaning in deploy/protodoc.py"
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
        # progress: −1 until a rank reports one (§6 status reply), then what it sent
        assert status["progress"] == {"0": -1}
        beat = ask({"type": "heartbeat", "worker_id": 0, "session": config["session"], "progress": 3})
        assert beat["progress"] == {"0": 3}
        # sync_put from a rank that is not the sync source: `refused`, naming the source
        other = ask({"type": "register", "worker_id": 1, "data_addr": ["127.0.0.1", 5556]})
        err = ask({"type": "sync_put", "round": 0, "worker_id": 1, "session": other["session"], "blob": b"x"})
        assert err["code"] == "refused" and "rank 0 is" in err["message"], err
        assert ask({"type": "sync_put", "round": 0, "worker_id": 0, "session": config["session"],
                    "blob": b"x"})["type"] == "ok"
    finally:
        sock.close(0)
        server.stop()


# ---------------------------------------------------------------- random streams, from the doc
def _rng(*ints):
    return np.random.default_rng(np.random.SeedSequence(list(ints)))


def test_random_streams_as_documented():
    """§5's seed lists and draws; the uniforms from a key and the whole encode are checked
    bit for bit against a real worker's packets by tests/test_reference_encoder.py."""
    from thc_ps.compression.hadamard import rademacher_signs
    from thc_ps.compression.stochastic import counter_uniforms, key_from
    from thc_ps.deploy.launch import gradient
    from thc_ps.worker.client import Worker, round_rng
    seed, r, j, p = 7, 3, 1, 1000
    bits = np.unpackbits(np.frombuffer(_rng(seed % 2**32, r % 2**32, j).bytes(-(-p // 8)), np.uint8))[:p]
    assert np.array_equal(np.where(bits == 1, -1.0, 1.0).astype(np.float32), rademacher_signs(seed, r, j, p))
    # the per-round key: the first 64-bit output of PCG64 on [s, rank, r, 0x52]
    raw = np.random.PCG64(np.random.SeedSequence([seed, 2, r, 0x52])).random_raw()
    assert key_from(round_rng(seed, 2, r)) == int(raw) == key_from(_rng(seed, 2, r, 0x52))
    # one stream (training): the e-th encode's key is the e-th output of PCG64 on [s, rank]
    w = Worker.__new__(Worker)
    w.rng, w.per_round_rng = _rng(seed, 2), False
    assert [key_from(w.round_rng(e)) for e in range(3)] == \
        np.random.PCG64(np.random.SeedSequence([seed, 2])).random_raw(3).tolist()
    # the generated example of §5 is the code's: key and first uniforms of (0, 0, 0)
    text = DOC.read_text()
    key = key_from(round_rng(0, 0, 0))
    assert f"| K | 0x{key:016x} |" in text
    for k, u in enumerate(counter_uniforms(key, 6)):
        assert f"| u_{k} | {int(u * 2 ** 24)} · 2^−24 = {float(u)!r} |" in text
    g = _rng(seed, r, 2, 0x6AD)
    z = g.standard_normal(5000)
    s = g.lognormal(0, 1)
    want = (np.round(np.clip(z * s, -127, 127) * 1024) / 1024).astype(np.float32)
    assert np.array_equal(want, gradient(seed, r, 2, 5000))


def test_the_timer_scales_each_shard_as_section_3_says():
    """§3's σ_h, read from the document: 3 × the lower quartile of (round trip / k) over a
    phase's answered chunks to shard h, once that phase had at least N of them.  The code's
    timer, fed a phase of N − 1 answers from one shard and N from another (and none from a
    third), measures exactly the second, with the document's factor."""
    import re

    from thc_ps.worker.rto import T_SCALES, RetransmitTimer
    text = " ".join(DOC.read_text().split())
    m = re.search(r"σ_h = (\d+) × the lower quartile of \(round trip / k\) over a phase's answered chunks "
                  r"to shard h, once a phase had at least (\d+) of them", text)
    assert m, "§3 no longer states σ_h as this test reads it"
    factor, least = int(m.group(1)), int(m.group(2))
    per = np.r_[np.full(least - 1, 5e-3), np.linspace(1e-3, 4e-3, least)]   # round trip / k
    shard = np.r_[np.zeros(least - 1, np.int32), np.ones(least, np.int32)]
    k = np.arange(1, shard.size + 1, dtype=np.int32)
    t = RetransmitTimer(0.05, 1.0, shards=3)
    t.phase_done(shard, np.ones(shard.size), 1 + per * k, k)
    quartile = np.percentile(per[least - 1:], 25)
    assert t.T[T_SCALES:T_SCALES + 3].tolist() == pytest.approx([0, factor * quartile, 0])


_BUCKETS = """
import json, sys, torch, torch.distributed as dist, torch.nn.functional as F
from thc_ps.deploy import lm_experiment as lm
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
torch.manual_seed(0)
ddp = torch.nn.parallel.DistributedDataParallel(lm.example().CharLM(64, 128, 4, heads=4))
seen = {}
def hook(state, bucket):
    seen[bucket.index()] = [p.numel() for p in bucket.parameters()]
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
ddp.register_comm_hook(None, hook)
x = torch.randint(0, 256, (2, 64))
for _ in range(3):                      # DDP settles its buckets after the first step
    F.cross_entropy(ddp(x).reshape(-1, 256), x.reshape(-1)).backward()
print(json.dumps(list(seen.values())))
dist.destroy_process_group()
"""


def test_tensors_blocks_and_norm_chunks_as_section_4_says(tmp_path):
    """§4 step 1's example (the example LM's DDP bucket: its tensors, blocks and D, cut tensor
    by tensor and as one tensor) and step 2's norms per NORM packet, against the code: the
    bucket as DDP makes it (a one-rank DDP in a fresh process), thc.make_layout, and
    Worker.norms_per_chunk."""
    import json
    import re
    import subprocess
    import sys
    import types

    from thc_ps.compression import thc
    from thc_ps.worker.client import Worker
    flat = " ".join(DOC.read_text().split())
    m = re.search(r"chunks of K = .*? norms \((\d[\d,]*) at MTU (\d[\d,]*)\)", flat)
    k, mtu = (int(v.replace(",", "")) for v in m.groups())
    assert Worker.norms_per_chunk.fget(types.SimpleNamespace(job=JobConfig(num_workers=4, mtu=mtu))) == k
    m = re.search(r"bucket of ([\d,]+) floats in the example language model holds (\d+) tensors: (\d+) blocks, "
                  r"D = ([\d,]+), against (\d+) blocks and ([\d,]+) cut as one tensor", flat)
    dim, tensors, blocks, big_d, one_blocks, one_d = (int(v.replace(",", "")) for v in m.groups())
    out = subprocess.run([sys.executable, "-c", _BUCKETS, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    sizes = next(b for b in json.loads(out.stdout.strip().splitlines()[-1]) if sum(b) == dim)
    cut, whole = thc.make_layout(dim, segments=sizes), thc.make_layout(dim)
    assert (len(sizes), len(cut.padded), cut.padded_dim) == (tensors, blocks, big_d)
    assert (len(whole.padded), whole.padded_dim) == (one_blocks, one_d)


def test_every_drop_counter_is_documented():
    from thc_ps.ps_server.reference import DROP_REASONS
    text = DOC.read_text()
    for reason in DROP_REASONS:
        assert f"`{reason}`" in text, f"drop counter {reason} is not in docs/protocol.md"


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
    from thc_ps.compression import thc
    from thc_ps.worker.client import Worker, round_rng
    from thc_ps.worker.transport import Transport
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
    # RESULT lanes as §2 says: L = lane_bits (6 for n·g = 60) bits each, MSB first, every
    # chunk's payload ⌈count·L/8⌉ bytes with its own zero padding
    L = spec.job["lane_bits"]
    assert L == 6
    lanes = []
    for (_, count, _), (_, _, p) in zip(chunks, results):
        assert len(p) == -(-count * L // 8)
        bits = np.unpackbits(np.frombuffer(p, np.uint8))
        assert not bits[count * L:].any()
        lanes.append(bits[:count * L].reshape(count, L) @ (1 << np.arange(L - 1, -1, -1)))
    lanes = np.concatenate(lanes)
    assert all(b == 0b11 and k == 2 for b, k, _ in results)
    assert np.array_equal(lanes, table[mine] + table[z_real])
    assert real_out["avg"].shape == (dim,) and np.isfinite(real_out["avg"]).all()


@pytest.mark.parametrize("value", [0.0, -0.0, 1.5, -2.0, 3.4e38, float("inf")])
def test_norm_codes_order_like_the_floats(value):
    a, b = SpecWorker.ordered([value]), SpecWorker.ordered([np.nextafter(np.float32(value), np.float32(np.inf))])
    assert int(a[0]) <= int(b[0])
    from thc_ps.proto.headers import float_to_ordered
    assert int(float_to_ordered([value])[0]) == int(a[0])
