"""CASQ (docs/codec-casq.md): wire layout byte-exact against a pure-Python reference, the projection
invariants and acceptance checks of docs/codec-casq.md note 8, error feedback, the PS round, rejections."""
import struct
import zlib

import numpy as np
import pytest

from thc_ps.compression import casq as C
from thc_ps.compression import registry
from thc_ps.compression.codec import CodecError, Context, run_round

LLOYD_MAX = {"normal": (0.3634, 0.1175, 0.03455), "laplace": (0.5, 0.1765, 0.0548)}   # docs/codec-casq.md note 8 table


def draw(dist, n, seed):
    rng = np.random.default_rng(seed)
    if dist == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if dist == "laplace":
        return rng.laplace(0, 1, n).astype(np.float32)
    if dist == "lognormal":                          # signed lognormal σ = 1.5 (docs/codec-casq.md note 8)
        return (rng.choice([-1, 1], n) * rng.lognormal(0, 1.5, n)).astype(np.float32)
    raise ValueError(dist)


def nmse(g, x):
    x = x.astype(np.float64)
    return float(np.sum((g.astype(np.float64) - x) ** 2) / np.sum(x ** 2))


def once(x, key="t", **kw):
    """Encode one vector with a fresh state (no EF), return (payload, decoded, state)."""
    codec = C.CASQCodec(error_feedback=False, **kw)
    st = {}
    p = codec.encode(x, st, np.random.default_rng(1), Context(key, x.size))
    return p, codec.decode(p, Context(key, x.size)), st


