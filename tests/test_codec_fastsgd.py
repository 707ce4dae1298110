"""FastSGD: the spec's vectors and acceptance checks (shared/specs/fastsgd.md §6)."""
import math

import numpy as np
import pytest

from compression import fastsgd as F
from compression.codec import CodecError, Context, run_round


def test_fig2_vector():
    msg = F.encode([0, 1], [1.0, -5.1], b=2.0, tau=128, l=2)
    keys, vals, head = F.decode(msg)
    assert msg[F.HEAD.size:F.HEAD.size + 2] == bytes([0x02, 0x80])
    assert head["S"] == np.float32(6.1)
    assert keys.tolist() == [0, 1]
    assert vals[0] == pytest.approx(0.7625, rel=1e-6) and vals[1] == pytest.approx(-3.05, rel=1e-6)


def test_fig3_key_vectors():
    m, stream = F.encode_keys(np.array([5, 237, 240]), 2)
    assert m == 8 and F.widths(8, 2).tolist() == [2, 4, 6, 8]
    assert stream == bytes([0x57, 0xE8, 0x30])
    assert F.decode_keys(stream, 3, 8, 2).tolist() == [5, 237, 240]
    m, stream = F.encode_keys(np.array([232, 235]), 2)     # Δ = 232, 3
    assert stream == bytes([0b11111010, 0b00001100])   # 11 11101000 | 00 11, zero-padded


@pytest.mark.parametrize("keys", [
    [0], [2**32 - 1], [0, 256], list(range(0, 4000, 8)), list(range(1000)), [3, 10, 2**31],
])
def test_key_round_trip_edge_cases(keys):
    m, stream = F.encode_keys(np.array(keys), 2)
    assert F.decode_keys(stream, len(keys), m, 2).tolist() == keys


def test_random_round_trip_signs_and_bounds():
    rng = np.random.default_rng(0)
    for d in (0, 1, 2, 1000, 20000):
        keys = np.sort(rng.choice(2**32 - 1, d, replace=False)).astype(np.int64)
        vals = rng.standard_normal(d)
        b = 1.1
        msg = F.encode(keys, vals, b=b, tau=128, l=2)
        k2, v2, head = F.decode(msg)
        s = float(np.float32(np.abs(vals).sum())) if d else 0.0
        keep = np.abs(vals) >= s / b ** 128 if d else np.zeros(0, bool)
        assert np.array_equal(k2, keys[keep])
        orig = vals[keep]
        assert np.all(np.sign(v2) == np.sign(orig))
        if d > 1:
            assert np.all(np.abs(v2) <= np.abs(orig) * (1 + 1e-6))
            assert np.all(np.abs(v2) >= np.abs(orig) / b * (1 - 1e-6))
        assert head["d"] <= math.floor(b ** 128)


def test_filter_cap_monotone_and_size():
    rng = np.random.default_rng(1)
    D = 100000
    keys = np.sort(rng.choice(55_000_000, D, replace=False))
    vals = rng.standard_normal(D)
    b, tau, l = 1.1, 128, 2
    msg = F.encode(keys, vals, b=b, tau=tau, l=l)
    k2, v2, head = F.decode(msg)
    assert head["d"] <= math.floor(b ** tau)
    kept_mag = np.abs(vals[np.isin(keys, k2)])
    dropped = np.abs(vals[~np.isin(keys, k2)])
    assert kept_mag.min() >= dropped.max()                      # monotone
    delta = np.diff(k2, prepend=0)
    w = F.widths(head["M"], l)
    bits = sum(l + w[np.searchsorted(1 << w, x, side="right")] for x in delta)
    assert len(msg) == F.HEAD.size + head["d"] + -(-bits // 8)


def test_scale_invariance_and_determinism():
    rng = np.random.default_rng(2)
    keys = np.arange(0, 5000, 3)
    vals = rng.standard_normal(keys.size)
    a = F.encode(keys, vals)
    b = F.encode(keys, vals * 8.0)
    assert a[F.HEAD.size:] == b[F.HEAD.size:] and a == F.encode(keys, vals)
    assert F.decode(b)[2]["S"] == F.decode(a)[2]["S"] * 8


def test_statistical_kept_count():
    from statistics import NormalDist
    rng = np.random.default_rng(3)
    D = 100000
    vals = rng.standard_normal(D)
    msg = F.encode(np.arange(D), vals)
    d = F.decode(msg)[2]["d"]
    thr = math.sqrt(2 / math.pi) * D / 1.1 ** 128
    p = 2 * (1 - NormalDist().cdf(thr))
    assert abs(d - D * p) <= 5 * math.sqrt(D * p * (1 - p)) + 5


def test_rejections():
    good = F.encode([1, 5, 9], [1.0, -2.0, 3.0])
    bad = [good[:10], good[:-1], good + b"\x00", bytes([0x47]) + good[1:],
           good[:1] + bytes([9]) + good[2:], good[:2] + bytes([40]) + good[3:]]
    for msg in bad:
        with pytest.raises(CodecError):
            F.decode(msg)
    with pytest.raises(ValueError):
        F.encode([3, 2], [1.0, 1.0])
    with pytest.raises(ValueError):
        F.encode([1], [float("nan")])
    with pytest.raises(ValueError):
        F.encode([1], [1.0], tau=129)


def test_ps_path_decoded_sum_and_identical_downlink():
    codec = F.FastSGDCodec(b=1.1, tau=64)
    rng = np.random.default_rng(4)
    grads = []
    for _ in range(3):
        g = np.zeros(50000, np.float32)
        idx = rng.choice(50000, 2000, replace=False)
        g[idx] = rng.standard_normal(2000)
        grads.append(g)
    est, ups, down = run_round(codec, grads, rng)
    ctx = Context("t", 50000)
    decoded_mean = np.mean([codec.decode(u, ctx).astype(np.float64) for u in ups], axis=0)
    keys, vals, head = F.decode(down)
    assert head["d"] <= math.floor(1.1 ** 64)
    nz = np.flatnonzero(decoded_mean)
    assert set(keys.tolist()) <= set(nz.tolist())
    assert np.all(np.abs(est[keys]) <= np.abs(decoded_mean[keys]) * (1 + 1e-6))
    assert codec.encode(grads[0], {}, None, ctx) == F.FastSGDCodec(b=1.1, tau=64).encode(grads[0], {}, None, ctx)
