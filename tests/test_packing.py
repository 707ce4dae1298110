"""Wire packings: index round-trips for every b, nibble order, lanes and overflow refusal."""
import numpy as np
import pytest

from thc_ps.proto.packing import (LaneOverflowError, check_lane_capacity, lane_bits_for, pack_indices,
                           pack_lanes, packed_size, unpack_indices, unpack_lanes)


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
    assert lane_bits_for(9, 30) == 16
    with pytest.raises(ValueError):
        check_lane_capacity(2, 3, 12)
