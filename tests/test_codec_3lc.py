"""3LC: the spec's acceptance checks (shared/specs/3lc.md §7)."""
import numpy as np
import pytest

from compression import threelc as T
from compression.codec import CodecError, Context, run_round


@pytest.mark.parametrize("q,expect", [([0] * 5, [121]), ([1] * 5, [242]), ([-1] * 5, [0]),
                                      ([-1, 0, 1, 0, 0], [49]), ([0], [81]), ([0] * 6, [117, 117])])
def test_base35_byte_map(q, expect):
    assert T.base35_encode(np.array(q)).tolist() == expect


def test_base35_size_range_round_trip():
    rng = np.random.default_rng(0)
    for n in list(range(0, 40)) + [999, 1000, 10000]:
        q = rng.integers(-1, 2, n).astype(np.int8)
        b = T.base35_encode(q)
        assert b.size == -(-n // 5) and (b.size == 0 or b.max() <= 242)
        assert np.array_equal(T.base35_decode(b, n), q)


@pytest.mark.parametrize("k,expect", [(1, [121]), (2, [243]), (3, [244]), (14, [255]), (15, [255, 121]),
                                      (16, [255, 243]), (28, [255, 255]), (29, [255, 255, 121]),
                                      (100, [255] * 7 + [243])])
def test_zre_run_table(k, expect):
    assert T.zre_encode(np.full(k, 121, np.uint8)).tolist() == expect


def test_zre_round_trip_no_expansion_and_tolerant_decoder():
    rng = np.random.default_rng(1)
    for density in (0.0, 0.2, 0.5, 0.9, 1.0):
        for length in (1, 13, 500):
            b = np.where(rng.random(length) < density, 121, rng.integers(0, 243, length)).astype(np.uint8)
            c = T.zre_encode(b)
            assert np.array_equal(T.zre_decode(c), b) and c.size <= b.size
    assert T.zre_encode(np.full(1000, 121, np.uint8)).size == -(-1000 // 14)
    assert T.zre_decode(np.array([243, 243], np.uint8)).tolist() == [121] * 4
    assert T.zre_decode(np.array([121, 121], np.uint8)).tolist() == [121] * 2
    assert T.zre_decode(np.array([255, 243], np.uint8)).tolist() == [121] * 16


def serial_zre(b):
    out, i = [], 0
    while i < len(b):
        if b[i] != 121:
            out.append(b[i]); i += 1; continue
        j = i
        while j < len(b) and b[j] == 121:
            j += 1
        k = j - i
        while k >= 14:
            out.append(255); k -= 14
        if k == 1:
            out.append(121)
        elif k >= 2:
            out.append(243 + k - 2)
        i = j
    return out


def test_vectorized_zre_equals_serial_greedy():
    rng = np.random.default_rng(2)
    for _ in range(300):
        n = int(rng.integers(1, 200))
        b = np.where(rng.random(n) < rng.random(), 121, rng.integers(0, 243, n)).astype(np.uint8)
        assert T.zre_encode(b).tolist() == serial_zre(b.tolist())


def test_quantizer_properties():
    rng = np.random.default_rng(3)
    for s in (1.0, 1.5, 1.75, 1.9):
        a = rng.standard_normal(5000).astype(np.float32)
        q, m, e = T.quantize(a, None, s)
        big = np.abs(a).max()
        assert set(np.unique(q)) <= {-1, 0, 1}
        assert q[np.argmax(np.abs(a))] == np.sign(a[np.argmax(np.abs(a))])
        assert np.array_equal(q != 0, np.abs(a) > s * big / 2)
        assert m == np.float32(s * big)
        assert np.abs(e).max() <= s * big / 2 + 1e-6
    with pytest.raises(ValueError):
        T.quantize(a, None, 2.0)


def test_zero_and_one_hot_sizes():
    codec = T.ThreeLCCodec()
    ctx = Context("t", 10**6)
    st = {}
    p = codec.encode(np.zeros(10**6, np.float32), st, None, ctx)
    assert len(p) - T.HEAD.size == 14286 and not np.any(st["e"])
    x = np.zeros(10**6, np.float32)
    x[0] = -3.0            # spec §7.10: the one-hot at index 0
    p = codec.encode(x, {}, None, ctx)
    assert len(p) - T.HEAD.size == 14287
    out = codec.decode(p, ctx)
    assert out[0] == -3.0 and np.count_nonzero(out) == 1


@pytest.mark.parametrize("s,nbytes", [(1.0, 75700), (1.5, 18100), (1.75, 14950), (1.9, 14500)])
def test_clipped_gaussian_sizes(s, nbytes):
    x = np.clip(np.random.default_rng(0).standard_normal(10**6), -4, 4).astype(np.float32)
    x[0] = 4.0
    p = T.ThreeLCCodec(s=s).encode(x, {}, None, Context("t", 10**6))
    assert abs((len(p) - T.HEAD.size) - nbytes) <= 0.02 * nbytes
    q = T.ThreeLCCodec(s=s, use_zre=False).encode(x, {}, None, Context("t", 10**6))
    assert len(q) - T.HEAD.size == 200000


def test_error_feedback_telescopes():
    codec = T.ThreeLCCodec()
    st, rng = {}, np.random.default_rng(4)
    sent = total = 0
    ctx = Context("t", 2000)
    for _ in range(40):
        x = rng.standard_normal(2000).astype(np.float32)
        total = total + x
        sent = sent + codec.decode(codec.encode(x, st, None, ctx), ctx)
    assert np.abs(total - sent - st["e"]).max() < 1e-3


def test_pull_context_shared_and_workers_identical():
    codec = T.ThreeLCCodec()
    rng = np.random.default_rng(5)
    states = [codec.new_state() for _ in range(3)]
    ps = codec.new_ps_state()
    avg_sum = delivered = 0
    for r in range(5):
        g = [rng.standard_normal(3000).astype(np.float32) for _ in range(3)]
        est, ups, down = run_round(codec, g, rng, states=states, ps_state=ps, round_no=r)
        ctx = Context("t", 3000, contributors=3)
        avg_sum = avg_sum + np.mean([codec.decode(u, ctx) for u in ups], axis=0, dtype=np.float32)
        delivered = delivered + est
    assert ps["encodes"] == 5
    assert np.abs(avg_sum - delivered - ps["e"]).max() < 1e-3     # W_server − W̃ == E_pull


def test_raw_fallback_and_rejections():
    codec = T.ThreeLCCodec(min_elements=100)
    x = np.arange(10, dtype=np.float32)
    assert np.array_equal(codec.decode(codec.encode(x, {}, None, Context("t", 10)), Context("t", 10)), x)
    good = T.ThreeLCCodec().encode(np.ones(50, np.float32), {}, None, Context("t", 50))
    for bad in (good[:5], good[:-1], good + b"\x00", b"\x07" + good[1:], good[:2] + b"\x09" + good[3:]):
        with pytest.raises(CodecError):
            T.ThreeLCCodec().decode(bad, Context("t", 50))
    with pytest.raises(CodecError):
        T.ThreeLCCodec().decode(good, Context("t", 51))
