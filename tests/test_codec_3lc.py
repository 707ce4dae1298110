"""3LC: the acceptance checks of docs/codec-3lc.md (note 7) plus framing and codec behaviour.

Byte vectors are worked examples (docs/codec-3lc.md notes 2.5, 2.6, 7.1, 7.4, 7.6, 7.10); the
consecutive-layout vector is worked by hand in its test. Size expectations (§7.13–7.15) use
±2% (or stated) tolerances.
"""
import math

import numpy as np
import pytest

from thc_ps.compression import registry
from thc_ps.compression import threelc as T
from thc_ps.compression.codec import CodecError, Context, run_round

F32_MAX = np.finfo(np.float32).max


def ctx(n, k=1):
    return Context("t", n, contributors=k)


def clipped_gaussian(n=10**6, seed=0):
    """Spec §7.13: clip(N(0,1), −4, 4) as float32; with 10^6 draws some value is clipped, M = 4."""
    x = np.clip(np.random.default_rng(seed).standard_normal(n), -4, 4).astype(np.float32)
    assert n < 10**6 or np.abs(x).max() == 4.0
    return x


def serial_zre(b):
    """The paper's serial ZRE (§3.3) with greedy 14-chunks (docs/codec-3lc.md A6), written as a plain loop."""
    out, i = [], 0
    while i < len(b):
        if b[i] != 121:
            out.append(b[i])
            i += 1
            continue
        j = i
        while j < len(b) and b[j] == 121:
            j += 1
        k = j - i
        out += [255] * (k // 14)
        k %= 14
        out += [121] if k == 1 else ([241 + k] if k >= 2 else [])
        i = j
    return out


# ----------------------------------------------------------------------------- base-3^5 (§7.1–7.3)

@pytest.mark.parametrize("q,expect", [([0] * 5, [121]), ([1] * 5, [242]), ([-1] * 5, [0]),
                                      ([-1, 0, 1, 0, 0], [49]), ([0], [81]), ([0] * 6, [117, 117])])
def test_base35_spec_byte_map(q, expect):
    assert T.base35_encode(np.array(q, np.int8)).tolist() == expect


def test_base35_planar_versus_consecutive_layout():
    # q = [1, −1, 0 × 8]: d = [2, 0, 1 × 8], L = 2.
    # planar: P0 = [2, 0], P1..P4 = [1, 1] → [162+27+9+3+1, 0+27+9+3+1] = [202, 40]
    # consecutive: quintuples [2,0,1,1,1], [1,1,1,1,1] → [162+0+9+3+1, 121] = [175, 121]
    q = np.array([1, -1] + [0] * 8, np.int8)
    assert T.base35_encode(q).tolist() == [202, 40]
    assert T.base35_encode(q, "consecutive").tolist() == [175, 121]
    assert T.base35_encode(np.zeros(6, np.int8), "consecutive").tolist() == [121, 81]   # pad digit 0


def test_base35_size_and_range_for_every_n_up_to_1000():
    rng = np.random.default_rng(0)
    for n in range(1001):
        b = T.base35_encode(rng.integers(-1, 2, n).astype(np.int8))
        assert b.dtype == np.uint8 and b.size == math.ceil(n / 5)
        assert b.size == 0 or b.max() <= 242
    assert T.base35_encode(np.ones(1000, np.int8)).max() == 242


@pytest.mark.parametrize("layout", T.LAYOUTS)
def test_base35_round_trip(layout):
    rng = np.random.default_rng(1)
    for n in list(range(0, 30)) + [999, 1001, 4096, 9999, 10**4]:
        q = rng.integers(-1, 2, n).astype(np.int8)
        b = T.base35_encode(q, layout)
        assert np.array_equal(T.base35_decode(b, n, layout), q)
        m = np.float32(rng.uniform(0.1, 10))
        fused = T.base35_dequantize(b, n, m, layout)
        assert fused.dtype == np.float32 and np.array_equal(fused, T.dequantize(q, m))


def test_base35_rejects_bad_input():
    with pytest.raises(ValueError):
        T.base35_encode(np.array([0, 2, 0], np.int8))
    with pytest.raises(ValueError):
        T.base35_encode(np.zeros(5, np.int8), "zigzag")
    with pytest.raises(CodecError, match="cannot hold"):
        T.base35_decode(np.array([121, 121], np.uint8), 11)
    with pytest.raises(CodecError, match="above 242"):
        T.base35_decode(np.array([243], np.uint8), 5)


# ----------------------------------------------------------------------------- zero-run encoding (§7.4–7.7)

@pytest.mark.parametrize("k,expect", [(1, [121]), (2, [243]), (3, [244]), (14, [255]), (15, [255, 121]),
                                      (16, [255, 243]), (28, [255, 255]), (29, [255, 255, 121]),
                                      (100, [255] * 7 + [243])])
def test_zre_run_table(k, expect):
    assert T.zre_encode(np.full(k, 121, np.uint8)).tolist() == expect
    assert T.zre_decode(np.array(expect, np.uint8)).tolist() == [121] * k


def test_zre_round_trip_never_expands():
    rng = np.random.default_rng(2)
    for density in (0.0, 0.1, 0.5, 0.9, 0.99, 1.0):
        for length in (0, 1, 13, 14, 15, 500, 5000):
            b = np.where(rng.random(length) < density, 121, rng.integers(0, 243, length)).astype(np.uint8)
            c = T.zre_encode(b)
            assert c.size <= b.size
            assert np.array_equal(T.zre_decode(c), b)
    for length in (1, 2, 13, 14, 15, 27, 28, 29, 1000, 14 * 1000 + 3):
        assert T.zre_encode(np.full(length, 121, np.uint8)).size == math.ceil(length / 14)


def test_zre_matches_serial_greedy_encoder():
    rng = np.random.default_rng(3)
    for _ in range(400):
        n = int(rng.integers(1, 300))
        b = np.where(rng.random(n) < rng.random(), 121, rng.integers(0, 243, n)).astype(np.uint8)
        assert T.zre_encode(b).tolist() == serial_zre(b.tolist())


def test_zre_decoder_accepts_any_valid_split():
    assert T.zre_decode(np.array([243, 243], np.uint8)).tolist() == [121] * 4
    assert T.zre_decode(np.array([121, 121], np.uint8)).tolist() == [121] * 2
    assert T.zre_decode(np.array([255, 243], np.uint8)).tolist() == [121] * 16
    assert T.zre_decode(np.array([250, 255], np.uint8)).tolist() == [121] * 23
    every = np.arange(256, dtype=np.uint8)
    out = T.zre_decode(every)
    assert out.max() <= 242 and out.size == 243 + sum(range(2, 15))


def test_zre_decoder_refuses_wrong_expanded_length():
    T.zre_decode(np.array([5, 255], np.uint8), expected=15)
    for expected in (14, 16):
        with pytest.raises(CodecError, match="expands to 15"):
            T.zre_decode(np.array([5, 255], np.uint8), expected=expected)


def test_parallel_zre_decodes_the_same_and_costs_at_most_p_minus_1_bytes():
    rng = np.random.default_rng(4)
    for _ in range(150):
        n = int(rng.integers(0, 400))
        b = np.where(rng.random(n) < rng.choice([0.3, 0.9, 0.99, 1.0]), 121,
                     rng.integers(0, 243, n)).astype(np.uint8)
        serial = T.zre_encode(b)
        for parts in (1, 2, 3, 7, 16):
            c = T.zre_encode_parallel(b, parts)
            assert np.array_equal(T.zre_decode(c), b)
            assert c.size <= serial.size + parts - 1
            assert np.array_equal(T.zre_decode_parallel(c, parts), b)
        assert np.array_equal(T.zre_encode_parallel(b, 1), serial)
    # a 10-run split 5 | 5 coalesces into one byte again
    assert T.zre_encode_parallel(np.full(10, 121, np.uint8), 2).tolist() == [251]


# ----------------------------------------------------------------------------- quantizer (§7.9–7.12)

@pytest.mark.parametrize("s", [1.0, 1.5, 1.75, 1.9])
def test_quantizer_is_ternary_with_threshold_and_exact_magnitudes(s):
    a = np.random.default_rng(5).standard_normal(20000).astype(np.float32)
    q, m, e = T.quantize(a, None, s)
    big = float(np.abs(a).max())
    i = int(np.argmax(np.abs(a)))
    assert set(np.unique(q).tolist()) <= {-1, 0, 1}
    assert q[i] == np.sign(a[i])
    assert m == np.float32(s * big)
    assert np.array_equal(q != 0, np.abs(a) > s * big / 2)
    out = T.unpack(T.pack(q, m), a.size)
    assert set(np.unique(np.abs(out[q != 0])).tolist()) == {m}
    assert np.abs(e).max() <= s * big / 2 * (1 + 1e-6)
    assert np.array_equal(e, a - m * q.astype(np.float32))       # the exact float32 residual (A7)


def test_rounding_ties_go_to_even():
    # A = [2, 1, −1] at s = 1: m = 2, A/m = [1, 0.5, −0.5] → rint → [1, 0, 0] (docs/codec-3lc.md A1)
    q, m, e = T.quantize(np.array([2.0, 1.0, -1.0], np.float32), None, 1.0)
    assert q.tolist() == [1, 0, 0] and m == 2.0 and e.tolist() == [0.0, 1.0, -1.0]


@pytest.mark.parametrize("s", [0.99, 2.0, 2.5, float("nan")])
def test_sparsity_multiplier_out_of_range(s):
    with pytest.raises(ValueError, match="1 <= s < 2"):
        T.quantize(np.ones(3, np.float32), None, s)
    with pytest.raises(ValueError, match="1 <= s < 2"):
        T.ThreeLCCodec(s=s)


def test_all_zero_tensor_and_one_hot_sizes():
    codec, c = T.ThreeLCCodec(), ctx(10**6)
    st = codec.new_state()
    p = codec.encode(np.zeros(10**6, np.float32), st, None, c)
    head, _ = T.parse(p)
    assert head.m == 0.0 and head.length == 14286
    assert not np.any(st["e"]) and not np.isnan(st["e"]).any()
    out = codec.decode(p, c)
    assert not out.any() and not np.isnan(out).any()
    x = np.zeros(10**6, np.float32)
    x[0] = -3.0
    p = codec.encode(x, codec.new_state(), None, c)
    assert T.parse(p)[0].m == 3.0 and T.parse(p)[0].length == 14287
    out = codec.decode(p, c)
    assert out[0] == -3.0 and np.count_nonzero(out) == 1


def test_empty_tensor():
    codec = T.ThreeLCCodec()
    p = codec.encode(np.zeros(0, np.float32), codec.new_state(), None, ctx(0))
    assert len(p) == T.HEAD.size and codec.decode(p, ctx(0)).size == 0


def test_non_finite_input_refused_and_state_untouched():
    codec, st = T.ThreeLCCodec(), {"e": None}
    codec.encode(np.ones(10, np.float32), st, None, ctx(10))
    before = st["e"].copy()
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(10, np.float32)
        x[3] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            codec.encode(x, st, None, ctx(10))
        assert np.array_equal(st["e"], before)


def test_scale_overflow_clamps_to_float32_max():
    x = np.array([3e38, -1e38, 2e38, 0], np.float32)
    q, m, e = T.quantize(x, None, 1.9)
    assert m == F32_MAX and q.tolist() == [1, 0, 1, 0]
    assert np.isfinite(e).all() and np.abs(e).max() <= m / 2


@pytest.mark.parametrize("s", [1.0, 1.5, 1.75, 1.9])
def test_residual_bound_every_step(s):
    rng, e = np.random.default_rng(6), None
    ratios = []
    for _ in range(25):
        x = rng.standard_normal(20000).astype(np.float32)
        a = x + (e if e is not None else 0)
        q, m, e = T.quantize(x, e, s)
        big = float(np.abs(a).max())
        assert np.abs(e).max() <= s * big / 2 * (1 + 1e-6) + 1e-6
        ratios.append(float(np.abs(e).max()) / big)
    assert s / 2 - 5e-3 <= max(ratios) <= s / 2 * (1 + 1e-6)        # docs/codec-3lc.md note 7.11: 0.5, 0.75, 0.875, 0.95


@pytest.mark.parametrize("s", [1.0, 1.5, 1.9])
def test_error_feedback_telescopes(s):
    codec = T.ThreeLCCodec(s=s)
    st, rng, c = codec.new_state(), np.random.default_rng(7), ctx(5000)
    sent = np.zeros(5000, np.float64)
    total = np.zeros(5000, np.float64)
    for _ in range(40):
        x = rng.standard_normal(5000).astype(np.float32)
        total += x
        sent += codec.decode(codec.encode(x, st, None, c), c)
    gap = np.abs(total - sent - st["e"]).max()
    assert gap <= 1e-5 * 40 * 5                                    # docs/codec-3lc.md note 7.12, max|x| ≈ 5
    assert np.abs(total - sent).max() > 0.1                        # the residual really carries mass


def test_error_buffers_are_per_tensor_state():
    codec, rng = T.ThreeLCCodec(), np.random.default_rng(8)
    xa = [rng.standard_normal(300).astype(np.float32) for _ in range(6)]
    xb = [10 * rng.standard_normal(700).astype(np.float32) for _ in range(6)]
    alone = codec.new_state()
    ref = [codec.encode(x, alone, None, ctx(300)) for x in xa]
    sa, sb = codec.new_state(), codec.new_state()
    mixed = []
    for x, y in zip(xa, xb):                      # interleave another tensor's context
        mixed.append(codec.encode(x, sa, None, ctx(300)))
        codec.encode(y, sb, None, ctx(700))
    assert mixed == ref and np.array_equal(sa["e"], alone["e"])
    with pytest.raises(ValueError, match="error buffer"):
        codec.encode(xb[0], sa, None, ctx(700))                    # a 300-value buffer for 700 values
    with pytest.raises(ValueError, match="context says"):
        codec.encode(xa[0], sa, None, ctx(301))


# ----------------------------------------------------------------------------- sizes (§7.13–7.15)

@pytest.mark.parametrize("s,nonzero,nbytes", [(1.0, 0.0455, 75700), (1.5, 0.0027, 18100),
                                              (1.75, 0.00047, 14950), (1.9, 0.00015, 14500)])
def test_clipped_gaussian_table(s, nonzero, nbytes):
    x, c = clipped_gaussian(), ctx(10**6)
    p = T.ThreeLCCodec(s=s).encode(x, {}, None, c)
    stats = T.message_stats(p)
    assert stats["payload_bits"] == pytest.approx(8 * T.parse(p)[0].length / 10**6, rel=1e-12)
    assert abs(T.parse(p)[0].length - nbytes) <= 0.02 * nbytes
    assert stats["nonzero_fraction"] == pytest.approx(nonzero, rel=0.15)
    assert stats["wire_bits"] == pytest.approx(8 * len(p) / 10**6, rel=1e-12)
    raw35 = T.ThreeLCCodec(s=s, use_zre=False).encode(x, {}, None, c)
    assert T.parse(raw35)[0].length == 200000 and T.payload_bits_per_value(raw35) == 1.6


def test_dense_uniform_input_zre_barely_helps():
    x = np.random.default_rng(9).uniform(-1, 1, 10**6).astype(np.float32)
    p = T.ThreeLCCodec().encode(x, {}, None, ctx(10**6))
    length = T.parse(p)[0].length
    assert T.message_stats(p)["nonzero_fraction"] == pytest.approx(0.5, abs=0.01)
    assert abs(length - 199800) <= 0.02 * 199800 and length <= 200000
    q, m, e = T.quantize(x, None, 1.0)                             # dense residual path, still exact
    assert np.array_equal(e, x - m * q.astype(np.float32))


def test_error_feedback_steady_state_bits():
    codec, st, rng, c = T.ThreeLCCodec(), {}, np.random.default_rng(0), ctx(10**6)
    bits, nz = [], []
    for _ in range(20):
        stats = T.message_stats(codec.encode(rng.standard_normal(10**6).astype(np.float32), st, None, c))
        bits.append(stats["payload_bits"])
        nz.append(stats["nonzero_fraction"])
    steady = bits[10:]                                             # docs/codec-3lc.md note 7.15: ≈1.0 bits, 0.7–1.2 per step
    assert 0.85 <= np.mean(steady) <= 1.15 and 0.6 <= min(steady) and max(steady) <= 1.3
    assert 0.08 <= np.mean(nz[10:]) <= 0.11


# ----------------------------------------------------------------------------- push / PS / pull (§7.16–7.18)

def test_pull_context_shared_invariants():
    """Spec §7.16–7.17 with an SGD-style server (lr = 1): W = Σ mean of decoded pushes,
    W̃ = Σ decoded pulls. All workers get the same bytes, the PS encodes once per round,
    W − W̃ == E_pull, and Σ pulls = Σ mean(x) − mean_w(E_push,w) − E_pull."""
    k, n, rounds = 4, 3000, 12
    codec, rng = T.ThreeLCCodec(s=1.5), np.random.default_rng(10)
    states, ps = [codec.new_state() for _ in range(k)], codec.new_ps_state()
    w_server = np.zeros(n, np.float64)
    w_workers = [np.zeros(n, np.float32) for _ in range(k)]
    sum_x = np.zeros(n, np.float64)
    for r in range(rounds):
        g = [rng.standard_normal(n).astype(np.float32) for _ in range(k)]
        est, ups, down = run_round(codec, g, rng, states=states, ps_state=ps, round_no=r)
        c = ctx(n, k)
        w_server += np.mean([codec.decode(u, c).astype(np.float64) for u in ups], axis=0)
        for w in w_workers:
            w += codec.decode(down, c)
        sum_x += np.mean(np.array(g, np.float64), axis=0)
        assert all(np.array_equal(w, w_workers[0]) for w in w_workers)
        assert ps["encodes"] == r + 1
        assert np.abs(w_server - w_workers[0] - ps["e"]).max() < 1e-4
    mean_push_err = np.mean([s["e"] for s in states], axis=0)
    assert np.abs(sum_x - mean_push_err - ps["e"] - w_workers[0]).max() < 1e-4


def test_aggregate_encodes_the_mean_once_with_the_pull_context():
    codec, n = T.ThreeLCCodec(), 50
    c = ctx(n, 2)
    a = np.zeros(n, np.float32)
    a[3], a[7] = 2.0, -2.0
    b = np.zeros(n, np.float32)
    b[3], b[9] = 2.0, 2.0
    ps = codec.new_ps_state()
    ups = [codec.encode(a, {}, None, c), codec.encode(b, {}, None, c)]       # both exact: {±2, 0}
    down = codec.aggregate(ups, ps, c)
    # mean = {3: 2, 7: −1, 9: 1}; M = 2 = m, so ±1 are ties (±0.5) that round to 0 and stay in E_pull
    out = codec.decode(down, c)
    assert out[3] == 2.0 and np.count_nonzero(out) == 1
    assert ps["e"][7] == -1.0 and ps["e"][9] == 1.0 and np.count_nonzero(ps["e"]) == 2
    assert ps["encodes"] == 1
    again = codec.aggregate(ups, ps, c)                   # E_pull is carried: A = {3: 2, 7: −2, 9: 2}
    assert codec.decode(again, c)[[3, 7, 9]].tolist() == [2.0, -2.0, 2.0] and not ps["e"].any()
    with pytest.raises(CodecError, match="nothing to aggregate"):
        codec.aggregate([], ps, c)


def test_run_round_exact_on_ternary_input_and_nmse_bounded_over_rounds():
    codec, rng, n, k = T.ThreeLCCodec(), np.random.default_rng(11), 4000, 3
    g = (0.5 * rng.integers(-1, 2, n)).astype(np.float32)           # {−m, 0, m} survives both stages
    est, _, _ = run_round(codec, [g] * k, rng)
    assert np.array_equal(est, g)
    # Gaussian gradients around a common drift: the cumulative estimate converges (error feedback)
    states, ps = [codec.new_state() for _ in range(k)], codec.new_ps_state()
    drift = rng.standard_normal(n).astype(np.float32)
    want = np.zeros(n)
    got = np.zeros(n)
    for r in range(60):
        grads = [drift + rng.standard_normal(n).astype(np.float32) for _ in range(k)]
        est, _, _ = run_round(codec, grads, rng, states=states, ps_state=ps, round_no=r)
        assert np.isfinite(est).all()
        want += np.mean(grads, axis=0)
        got += est
    assert np.sum((got - want) ** 2) / np.sum(want ** 2) < 0.01


def test_excluded_tensors_travel_raw_and_exact():
    codec = T.ThreeLCCodec(min_elements=100)
    x = np.linspace(-3, 7, 99).astype(np.float32)
    st = codec.new_state()
    p = codec.encode(x, st, None, ctx(99))
    assert T.message_stats(p)["raw"] and len(p) == T.HEAD.size + 4 * 99
    assert np.array_equal(codec.decode(p, ctx(99)), x) and st["e"] is None
    y = -2 * x
    down = codec.aggregate([p, codec.encode(y, {}, None, ctx(99))], codec.new_ps_state(), ctx(99, 2))
    assert np.array_equal(codec.decode(down, ctx(99)), ((x.astype(np.float64) + y) / 2).astype(np.float32))
    assert not T.message_stats(codec.encode(np.ones(100, np.float32), {}, None, ctx(100)))["raw"]


def test_consecutive_layout_through_the_codec():
    x = clipped_gaussian(5003, seed=12)
    planar = T.ThreeLCCodec(use_zre=False).encode(x, {}, None, ctx(5003))
    consec = T.ThreeLCCodec(use_zre=False, layout="consecutive").encode(x, {}, None, ctx(5003))
    assert planar[1] == 0 and consec[1] == T.F_CONSECUTIVE and planar[T.HEAD.size:] != consec[T.HEAD.size:]
    assert np.array_equal(T.unpack(planar, 5003), T.unpack(consec, 5003))


def test_registry_and_parameters():
    codec = registry.get("3lc", s=1.75, use_zre=False)
    assert isinstance(codec, T.ThreeLCCodec) and codec.name == "3lc" and codec.homomorphic is False
    assert (codec.s, codec.use_zre, codec.layout) == (1.75, False, "planar")
    assert T.ThreeLCCodec().s == 1.0
    for bad in ({"layout": "zigzag"}, {"min_elements": -1}, {"min_elements": 2.5}):
        with pytest.raises(ValueError):
            T.ThreeLCCodec(**bad)


# ----------------------------------------------------------------------------- malformed payloads

def _frame(flags, n, m, body):
    return T.HEAD.pack(T.CODEC_ID, flags, n, m, len(body)) + bytes(body)


def test_every_truncation_and_extension_is_rejected():
    codec, c = T.ThreeLCCodec(), ctx(300)
    x = np.zeros(300, np.float32)
    x[[5, 100, 250]] = [1, -2, 2]
    good = codec.encode(x, {}, None, c)
    codec.decode(good, c)
    for cut in range(len(good)):
        with pytest.raises(CodecError):
            codec.decode(good[:cut], c)
    with pytest.raises(CodecError, match="disagrees"):
        codec.decode(good + b"\x00", c)


def test_header_field_corruption_is_rejected():
    c = ctx(10)
    body = [121, 121]
    T.unpack(_frame(T.F_ZRE, 10, 1.0, body), 10)
    T.unpack(_frame(0, 10, 1.0, body), 10)
    cases = {
        "codec id": b"\x07" + _frame(0, 10, 1.0, body)[1:],
        "flags": _frame(0x08, 10, 1.0, body),
        "flags raw+zre": _frame(T.F_RAW | T.F_ZRE, 10, 0.0, bytes(40)),
        "holds 11": _frame(0, 11, 1.0, body),
        "nan scale": _frame(0, 10, float("nan"), body),
        "inf scale": _frame(0, 10, float("inf"), body),
        "negative scale": _frame(0, 10, -1.0, body),
        "length field": T.HEAD.pack(T.CODEC_ID, 0, 10, 1.0, 3) + bytes(body),
        "no-zre size": _frame(0, 10, 1.0, [121, 121, 121]),
        "zre expands long": _frame(T.F_ZRE, 10, 1.0, [243, 121]),
        "zre expands short": _frame(T.F_ZRE, 10, 1.0, [5]),
        "byte > 242 without zre": _frame(0, 10, 1.0, [121, 243]),
        "nonzero trits, m = 0": _frame(0, 10, 0.0, [121, 122]),
        "raw wrong length": _frame(T.F_RAW, 10, 0.0, bytes(36)),
        "raw nonzero scale": _frame(T.F_RAW, 10, 1.0, bytes(40)),
        "raw nan": _frame(T.F_RAW, 10, 0.0, np.full(10, np.nan, "<f4").tobytes()),
    }
    for what, bad in cases.items():
        with pytest.raises(CodecError):
            T.ThreeLCCodec().decode(bad, c)
            pytest.fail(f"accepted: {what}")
    for bad in (None, "abc", 12):
        with pytest.raises(CodecError, match="must be bytes"):
            T.ThreeLCCodec().decode(bad, c)
    with pytest.raises(CodecError, match="nonzero trits"):
        T.unpack_trits(cases["nonzero trits, m = 0"], 10)


def test_random_corruption_raises_codec_error_or_decodes_to_valid_values():
    rng = np.random.default_rng(13)
    codec, n = T.ThreeLCCodec(s=1.5), 2000
    c = ctx(n)
    good = codec.encode(clipped_gaussian(n, seed=14) * 3, {}, None, c)
    m = T.parse(good)[0].m
    outcomes = {"error": 0, "ok": 0}
    for _ in range(1500):
        bad = bytearray(good)
        for i in rng.integers(0, len(bad), int(rng.integers(1, 4))):
            bad[i] = int(rng.integers(0, 256))
        try:
            out = codec.decode(bytes(bad), c)
        except CodecError:
            outcomes["error"] += 1
            continue
        outcomes["ok"] += 1
        assert out.shape == (n,) and out.dtype == np.float32 and np.isfinite(out).all()
        assert np.unique(np.abs(out)).size <= 2                    # still {0, m'} for one scale m'
    assert outcomes["error"] > 100 and outcomes["ok"] > 100
    assert m > 0
