"""The wire contract: header layout, scapy dissection agrees with our parser, control messages."""
import numpy as np
import pytest
from scapy.all import IP, UDP, raw

from thc_ps.proto import control
from thc_ps.proto import headers as H
from thc_ps.proto.job import JobConfig
from thc_ps.proto.packing import LaneOverflowError
from thc_ps.proto.scapy_layers import THC


def random_header(rng):
    return H.Header(type=int(rng.integers(1, 6)), job_id=int(rng.integers(0, 1 << 16)),
                    worker_id=int(rng.integers(0, 256)), num_workers=int(rng.integers(0, 256)),
                    elem_bits=int(rng.integers(0, 256)), slot=int(rng.integers(0, 1 << 16)),
                    round=int(rng.integers(0, 1 << 32)), offset=int(rng.integers(0, 1 << 32)),
                    count=int(rng.integers(0, 1 << 16)), bitmap=int(rng.integers(0, 1 << 32)),
                    contributors=int(rng.integers(0, 256)), op=int(rng.integers(0, 4)),
                    flags=int(rng.integers(0, 256)), nonce=int(rng.integers(0, 1 << 32)),
                    token=int(rng.integers(0, 1 << 32)))


def test_scapy_and_parser_agree_on_random_packets():
    rng = np.random.default_rng(0)
    for _ in range(200):
        h = random_header(rng)
        payload = rng.bytes(int(rng.integers(0, 64)))
        datagram = H.build(h, payload)
        frame = raw(IP(dst="10.0.0.1") / UDP(sport=1234, dport=9000) / datagram)
        dissected = IP(frame)[THC]
        parsed, pl = H.parse(datagram)
        for name in H.FIELD_ORDER:
            assert getattr(dissected, name) == getattr(parsed, name) == getattr(h, name), name
        assert bytes(pl) == payload == bytes(dissected.payload)
    built = raw(THC(type=H.RESULT, slot=3, round=9, count=2) / b"\x01\x02")
    h, pl = H.parse(built)
    assert (h.type, h.slot, h.round, h.count, h.payload_len, bytes(pl)) == (H.RESULT, 3, 9, 2, 2, b"\x01\x02")


def test_build_fast_equals_build():
    rng = np.random.default_rng(1)
    for _ in range(100):
        h = random_header(rng)
        h.bitmap = h.contributors = 0
        payload = rng.bytes(int(rng.integers(0, 64)))
        fast = H.build_fast(h.type, h.job_id, h.worker_id, h.num_workers, h.elem_bits, h.slot, h.round,
                            h.offset, h.count, h.op, payload, flags=h.flags, nonce=h.nonce, token=h.token)
        assert fast == H.build(h, payload)


def test_retransmission_sets_only_the_flag():
    d = H.build(H.Header(type=H.DATA, slot=3, round=7, count=2, flags=H.F_RESENT), b"\x12")
    h, pl = H.parse(H.as_retransmission(d))
    assert h.flags == H.F_RESENT | H.F_RETRANSMIT and (h.slot, h.round, bytes(pl)) == (3, 7, b"\x12")
    assert H.as_retransmission(d)[:4] + H.as_retransmission(d)[5:] == d[:4] + d[5:]


def test_header_is_40_bytes_network_order():
    b = H.Header(type=H.DATA, slot=0x0102, round=0x03040506, nonce=0x0A0B0C0D, token=0x11223344).pack()
    assert len(b) == H.HEADER_SIZE == 40 and b[2] == H.VERSION == 2
    assert b[:2] == b"TH" and b[10:12] == b"\x01\x02" and b[12:16] == b"\x03\x04\x05\x06"
    assert b[30:32] == b"\x00\x00" and b[32:36] == b"\x0a\x0b\x0c\x0d" and b[36:40] == b"\x11\x22\x33\x44"


@pytest.mark.parametrize("mutate,reason", [
    (lambda d: d[:10], "malformed"),
    (lambda d: b"XX" + d[2:], "malformed"),
    (lambda d: d[:2] + b"\x07" + d[3:], "wrong_version"),
    (lambda d: d[:3] + b"\x09" + d[4:], "malformed"),
    (lambda d: d + b"\x00", "malformed"),
])
def test_parse_rejects(mutate, reason):
    d = H.build(H.Header(type=H.DATA, count=2), b"\xab")
    with pytest.raises(H.PacketError) as exc:
        H.parse(mutate(d))
    assert exc.value.reason == reason