def py_fmix32(h):
    """murmur3 fmix32 on Python ints (independent reference)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


# ------------------------------------------------------------------------ wire format (docs/codec-casq.md note 5)

def test_fmix32_matches_python_reference():
    vals = [0, 1, 2, 0x7FFFFFFF, 0xFFFFFFFF, 123456789, 0xDEADBEEF]
    assert py_fmix32(1) == 0x514E28B7                 # murmur3 fmix32(1), published constant
    assert C.fmix32(np.array(vals, dtype=np.uint32)).tolist() == [py_fmix32(v) for v in vals]


def test_id_bitstream_is_lsb_first_contiguous():
    # b=2: ids 0,1,2,3 → bits 00 10 01 11 (LSB first) → 0b11100100
    assert C.pack_ids(np.array([0, 1, 2, 3, 3, 2, 1, 0, 1]), 2) == bytes([0xE4, 0x1B, 0x01])
    # b=3: 5 = 1,0,1; 3 = 1,1,0; 7 = 1,1,1 → 10111011 | 1 → 0xDD 0x01 (no word padding: 3 bits each)
    assert C.pack_ids(np.array([5, 3, 7]), 3) == bytes([0xDD, 0x01])
    for b in (1, 2, 3, 5, 8):
        ids = np.random.default_rng(b).integers(0, 1 << b, 1001)
        buf = C.pack_ids(ids, b)
        assert len(buf) == -(-1001 * b // 8)
        assert np.array_equal(C.unpack_ids(buf, 1001, b), ids)


def test_hand_built_message_layout_and_decode():
    ids = np.array([0, 1, 2, 3, 3, 2, 1, 0, 1])
    sizes = np.array([1, 1, 1, 1])
    avg = np.array([-2.5, -0.5, 0.25, 3.0], dtype=np.float32)
    msg = C.pack(2, 0xA1B2C3D4, ids, sizes, avg)
    expect = (bytes([0x43, 0x01, 0x02]) + struct.pack("<I", 9) + struct.pack("<I", 0xA1B2C3D4)
              + struct.pack("<4I", 1, 1, 1, 1) + bytes([0xE4, 0x1B, 0x01]) + struct.pack("<4f", -2.5, -0.5, 0.25, 3.0))
    assert msg == expect
    # one bucket per cluster: whatever the hash, every coordinate decodes to its cluster's value
    assert C.decode_message(msg, 9).tolist() == avg[ids].tolist()
    assert C.pack_raw(np.array([1.5, -2], dtype=np.float32)) == (
        bytes([0x43, 0x02, 0x00]) + struct.pack("<II", 2, 0) + struct.pack("<2f", 1.5, -2.0))


def test_full_message_byte_exact_against_python_reference():
    """b = 1, N = 10 (all sampled): clusters = sign sides, m_k = min(m_min=10, N_k) = 5 per side."""
    x = np.array([-4, -3, -1, -0.5, 0, 0.5, 1, 2, 6, 8], dtype=np.float32)
    payload, _, st = once(x, key="layer1.weight", bits=1, min_numel=0)
    seed = zlib.crc32(b"layer1.weight")
    ids = [0 if v <= 0 else 1 for v in x]
    sums = [[0.0] * 5 for _ in range(2)]
    cnts = [[0] * 5 for _ in range(2)]
    for i, v in enumerate(x.tolist()):
        b = py_fmix32(i ^ seed) % 5
        sums[ids[i]][b] += v
        cnts[ids[i]][b] += 1
    avgs = [s / c if c else 0.0 for k in range(2) for s, c in zip(sums[k], cnts[k])]
    id_bytes = bytes([sum(ids[8 * j + t] << t for t in range(8) if 8 * j + t < 10) for j in range(2)])
    expect = (bytes([0x43, 1, 1]) + struct.pack("<II", 10, seed) + struct.pack("<2I", 5, 5)
              + id_bytes + struct.pack("<10f", *avgs))
    assert payload == expect
    assert len(payload) == C.message_size(10, 1, [5, 5]) == 11 + 8 + 2 + 40


# -------------------------------------------------------------- invariants (docs/codec-casq.md note 3.8, note 8.1–8.7)

@pytest.mark.parametrize("bits", [1, 2, 3])
@pytest.mark.parametrize("dist", ["laplace", "lognormal"])
def test_projection_sum_and_sign_invariants(bits, dist):
    x = draw(dist, 1 << 16, bits)
    p, g, st = once(x, bits=bits)
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    kind, (_, _, ids, _, avg) = C.parse(p, x.size)
    assert g.shape == x.shape and np.isin(g, avg).all()                        # §8.1
    nx = np.dot(x64, x64)
    assert abs(np.sum((x64 - g64) ** 2) + np.dot(g64, g64) - nx) <= 1e-6 * nx  # §8.2
    assert np.dot(g64, g64) <= nx
    scale = np.abs(x64).sum()
    assert abs(g64.sum() - x64.sum()) <= 1e-6 * scale                          # §8.3
    for k in range(1 << bits):
        sel = ids == k
        assert abs(g64[sel].sum() - x64[sel].sum()) <= 1e-6 * scale
    assert np.all((np.sign(g) == np.sign(x)) | (g == 0))                       # §8.4
    assert np.all(ids[x > 0] >= (1 << bits) // 2) and np.all(ids[x <= 0] < (1 << bits) // 2)


def test_sketch_never_worse_than_cluster_means_and_one_bucket_is_cluster_means():
    x = draw("lognormal", 1 << 15, 2)
    p, g, st = once(x, bits=2)
    ids = C.parse(p, x.size)[1][2]
    x64 = x.astype(np.float64)
    means = np.bincount(ids, x64, 4) / np.maximum(np.bincount(ids, minlength=4), 1)
    within = np.sum((x64 - means[ids]) ** 2)
    err = np.sum((x64 - g) ** 2)
    assert err <= within * (1 + 1e-6)                                          # §8.5
    assert err < 0.99 * within                                                 # the buckets do help here
    # §8.6: m_k = 1 for every cluster (tiny ρ, m_min = 1) is CASQ-no-Sketch
    p1, g1, _ = once(x, bits=2, sketch_ratio=1e-9, m_min=1)
    ids1 = C.parse(p1, x.size)[1][2]
    assert np.array_equal(ids1, ids)
    assert np.allclose(g1, means[ids], rtol=1e-6, atol=0)


def test_singletons_exact_and_sparse_tail_nearly_lossless():
    x = draw("laplace", 1 << 14, 3)
    st = C.fit(x, 2, np.random.default_rng(0))
    ids = C.assign(x, st["centers"])
    nk = np.bincount(ids, minlength=4)
    # §8.13 says m_k ≥ 20·N_k → ≥ 95% exact, but the expected singleton share there is
    # (1 − 1/m)^(N−1) ≈ e^(−1/20) = 0.951, so 95% fails about half the time; use 40·N_k (≈ 0.975)
    sizes = np.maximum(40 * nk, 1)
    seed = 77
    g = C.unsketch(ids, C.sketch(x, ids, sizes, seed), sizes, seed)
    for k in range(4):
        if nk[k]:
            assert np.mean(g[ids == k] == x[ids == k]) >= 0.95
    # half as many buckets as coordinates: every coordinate alone in its cell decodes exactly
    sizes = np.maximum(nk // 2, 1)
    key = C.cell_keys(ids, sizes, seed)
    alone = np.bincount(key, minlength=int(sizes.sum()))[key] == 1
    g = C.unsketch(ids, C.sketch(x, ids, sizes, seed), sizes, seed)
    assert alone.any() and np.array_equal(g[alone], x[alone])


def test_determinism_and_server_sees_what_the_worker_subtracted():
    x = draw("laplace", 20000, 4)
    codec = C.CASQCodec(bits=2)
    s1, s2 = codec.new_state(), codec.new_state()
    ctx = Context("w", x.size)
    p1 = codec.encode(x, s1, np.random.default_rng(9), ctx)
    p2 = codec.encode(x, s2, np.random.default_rng(9), ctx)
    assert p1 == p2                                                            # §8.7
    assert np.array_equal(s1["e"], x - codec.decode(p1, ctx))
    # the same tensor under another key hashes differently (seed from the name)
    p3 = codec.encode(x, codec.new_state(), np.random.default_rng(9), Context("v", x.size))
    assert p3[7:11] != p1[7:11] and p3 != p1


# ------------------------------------------------------------------------- bits (docs/codec-casq.md note 5, note 8.8)

@pytest.mark.parametrize("bits", [2, 3])
def test_message_size_and_bits_per_coordinate(bits):
    n = 1 << 20
    x = draw("normal", n, 5)
    p, _, st = once(x, bits=bits)
    sizes = st["fit"]["sizes"]
    assert len(p) == C.message_size(n, bits, sizes) == 11 + 4 * (1 << bits) + n * bits // 8 + 4 * sizes.sum()
    assert abs(int(sizes.sum()) - int(np.ceil(0.005 * n))) <= (1 << bits)    # rounding only
    assert C.bits_per_coordinate(p) == pytest.approx(bits + 0.16, abs=0.01)


# ---------------------------------------------------------------- statistical checks (docs/codec-casq.md note 8)

@pytest.mark.parametrize("dist", ["normal", "laplace"])
def test_nmse_at_lloyd_max(dist):
    x = draw(dist, 1 << 18, 6)
    for bits in (1, 2, 3):
        got = nmse(once(x, bits=bits)[1], x)
        ref = LLOYD_MAX[dist][bits - 1]
        assert 0.95 * ref <= got <= 1.03 * ref, (bits, got, ref)               # §8.9


@pytest.mark.parametrize("dist", ["normal", "laplace"])
def test_sketch_gain_matches_collision_formula(dist):
    x = draw(dist, 1 << 17, 7)
    x64 = x.astype(np.float64)
    for rho in (0.002, 0.005, 0.02, 0.1):
        p, g, st = once(x, bits=2, sketch_ratio=rho)
        _, (_, _, ids, sizes, _) = C.parse(p, x.size)
        pred = 0.0
        for k in range(4):
            xk = x64[ids == k]
            if xk.size > 1:
                m = sizes[k]
                nonempty = m * (1 - (1 - 1 / m) ** xk.size)
                pred += (xk.size - nonempty) * xk.var(ddof=1)
        err = np.sum((g - x64) ** 2)
        assert abs(err / pred - 1) <= 0.03, (rho, err, pred)                   # §8.10


def test_casq_2bit_beats_every_3bit_uniform_quantizer():
    """Spec §8.11 (mirrors the paper's Fig 5 claim): margins 1.2× (Gaussian), 1.8× (Laplace)."""
    rng = np.random.default_rng(0)
    for dist, margin in (("normal", 1.2), ("laplace", 1.8)):
        x = draw(dist, 1 << 17, 8)
        casq2 = nmse(once(x, bits=2)[1], x)
        for scheme, bucket in (("qinf", 512), ("qinf", None), ("symmetric", 512)):
            assert margin * casq2 < nmse(C.uniform_sq(x, 3, rng, scheme=scheme, bucket=bucket), x)
        if dist == "laplace":
            assert 10 * casq2 < nmse(C.uniform_sq(x, 2, rng, scheme="qinf", bucket=512), x)


def test_uniform_sq_is_unbiased_and_on_its_levels():
    x = np.linspace(-1, 1, 512)
    rng = np.random.default_rng(1)
    reps = np.mean([C.uniform_sq(x, 3, rng, scheme="symmetric") for _ in range(400)], axis=0)
    assert np.abs(reps - x).max() < 0.05
    q = C.uniform_sq(x, 3, rng, scheme="symmetric")
    assert np.allclose(np.round((q + 1) * 3.5), (q + 1) * 3.5)                 # 8 levels on [-1, 1]


# --------------------------------------------------------------------- error feedback (Alg. 1)

def test_error_feedback_telescopes_and_state_is_per_tensor():
    codec = C.CASQCodec(bits=2, refit_every=3)
    sa, sb = codec.new_state(), codec.new_state()
    rng = np.random.default_rng(6)
    total = sent = 0.0
    fits = []
    for t in range(7):
        x = draw("laplace", 5000, 10 + t)
        total = total + x.astype(np.float64)
        sent = sent + codec.decode(codec.encode(x, sa, rng, Context("a", 5000, t)), Context("a", 5000))
        fits.append(sa["fit"])
        codec.encode(draw("normal", 3000, t), sb, rng, Context("b", 3000, t))   # another tensor
    assert np.abs(total - sent - sa["e"]).max() < 1e-4 * np.abs(total).max()
    assert sb["e"].shape == (3000,) and sa["t"] == sb["t"] == 7
    refits = [t for t in range(7) if t == 0 or fits[t] is not fits[t - 1]]
    assert refits == [0, 3, 6]                                                 # τ = 3 and the first step
    st = {}
    C.CASQCodec(error_feedback=False).encode(draw("normal", 3000, 1), st, rng, Context("c", 3000))
    assert "e" not in st


def test_error_feedback_running_mean_converges():
    """Spec §8.12: a fixed Laplace gradient; running mean of ĝ approaches g."""
    x = draw("laplace", 100_000, 11)
    codec = C.CASQCodec(bits=2)
    st, rng, acc, errs = {}, np.random.default_rng(0), np.zeros(x.size), {}
    ctx = Context("f", x.size)
    for t in range(1, 401):
        acc += codec.decode(codec.encode(x, st, rng, ctx), ctx)
        if t in (1, 10, 100, 400):
            errs[t] = np.linalg.norm(acc / t - x) / np.linalg.norm(x)
    assert errs[1] > errs[10] > errs[100] > errs[400]
    assert errs[1] > 0.3 and errs[400] < 0.02


# -------------------------------------------------------------------------------- PS round

def test_run_round_mean_estimate():
    grads = [draw("laplace", 20000, s) for s in range(4)]
    mean = np.mean(grads, axis=0, dtype=np.float64)
    est, ups, down = run_round(C.CASQCodec(bits=2), grads, np.random.default_rng(0))
    assert est.dtype == np.float32 and est.shape == mean.shape
    assert nmse(est, mean) < 0.4                          # uplink ≈ 0.18 + downlink re-encode ≈ 0.18
    assert len(down) == len(ups[0])                       # the downlink is a CASQ message too
    est32, _, down32 = run_round(C.CASQCodec(bits=2, downlink="float32"), grads, np.random.default_rng(0))
    assert len(down32) == 11 + 4 * 20000 and nmse(est32, mean) < 0.2
    # the average is over len(payloads): three copies of one upload give back that upload
    c32 = C.CASQCodec(bits=3, downlink="float32")
    ctx = Context("t", 20000, contributors=3)
    down = c32.aggregate([ups[1]] * 3, c32.new_ps_state(), ctx)
    assert np.array_equal(c32.decode(down, ctx), C.decode_message(ups[1], 20000))


def test_small_tensors_travel_raw():
    codec = registry.get("casq", bits=3)
    x = np.arange(-5, 5, dtype=np.float32) / 3
    st = codec.new_state()
    p = codec.encode(x, st, None, Context("s", 10))
    assert len(p) == 11 + 40 and np.array_equal(codec.decode(p, Context("s", 10)), x)
    assert not st["e"].any()


# ------------------------------------------------------------------------------- rejections

def test_malformed_payloads_rejected():
    x = draw("laplace", 4000, 12)
    p, _, st = once(x, bits=2)
    n = x.size
    ctx = Context("t", n)
    codec = C.CASQCodec()
    ids_at = 11 + 16
    avg_at = ids_at + n * 2 // 8

    def patched(at, data):
        return p[:at] + data + p[at + len(data):]

    bad = [b"", p[:5], p[:11], p[:20], p[:-1], p[:-4], p + b"\x00",
           patched(0, b"\x44"),                                 # magic
           patched(1, b"\x07"),                                 # kind
           patched(2, b"\x00"), patched(2, b"\x09"),            # bits out of range
           patched(2, b"\x03"),                                 # bits changes K: length mismatch
           patched(3, struct.pack("<I", n + 1)),                # dimension
           patched(11, struct.pack("<I", 0)),                   # zero buckets
           patched(11, struct.pack("<I", st["fit"]["sizes"][0] + 1)),
           patched(11, struct.pack("<I", 0xFFFFFFFF)),
           patched(avg_at, struct.pack("<f", float("nan"))),
           patched(avg_at + 4, struct.pack("<f", float("inf")))]
    for b in bad:
        with pytest.raises(CodecError):
            codec.decode(b, ctx)
    with pytest.raises(CodecError):
        codec.decode(p, Context("t", n - 1))
    odd = C.pack(3, 1, np.arange(8) % 8, np.ones(8, int), np.zeros(8, np.float32))   # 8·3 bits: no padding
    C.decode_message(odd, 8)
    odd = C.pack(3, 1, np.arange(7), np.ones(8, int), np.zeros(8, np.float32))        # 21 bits: 3 padding
    last = 11 + 32 + 2
    with pytest.raises(CodecError):
        C.decode_message(odd[:last] + bytes([odd[last] | 0x80]) + odd[last + 1:], 7)
    raw = C.pack_raw(np.ones(3, np.float32))
    for b in (raw[:-1], raw[:2] + b"\x02" + raw[3:], raw[:11] + struct.pack("<f", float("nan")) + raw[15:]):
        with pytest.raises(CodecError):
            C.decode_message(b, 3)
    with pytest.raises(CodecError):
        codec.aggregate([p, p[:-1]], {}, Context("t", n, contributors=2))


def test_random_corruption_never_escapes_as_another_error():
    x = draw("normal", 3000, 13)
    p, _, _ = once(x, bits=2)
    rng = np.random.default_rng(0)
    for _ in range(300):
        b = bytearray(p)
        for at in rng.integers(0, len(b), rng.integers(1, 4)):
            b[at] ^= int(rng.integers(1, 256))
        try:
            out = C.decode_message(bytes(b), x.size)
        except CodecError:
            continue
        assert out.shape == x.shape and np.isfinite(out).all()


def test_bad_inputs_and_parameters():
    with pytest.raises(ValueError):
        C.CASQCodec(bits=0)
    with pytest.raises(ValueError):
        C.CASQCodec(alloc="tails")
    with pytest.raises(ValueError):
        C.CASQCodec(downlink="int8")
    x = draw("normal", 2000, 14)
    x[5] = np.nan
    with pytest.raises(CodecError):
        C.CASQCodec().encode(x, {}, np.random.default_rng(0), Context("t", x.size))


@pytest.mark.parametrize("alloc", C.ALLOCS)
def test_allocation_modes_and_unsplit_clustering(alloc):
    x = draw("lognormal", 1 << 16, 15)
    p, g, st = once(x, bits=2, alloc=alloc)
    sizes = st["fit"]["sizes"]
    assert (sizes >= 1).all() and abs(int(sizes.sum()) - 328) <= 4 * 10      # ⌈0.005·2^16⌉ = 328
    assert nmse(g, x) < 0.65
    p, g, st = once(x, bits=2, alloc=alloc, sign_split=False)
    assert np.all(np.diff(st["fit"]["centers"]) >= 0)
    assert abs(g.astype(np.float64).sum() - x.astype(np.float64).sum()) <= 1e-6 * np.abs(x).sum()


def test_one_sided_input_leaves_the_other_side_empty():
    x = np.abs(draw("laplace", 5000, 16)) + 0.01
    p, g, st = once(x, bits=2)
    ids = C.parse(p, x.size)[1][2]
    assert ids.min() >= 2 and list(st["fit"]["sizes"][:2]) == [1, 1]
    assert nmse(g, x) < 0.2
