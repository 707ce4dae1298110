"""CASQ: projection properties, bit accounting, sign-aware clustering, rejections."""
import numpy as np
import pytest

from compression import casq as C
from compression.codec import CodecError, Context, run_round


def laplace(n=1 << 16, seed=0):
    return np.random.default_rng(seed).laplace(0, 1, n).astype(np.float32)


def encode_once(x, bits=2, rho=0.005, key="t"):
    codec = C.CASQCodec(bits=bits, rho=rho, error_feedback=False)
    p = codec.encode(x, {}, np.random.default_rng(1), Context(key, x.size))
    return codec, p, codec.decode(p, Context(key, x.size))


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_projection_properties(bits):
    x = laplace()
    _, _, g = encode_once(x, bits)
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    assert abs(g64.sum() - x64.sum()) < 1e-3 * np.abs(x64).sum() / x.size * 100
    assert np.dot(g64, g64) <= np.dot(x64, x64) * (1 + 1e-6)
    assert abs(np.sum((g64 - x64) ** 2) - (np.dot(x64, x64) - np.dot(g64, g64))) < 1e-3 * np.dot(x64, x64)


def test_sketch_never_worse_than_cluster_means_and_signs_respected():
    x = laplace(seed=2)
    st = C.fit(x, 2, np.random.default_rng(0))
    ids = C.assign(x, st["c_neg"], st["c_pos"])
    assert np.all((x[ids >= 2] > 0)) and np.all(x[ids < 2] <= 0)
    means = np.array([x[ids == k].mean() if np.any(ids == k) else 0 for k in range(4)])
    kmeans_err = np.sum((x - means[ids]) ** 2)
    _, _, g = encode_once(x, 2)
    assert np.sum((g - x) ** 2) <= kmeans_err * (1 + 1e-6)


def test_singleton_buckets_reconstruct_exactly():
    x = laplace(2000, seed=3)
    _, _, g = encode_once(x, 2, rho=50.0)       # far more buckets than coordinates
    assert np.mean(g == x) > 0.3          # m_k capped at N_k: about e^-1 of the cells are singletons


def test_bits_per_coordinate_accounting():
    x = laplace(1 << 20, seed=4)
    for bits in (2, 3):
        _, p, _ = encode_once(x, bits)
        bpc = C.bits_per_coordinate(p)
        sizes = np.frombuffer(p, "<u4", count=1 << bits, offset=C.HEAD.size)
        expect = bits + 32 * sizes.sum() / x.size + 8 * (C.HEAD.size + 4 * (1 << bits)) / x.size
        assert bpc == pytest.approx(expect, rel=1e-9)
        assert bits + 0.14 < bpc < bits + 0.2           # ρ = 0.5%: about b + 0.16


def test_2bit_casq_beats_3bit_uniform_stochastic_quantization():
    x = laplace(1 << 16, seed=5)
    _, _, g = encode_once(x, 2)
    casq_err = np.sum((g - x) ** 2)
    rng = np.random.default_rng(0)
    lo, hi = x.min(), x.max()
    y = (x - lo) / (hi - lo) * 7
    q = np.floor(y) + (rng.random(x.size) < y - np.floor(y))
    usq_err = np.sum((lo + q / 7 * (hi - lo) - x) ** 2)
    assert casq_err < usq_err


def test_error_feedback_telescopes_and_state_is_per_tensor():
    codec = C.CASQCodec(bits=2)
    st, rng = {}, np.random.default_rng(6)
    total = sent = 0
    for t in range(5):
        x = laplace(5000, seed=10 + t)
        total = total + x
        sent = sent + codec.decode(codec.encode(x, st, rng, Context("a", 5000)), Context("a", 5000))
    assert np.abs(total - sent - st["e"]).max() < 1e-3


def test_ps_round_and_rejections():
    codec = C.CASQCodec(bits=2)
    grads = [laplace(20000, seed=s) for s in range(3)]
    est, ups, down = run_round(codec, grads, np.random.default_rng(0))
    mean = np.mean(grads, axis=0)
    assert np.sum((est - mean) ** 2) / np.sum(mean ** 2) < 0.5
    ctx = Context("t", 20000)
    for bad in (ups[0][:10], ups[0][:-4], ups[0] + b"\x00", b"\x44" + ups[0][1:]):
        with pytest.raises(CodecError):
            codec.decode(bad, ctx)
    with pytest.raises(CodecError):
        codec.decode(ups[0], Context("t", 19999))
    small = np.arange(10, dtype=np.float32)
    assert np.array_equal(codec.decode(codec.encode(small, {}, None, Context("s", 10)), Context("s", 10)), small)