def test_job_contract_validation():
    job = JobConfig(num_workers=4)
    # 1500 − 28 (IPv4 + UDP) − 40 (THC header) = 1432 payload bytes.  n·g = 120 takes 7-bit lanes:
    # ⌊1432·8/7⌋ = 1636, cut to a multiple of 8: 1632 lanes in 1428 bytes, 816 bytes of indices up
    assert job.lane_bits == 7 and job.elems_per_packet == 1632
    assert job.down_payload_len(1632) == 1428 and job.up_payload_len(1632) == 816
    assert job.down_payload_len(5) == 5          # 35 bits: ⌈35/8⌉ bytes, not ⌊⌋
    eight = JobConfig(num_workers=4, lane_bits=8)
    assert eight.elems_per_packet == 1432 and eight.down_payload_len(1432) == 1432
    assert [JobConfig(num_workers=n).lane_bits for n in (1, 2, 3, 5, 8, 9)] == [5, 6, 7, 8, 8, 16]
    assert JobConfig.from_msg(job.to_msg()) == job
    with pytest.raises(LaneOverflowError, match="widen the lane to 8 bits"):
        JobConfig(num_workers=5, granularity=30, lane_bits=7)
    for bad in (0.5, 9, 12, 64, True):
        with pytest.raises(ValueError, match="lane_bits must be 1..8, 16 or 32"):
            JobConfig(num_workers=2, lane_bits=bad)
    with pytest.raises(LaneOverflowError):
        JobConfig(num_workers=9, granularity=30, lane_bits=8)
    assert JobConfig(num_workers=9, granularity=30, lane_bits=16).elems_per_packet == 712
    for bad in (dict(num_workers=33), dict(num_workers=2, quorum=0), dict(num_workers=2, codec="zip"),
                dict(num_workers=2, mtu=40), dict(num_workers=2, elems_per_packet=5000)):
        with pytest.raises(ValueError):
            JobConfig(**bad)
    msg = job.to_msg()
    msg["table"] = [0] * 16
    with pytest.raises(ValueError, match="table"):
        JobConfig.from_msg(msg)


def test_control_messages():
    assert control.decode(control.encode({"type": "stats"})) == {"type": "stats"}
    for raw_bytes in (b"\xc1", control.encode([1, 2]), control.encode({"kind": "x"})):
        with pytest.raises(control.ControlError):
            control.decode(raw_bytes)


def test_p4_program_is_generated_from_the_generator():
    from thc_ps.p4 import gen_p4
    assert gen_p4.main(["--check"]) == 0
    text = (gen_p4.HERE / "thc.p4").read_text()
    assert text.count(f"register<bit<8>>({2 * gen_p4.SLOTS}) acc") == gen_p4.LANES
    assert f"const bit<16> THC_PORT = {gen_p4.PORT};" in text
    tna = gen_p4.TNA.output.read_text()
    assert tna.count("table lut") == gen_p4.LANES                       # one lookup table per lane
    assert tna.count("Register<bit<32>, bank_index_t>(8192, 0) acc") == gen_p4.LANES // 4
    assert "$" not in text + tna                                        # every placeholder filled


def test_p4_generator_is_pure_and_checks_every_target(tmp_path, monkeypatch):
    """generate() changes nothing (no module state), and --check notices a stale program of
    either target."""
    import dataclasses

    from thc_ps.p4 import gen_p4
    small = gen_p4.generate("v1model", lanes=8)
    assert small.count("table lut") == 8 and gen_p4.LANES == 32
    assert gen_p4.generate("v1model") == (gen_p4.HERE / "thc.p4").read_text()
    stale = tmp_path / "thc_tna.p4"
    stale.write_text(gen_p4.generate("tna").replace("ROUND_WINDOW = 1024", "ROUND_WINDOW = 1000"))
    monkeypatch.setitem(gen_p4.TARGETS, "tna", dataclasses.replace(gen_p4.TNA, output=stale))
    assert gen_p4.main(["--check", "--target", "v1model"]) == 0
    assert gen_p4.main(["--check"]) == 1
    with pytest.raises(ValueError):
        gen_p4.generate("tna", lanes=30)


def _event_constants(text: str) -> dict:
    import re
    return {name: int(value) for name, value in re.findall(r"const event_t (C_\w+) = (\d+);", text)}


def test_p4_event_counters_are_the_control_planes():
    """Both programs count events at the indices the control plane reads them from (one list,
    p4/spec.py), every event a template counts is in that list, and the drop reasons are the
    software PS's."""
    import re

    from thc_ps.p4 import control, gen_p4, spec
    from thc_ps.ps_server.reference import COUNTERS, DROP_REASONS
    expected = {spec.event_constant(e): i for i, e in enumerate(control.EVENTS)}
    for target in gen_p4.TARGETS.values():
        consts = _event_constants(target.output.read_text())
        assert {k: v for k, v in consts.items() if k != "C_NONE"} == expected, target.name
        assert all(v < spec.EVENT_CELLS for v in consts.values())
        for piece in target.pieces:
            used = set(re.findall(r"\bC_[A-Z_]+\b", (gen_p4.TEMPLATES / piece).read_text()))
            assert used <= set(consts) | {"C_NONE"}, (piece, used - set(consts))
    assert set(control.DROPS) <= set(DROP_REASONS)
    assert set(control.EVENTS) - set(control.DROPS) <= set(COUNTERS)
