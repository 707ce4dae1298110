"""Wire packings: index round-trips for every b, nibble order, lanes (sub-byte ones through the
PS's packer and the worker's widener on every path) and overflow refusal."""
import numpy as np
import pytest

from thc_ps.proto.packing import (LaneOverflowError, check_lane_capacity, lane_bits_for, pack_indices,
                                  pack_lanes, packed_size, result_lane_bits, unpack_indices, unpack_lanes)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [1, 7, 8, 9, 1001])
def test_index_round_trip(bits, count):
    z = np.random.default_rng(bits * count).integers(0, 1 << bits, count).astype(np.uint8)
    buf = pack_indices(z, bits)
    assert buf.size == packed_size(count, bits)
    assert np.array_equal(unpack_indices(buf.tobytes(), bits, count), z)


def test_nibble_order_high_first():
    assert pack_indices(np.array([0xA, 0x3, 0x5], np.uint8), 4).tolist() == [0xA3, 0x50]
    assert pack_indices(np.array([1, 0, 1], np.uint8), 1).tolist() == [0b10100000]
    assert pack_indices(np.array([5, 2], np.uint8), 3).tolist() == [0b10101000]


def test_index_errors():
    with pytest.raises(ValueError):
        pack_indices(np.array([16], np.uint8), 4)
    with pytest.raises(ValueError):
        unpack_indices(b"\x00", 4, 3)


@pytest.mark.parametrize("lane", [8, 16, 32])
def test_lane_round_trip(lane):
    y = np.random.default_rng(lane).integers(0, 1 << lane, 100, dtype=np.int64)
    buf = pack_lanes(y, lane)
    assert len(buf) == 100 * lane // 8
    assert np.array_equal(unpack_lanes(buf, lane), y)
    assert buf[:lane // 8] == int(y[0]).to_bytes(lane // 8, "big")


def test_overflow_refused_before_traffic():
    check_lane_capacity(8, 30, 8)            # 240 fits
    with pytest.raises(LaneOverflowError, match="270"):
        check_lane_capacity(9, 30, 8)
    with pytest.raises(LaneOverflowError):
        pack_lanes(np.array([256]), 8)
    assert lane_bits_for(9, 30) == 16 and lane_bits_for(4, 30) == 8         # the BLOB codecs' byte lanes
    assert [result_lane_bits(n, 30) for n in (1, 2, 4, 8, 9, 2185)] == [5, 6, 7, 8, 16, 32]
    assert result_lane_bits(1, 1) == 1 and result_lane_bits(4, 31) == 7 and result_lane_bits(4, 32) == 8
    check_lane_capacity(4, 30, 7)            # 120 fits 7 bits
    with pytest.raises(LaneOverflowError, match="widen the lane to 8 bits"):
        check_lane_capacity(5, 30, 7)
    with pytest.raises(LaneOverflowError):
        pack_lanes(np.array([128]), 7)
    for bad in (0, 9, 12, 33):
        with pytest.raises(ValueError, match="1..8, 16 or 32"):
            check_lane_capacity(1, 1, bad)


@pytest.mark.parametrize("lane", range(1, 8))
def test_sub_byte_lanes_are_packed_like_indices(lane):
    """Lanes of 1..7 bits: MSB first, ⌈count·L/8⌉ bytes, the padding bits 0 — the index
    packing's bytes exactly — and back, for counts that end mid-byte."""
    for count in (1, 3, 8, 13, 1000, 1632):
        y = np.random.default_rng(lane * count).integers(0, 1 << lane, count)
        buf = pack_lanes(y, lane)
        assert len(buf) == packed_size(count, lane) and buf == pack_indices(y, lane).tobytes()
        bits = np.unpackbits(np.frombuffer(buf, np.uint8))
        assert np.array_equal(bits[:count * lane].reshape(count, lane) @ (1 << np.arange(lane - 1, -1, -1)), y)
        assert not bits[count * lane:].any()
        assert np.array_equal(unpack_lanes(buf, lane, count), y)
    assert pack_lanes(np.array([0x7F, 0, 0x55]), 7) == bytes([0b11111110, 0b00000010, 0b10101000])
    with pytest.raises(ValueError, match="holds 1 values, expected 2"):
        unpack_lanes(b"\xff", 7, 2)


def _paths(best):
    return [p for p in (0, 1, 2) if p <= best]


@pytest.mark.parametrize("lane", range(1, 8))
def test_the_ps_packs_sub_byte_lanes_on_every_path_as_the_contract_says(lane):
    """ps_server/_fastpath.c's packer (scalar and BMI2, proto/lanes.h) writes proto/packing.py's
    bytes, at every count around its 8-lane groups, and masks a value above L bits instead of
    spilling it into the next lane."""
    from thc_ps.ps_server import _fastpath
    rng = np.random.default_rng(lane)
    for count in [*range(0, 34), 63, 64, 65, 1000, 1632]:
        y = rng.integers(0, 1 << lane, count).astype(np.uint8)
        want = pack_lanes(y, lane)
        for path in _paths(min(1, _fastpath.lanes_path())) + [-1]:
            assert _fastpath.pack_lanes(y.tobytes(), lane, path) == want, (count, path)
    high = np.full(16, 0xFF, np.uint8)
    assert _fastpath.pack_lanes(high.tobytes(), lane, 0) == pack_lanes(np.full(16, (1 << lane) - 1), lane)
    with pytest.raises(ValueError, match="bits must be 1..7"):
        _fastpath.pack_lanes(b"\x00", 8)


@pytest.mark.parametrize("lane", range(1, 8))
def test_the_worker_widens_sub_byte_lanes_on_every_path(lane):
    """compression/_kernels.c's widen_lanes (scalar, BMI2, AVX-512 VBMI) undoes the packing
    chunk by chunk: chunks of odd counts back to back (each payload padded on its own), a range
    of them widened alone leaves the others' bytes untouched; a chunk outside a buffer is
    refused."""
    from thc_ps.compression import _kernels
    rng = np.random.default_rng(10 + lane)
    counts = np.array([1632, 5, 64, 1, 131, 1632, 7, 200])
    ys = [rng.integers(0, 1 << lane, c).astype(np.uint8) for c in counts]
    payloads = [pack_lanes(y, lane) for y in ys]
    src = np.frombuffer(b"".join(payloads), np.uint8)
    roff = np.concatenate([[0], np.cumsum([len(p) for p in payloads])]).astype(np.int64)
    coff = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    levels = [0] + [1] * _kernels.has_avx2() + [2] * _kernels.has_avx512()
    for simd in levels:
        out = np.full(int(coff[-1]), 0xEE, np.uint8)
        _kernels.widen_lanes(src, roff, coff, 0, len(counts), lane, out, simd)
        assert np.array_equal(out, np.concatenate(ys)), simd
        out[:] = 0xEE
        _kernels.widen_lanes(src, roff, coff, 2, 5, lane, out, simd)
        assert np.array_equal(out[coff[2]:coff[5]], np.concatenate(ys[2:5]))
        assert (out[:coff[2]] == 0xEE).all() and (out[coff[5]:] == 0xEE).all()
    with pytest.raises(ValueError, match="outside its buffer"):
        _kernels.widen_lanes(src[:-1], roff, coff, 0, len(counts), lane, np.empty(int(coff[-1]), np.uint8))
    with pytest.raises(ValueError, match="bits must be 1..7"):
        _kernels.widen_lanes(src, roff, coff, 0, 1, 8, np.empty(int(coff[-1]), np.uint8))
