"""FastSGD: worked vectors (docs/codec-fastsgd.md note 6), note 3's properties, and the PS path.

Expected bytes come from the paper's worked examples and the layout of docs/codec-fastsgd.md note 2.1. An independent
string-based reference encoder below cross-checks the vectorised key packer.
"""
import math
import struct
from statistics import NormalDist

import numpy as np
import pytest

from thc_ps.compression import fastsgd as F
from thc_ps.compression import registry
from thc_ps.compression.codec import CodecError, Context, run_round

SPEC_HEAD = struct.Struct("<BBBBIfd")       # docs/codec-fastsgd.md note 2.1: tag, l, M, tau-1, d, S, b


def ref_key_bits(keys, l, base=0) -> str:
    """Alg. 2 in plain Python over '0'/'1' strings (docs/codec-fastsgd.md note 1.4 rules A4, A5)."""
    delta = [k - p for p, k in zip([base] + list(keys[:-1]), keys)]
    m = max(1, max(delta).bit_length())
    w = [-(-i * m // (1 << l)) for i in range(1, (1 << l) + 1)]
    out = []
    for dl in delta:
        i = next(i for i in range(len(w)) if dl < (1 << w[i]))
        out.append(format(i, f"0{l}b") + format(dl, f"0{w[i]}b"))
    return "".join(out)


def to_bytes(bitstr: str) -> bytes:
    bitstr += "0" * (-len(bitstr) % 8)
    return bytes(int(bitstr[i:i + 8], 2) for i in range(0, len(bitstr), 8))


# ----------------------------------------------------------------------------- worked vectors

def test_fig2_vector_whole_message():
    """§6 item 1: b = 2, keys [0, 1], values [1.0, −5.1] → L = [3, 1], value bytes 02 80."""
    msg = F.encode([0, 1], [1.0, -5.1], b=2.0, tau=128, l=2)
    s = np.float32(6.1)
    # keys: Δ = [0, 1], M = 1, widths (1,1,1,1): '00'+'0', '00'+'1' → 000001 → 0x04
    expected = SPEC_HEAD.pack(0x46, 2, 1, 127, 2, s, 2.0) + bytes([0x02, 0x80, 0x04])
    assert msg == expected
    keys, vals, head = F.decode(msg)
    assert keys.tolist() == [0, 1] and head["S"] == s
    assert vals.tolist() == pytest.approx([0.7625, -3.05], rel=1e-6)
    assert 1.0 / 2 <= vals[0] <= 1.0 and -5.1 <= vals[1] <= -5.1 / 2


def test_fig3_key_vectors():
    """§6 item 2: maxΔ = 232 → M = 8, widths (2,4,6,8), and the per-Δ bit strings."""
    assert F.width_classes(8, 2).tolist() == [2, 4, 6, 8]
    m, codes, lengths = F.key_fields(np.array([232, 3, 4, 64]), 2)
    assert m == 8
    got = [format(int(c), f"0{n}b") for c, n in zip(codes, lengths)]
    assert got == ["1111101000", "0011", "010100", "1101000000"]
    m, stream, nbits = F.encode_keys(np.array([5, 237, 240]), 2)
    assert (m, nbits) == (8, 20) and stream == bytes([0x57, 0xE8, 0x30])
    keys, used = F.decode_keys(stream, 3, 8, 2)
    assert keys.tolist() == [5, 237, 240] and used == 20


def test_power_of_two_max_delta_needs_bit_length():
    """Spec A4: maxΔ = 256 needs M = 9 (⌈log2 256⌉ = 8 could not encode it)."""
    m, stream, _ = F.encode_keys(np.array([256]), 2)
    assert m == 9 and F.decode_keys(stream, 1, 9, 2)[0].tolist() == [256]
    assert F.key_fields(np.array([1]), 2)[0] == 1 and F.key_fields(np.array([0]), 2)[0] == 1


def test_width_classes_when_2l_does_not_divide_m():
    assert F.width_classes(7, 2).tolist() == [2, 4, 6, 7]
    assert F.width_classes(1, 3).tolist() == [1] * 8
    assert F.width_classes(32, 5)[-1] == 32 and F.width_classes(32, 5)[0] == 1


# ----------------------------------------------------------------------------- keys: lossless

EDGE_KEYS = [
    [0], [2**32 - 1], [0, 2**32 - 1], [0, 256], [5, 261], list(range(0, 4000, 8)),
    list(range(1000)), [3, 10, 2**31], list(range(7, 7 + 64 * 100, 64)),
]


@pytest.mark.parametrize("l", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("keys", EDGE_KEYS, ids=range(len(EDGE_KEYS)))
def test_key_stream_matches_reference_and_round_trips(keys, l):
    m, stream, nbits = F.encode_keys(np.array(keys), l)
    ref = ref_key_bits(keys, l)
    assert nbits == len(ref) and stream == to_bytes(ref)
    got, used = F.decode_keys(stream, len(keys), m, l)
    assert got.tolist() == keys and used == nbits


def test_random_key_sets_match_reference():
    rng = np.random.default_rng(11)
    for _ in range(20):
        d = int(rng.integers(1, 400))
        hi = int(rng.choice([d + 1, 10**4, 10**6, 2**32]))
        keys = np.sort(rng.choice(hi, d, replace=False)).tolist()
        l = int(rng.integers(1, 6))
        m, stream, nbits = F.encode_keys(np.array(keys), l)
        assert stream == to_bytes(ref_key_bits(keys, l))
        assert F.decode_keys(stream, d, m, l)[0].tolist() == keys


def test_equal_gaps_cost_exactly_l_plus_bitlength():
    """Property 9: for gaps g with k₁ = g, every key lands in the top class and costs l + bit_length(g)."""
    for g, d, l in [(100, 5000, 2), (1 << 10, 3000, 2), (37, 1000, 3)]:
        keys = np.arange(1, d + 1, dtype=np.int64) * g
        m, stream, nbits = F.encode_keys(keys, l)
        assert m == g.bit_length() and nbits == d * (l + g.bit_length())
        paper = math.ceil(math.log2(g * d / d)) + l       # ⌈log2(Dm/d)⌉ + l with Dm = g·d
        assert abs(nbits / d - paper) <= 1


# ----------------------------------------------------------------------------- values

def _float32_vals(rng, n, kind="normal"):
    if kind == "normal":
        v = rng.standard_normal(n)
    else:
        v = rng.choice([-1.0, 1.0], n) * rng.lognormal(0, 2.0, n)
    return v.astype(np.float32)


@pytest.mark.parametrize("d", [0, 1, 2, 1000, 100_000])
def test_round_trip_keys_signs_and_two_sided_bound(d):
    """§6 item 3 / properties 1–4: keys exact, signs kept, |v|/b ≤ |v̂| ≤ |v| (float32 exact on top)."""
    rng = np.random.default_rng(d)
    b, tau = 1.1, 128
    keys = np.sort(rng.choice(2**32, d, replace=False)).astype(np.int64)
    if d >= 2:
        keys[0], keys[-1] = 0, 2**32 - 1
    vals = _float32_vals(rng, d)
    k2, v2, head = F.decode(F.encode(keys, vals, b=b, tau=tau))
    s = float(np.float32(np.abs(vals.astype(np.float64)).sum()))
    thr = s / b ** tau
    mag = np.abs(vals.astype(np.float64))
    assert not np.any(np.abs(mag - thr) <= 1e-9 * thr)        # no fp ties in this draw
    keep = mag >= thr
    assert np.array_equal(k2, keys[keep]) and head["d"] == keep.sum()
    orig = vals[keep]
    assert np.all(np.sign(v2) == np.sign(orig))
    assert np.all(np.abs(v2) <= np.abs(orig))                  # exact: cast rounds toward zero
    assert np.all(np.abs(v2.astype(np.float64)) >= np.abs(orig) / b * (1 - 2.0**-23))
    codes = (np.frombuffer(F.encode(keys, vals, b=b, tau=tau), np.uint8, d, F.HEAD.size)[: head["d"]] & 0x7F) + 1
    assert np.all((codes >= 1) & (codes <= tau))


def test_codes_are_the_exact_ceiling_at_ties():
    """Eq. 3 under fp: L is the smallest integer with b^L ≥ R, also when R sits on a power of b
    (where log() alone lands on either side of the integer)."""
    for b in (1.1, 1.05, 1.03625, 1.1125, 2.0, 1.7):
        k = np.arange(1, 129, dtype=np.float64)
        s = 1000.0
        mag = np.concatenate([s / b ** k, s / np.power(b, k), s * np.power(b, -k)])
        mag = np.concatenate([mag, np.nextafter(mag, 0), np.nextafter(mag, np.inf)])
        idx, code = F.log_codes(mag, s, b, 128)
        r = s / mag[idx]
        assert np.all(np.power(b, code) >= r)
        assert np.all((code == 1) | (np.power(b, code - 1.0) < r))


def test_value_table_rounds_toward_zero():
    """The float32 cast never exceeds the float64 S·b^−L and stays within one ulp of it (docs/codec-fastsgd.md note 3 prop. 3)."""
    rng = np.random.default_rng(10)
    codes = np.arange(128, dtype=np.uint8)
    for _ in range(50):
        s, b = float(np.float32(rng.uniform(0.1, 1e4))), float(rng.uniform(1.01, 2.0))
        exact = s * np.power(b, -np.arange(1, 129, dtype=np.float64))
        got = F.value_decode(np.concatenate([codes, codes | 0x80]), s, b).astype(np.float64)
        assert np.all(got[:128] <= exact) and np.all(got[128:] == -got[:128])
        assert np.all(np.nextafter(got[:128].astype(np.float32), np.float32(np.inf)) > exact)


def test_single_nonzero_clamped_to_code_one():
    """Spec A2: L = 0 → 1, so v̂ = v/b, and the sign of a negative single value survives."""
    for v in (3.0, -3.0):
        msg = F.encode([42], [v], b=1.1)
        assert msg[F.HEAD.size] == (0x80 if v < 0 else 0x00)
        keys, vals, _ = F.decode(msg)
        assert keys.tolist() == [42] and vals[0] == pytest.approx(v / 1.1, rel=1e-7)


def test_filter_cap_and_monotonicity():
    """Properties 4–6: kept = {|v| ≥ S/b^τ}, d ≤ ⌊b^τ⌋, larger magnitudes kept first with smaller codes."""
    rng = np.random.default_rng(1)
    for b, tau in [(1.05, 64), (1.1, 64), (1.03625, 128), (1.1, 96)]:
        cap = F.kept_cap(b, tau)
        for kind in ("normal", "lognormal"):
            vals = _float32_vals(rng, 20000, kind)
            keys = np.arange(vals.size) * 3
            msg = F.encode(keys, vals, b=b, tau=tau)
            k2, v2, head = F.decode(msg)
            assert head["d"] <= cap
            kept = np.isin(keys, k2)
            mag = np.abs(vals).astype(np.float64)
            thr = head["S"] / b ** tau
            assert not np.any(np.abs(mag - thr) <= 1e-9 * thr)
            assert np.array_equal(kept, mag >= thr)
            if kept.any() and (~kept).any():
                assert mag[kept].min() >= mag[~kept].max()
            codes = (np.frombuffer(msg, np.uint8, head["d"], F.HEAD.size) & 0x7F).astype(int)
            order = np.argsort(-mag[kept], kind="stable")
            assert np.all(np.diff(codes[order]) >= 0)


def test_cap_is_reached_and_all_equal_values_drop_everything():
    b, tau = 1.05, 64                         # b^τ ≈ 22.7
    vals = np.concatenate([np.full(22, 1.0), np.full(100, 1e-9)])
    assert F.decode(F.encode(np.arange(vals.size), vals, b=b, tau=tau))[2]["d"] == 22 == F.kept_cap(b, tau)
    # D > b^τ equal magnitudes: each is S/D < S/b^τ, so nothing passes but S is still sent
    keys, vals, head = F.decode(F.encode(np.arange(1000), np.ones(1000), b=b, tau=tau))
    assert head["d"] == 0 and head["M"] == 0 and head["S"] == 1000.0 and keys.size == 0


def test_dense_encoder_equals_key_value_encoder():
    """encode_dense skips listing the nonzeros; it must give the bytes of encode(flatnonzero(x), ...)."""
    rng = np.random.default_rng(13)
    for dtype, n, b, tau in [(np.float32, 300_000, 1.1, 128), (np.float64, 50_000, 1.05, 96), (np.float32, 10, 2.0, 3)]:
        x = (rng.standard_normal(n) * rng.lognormal(0, 1.5, n)).astype(dtype)
        x[rng.random(n) < 0.3] = 0
        nz = np.flatnonzero(x)
        assert F.encode_dense(x, b, tau) == F.encode(nz, x[nz], b, tau)
    assert F.encode_dense(np.zeros(5, np.float32)) == F.encode(np.zeros(0, np.int64), np.zeros(0))


def test_empty_and_all_zero_inputs():
    for keys, vals in [([], []), ([3, 9], [0.0, 0.0])]:
        msg = F.encode(np.array(keys, np.int64), np.array(vals))
        assert len(msg) == F.HEAD.size
        k, v, h = F.decode(msg)
        assert k.size == v.size == h["d"] == 0 and h["S"] == 0


def test_scale_invariance_and_determinism():
    """Property 7 and 11: 2^k·v gives identical bytes apart from S, and S scales exactly."""
    rng = np.random.default_rng(2)
    keys = np.sort(rng.choice(10**6, 5000, replace=False))
    vals = _float32_vals(rng, keys.size, "lognormal")
    a = F.encode(keys, vals)
    for k in (-3, 5):
        c = F.encode(keys, vals * np.float32(2.0 ** k))
        assert a[:8] == c[:8] and a[12:] == c[12:]
        assert F.decode(c)[2]["S"] == F.decode(a)[2]["S"] * 2.0 ** k
    assert a == F.encode(keys.copy(), vals.copy())


def test_exact_size_and_zero_padding():
    """Property 8: len = H + d + ⌈Σ(l + w_cls)/8⌉ with the widths recomputed from note 1.4."""
    rng = np.random.default_rng(3)
    for l in (1, 2, 3):
        keys = np.sort(rng.choice(55_000_000, 30000, replace=False))
        msg = F.encode(keys, rng.standard_normal(keys.size), l=l)
        k2, _, head = F.decode(msg)
        delta = np.diff(k2, prepend=0)
        m = max(1, int(delta.max()).bit_length())
        w = [-(-i * m // (1 << l)) for i in range(1, (1 << l) + 1)]
        bits = sum(l + next(x for x in w if dl < (1 << x)) for dl in delta.tolist())
        assert head["M"] == m and head["key_bits"] == bits
        assert len(msg) == 20 + head["d"] + -(-bits // 8)
        pad = -bits % 8
        assert msg[-1] & ((1 << pad) - 1) == 0


@pytest.mark.parametrize("D", [100_000, 1_000_000])
def test_statistical_kept_count(D):
    """Property 10: for N(0,1) values d ≈ D·2Φ̄(√(2/π)·D/b^τ), within a binomial 5σ band."""
    rng = np.random.default_rng(D)
    vals = rng.standard_normal(D).astype(np.float32)
    d = F.decode(F.encode(np.arange(D), vals))[2]["d"]
    p = 2 * (1 - NormalDist().cdf(math.sqrt(2 / math.pi) * D / 1.1 ** 128))
    assert abs(d - D * p) <= 5 * math.sqrt(D * p * (1 - p)) + 1


def test_compression_magnitude_gaussian_in_kdd12_sized_model():
    """§6 item 8: D = 10^6 Gaussian nonzeros in Dm ≈ 5.5·10^7 with defaults → CR_kv of order 10^4."""
    rng = np.random.default_rng(8)
    D, dm = 10**6, 54_686_452
    keys = np.sort(rng.choice(dm, D, replace=False))
    msg = F.encode(keys, rng.standard_normal(D).astype(np.float32))
    st = F.message_stats(msg, D, dm)
    assert 30 <= st["d"] <= 100                   # E[d] ≈ 60 (docs/codec-fastsgd.md note 2.2)
    assert 5e3 <= st["cr_kv"] < 1e5
    assert st["cr_payload"] == pytest.approx(64 * D / (8 * st["d"] + st["bits_per_key"] * st["d"]))


def test_bits_per_key_heavy_tailed_gaps_vs_varint():
    """§6 item 8 / Table V–VI trend: ≈6 bits/key at l = 2, byte-granular varint ≥ 8, best l is 2 or 3."""
    rng = np.random.default_rng(0)
    gaps = np.minimum(np.floor(rng.pareto(1.2, 200_000) + 1), 1e6).astype(np.int64)
    keys = np.cumsum(gaps)
    per_l = {l: F.encode_keys(keys, l)[2] / keys.size for l in range(1, 6)}
    assert 5.5 <= per_l[2] <= 6.8
    assert min(per_l, key=per_l.get) in (2, 3)
    bitlen = np.floor(np.log2(gaps)).astype(int) + 1
    varint = 8 * np.maximum(1, -(-bitlen // 7)).mean()
    assert varint >= 8 > per_l[2]


# ----------------------------------------------------------------------------- malformed input

def _good():
    return F.encode([1, 5, 9, 300], [1.0, -2.0, 3.0, 0.5], b=1.1, tau=64, l=2)


def test_encode_rejects_bad_input():
    bad = [([3, 2], [1.0, 1.0]), ([2, 2], [1.0, 1.0]), ([-1, 2], [1.0, 1.0]), ([0, 2**32], [1.0, 1.0]),
           ([1], [float("nan")]), ([1], [float("inf")]), ([1, 2], [1.0]), (np.array([1.5]), [1.0]),
           ([1, 2, 3], [3e38, 3e38, 3e38])]
    for keys, vals in bad:
        with pytest.raises(ValueError):
            F.encode(keys, vals)
    for x in ([1.0, np.nan], [np.inf, 0.0], [-np.inf], [3e38, 3e38]):
        with pytest.raises(ValueError):
            F.encode_dense(np.array(x, np.float32))
        with pytest.raises(ValueError):
            F.FastSGDCodec().encode(np.array(x, np.float32), {}, None, Context("t", len(x)))
    for params in ({"tau": 129}, {"tau": 0}, {"l": 0}, {"l": 6}, {"b": 1.0}, {"b": float("nan")}, {"tau": 2.5}):
        with pytest.raises(ValueError):
            F.encode([1], [1.0], **params)
        with pytest.raises(ValueError):
            F.FastSGDCodec(**params)


def test_decode_rejects_truncation_and_extension():
    good = _good()
    F.decode(good)
    for n in range(len(good)):
        with pytest.raises(CodecError):
            F.decode(good[:n])
    for extra in (b"\x00", b"\x00" * 8, b"\xff"):
        with pytest.raises(CodecError):
            F.decode(good + extra)


def _with_header(msg, **fields):
    names = ("tag", "l", "M", "tau1", "d", "S", "b")
    vals = dict(zip(names, SPEC_HEAD.unpack_from(msg)))
    vals.update(fields)
    return SPEC_HEAD.pack(*(vals[n] for n in names)) + msg[SPEC_HEAD.size:]


@pytest.mark.parametrize("fields", [
    {"tag": 0x47}, {"l": 0}, {"l": 6}, {"M": 33}, {"M": 0}, {"tau1": 128}, {"tau1": 200},
    {"d": 3}, {"d": 5}, {"d": 2**32 - 1}, {"d": 0}, {"S": float("nan")}, {"S": -1.0}, {"S": 0.0},
    {"S": float("inf")}, {"b": 1.0}, {"b": 0.5}, {"b": float("nan")}, {"b": float("inf")},
    {"tau1": 0},                    # the codes in this message exceed τ = 1
])
def test_decode_rejects_bad_header_fields(fields):
    with pytest.raises(CodecError):
        F.decode(_with_header(_good(), **fields))


def test_decode_rejects_zero_delta_nonzero_padding_and_code_above_tau():
    # d = 2, M = 1, l = 2: Δ = [1, 0] → '001' '000' → 0x20 (keys 1, 1: not strictly increasing)
    zero_delta = SPEC_HEAD.pack(0x46, 2, 1, 127, 2, 2.0, 1.1) + bytes([0, 0, 0b00100000])
    with pytest.raises(CodecError, match="zero key delta"):
        F.decode(zero_delta)
    ok = SPEC_HEAD.pack(0x46, 2, 1, 127, 2, 2.0, 1.1) + bytes([0, 0, 0b00100100])   # Δ = [1, 1]
    assert F.decode(ok)[0].tolist() == [1, 2]
    with pytest.raises(CodecError, match="padding"):
        F.decode(ok[:-1] + bytes([0b00100101]))
    above = SPEC_HEAD.pack(0x46, 2, 1, 9, 2, 2.0, 1.1) + bytes([10, 0, 0b00100100])  # L = 11 > τ = 10
    with pytest.raises(CodecError, match="above tau"):
        F.decode(above)


def test_random_corruption_raises_only_codec_error():
    rng = np.random.default_rng(9)
    keys = np.sort(rng.choice(10**6, 3000, replace=False))
    good = F.encode(keys, rng.standard_normal(keys.size), tau=64)
    for _ in range(300):
        msg = bytearray(good)
        for pos in rng.integers(0, len(msg), int(rng.integers(1, 4))):
            msg[pos] ^= int(rng.integers(1, 256))
        try:
            k, v, h = F.decode(bytes(msg))
        except CodecError:
            continue
        assert k.size == v.size == h["d"] and np.all(np.isfinite(v))
        assert np.all(np.diff(k) > 0) and (k.size == 0 or k[-1] < 2**32)


# ----------------------------------------------------------------------------- framed mode

def test_frames_match_whole_message_and_losses_stay_local():
    """Spec §1.8 item 5: global S and filter; each frame self-contained; a lost frame loses only its entries."""
    rng = np.random.default_rng(12)
    keys = np.sort(rng.choice(5 * 10**6, 40000, replace=False))
    vals = rng.standard_normal(keys.size).astype(np.float32)
    whole_k, whole_v, wh = F.decode(F.encode(keys, vals))
    frames = F.encode_frames(keys, vals, max_bytes=1400)
    assert len(frames) > 3 and all(len(f) <= 1400 for f in frames)
    parts = [F.decode(f) for f in frames]
    assert all(h["S"] == wh["S"] and h["tag"] == "f" and h["base"] == k[0] for k, _, h in parts)
    assert np.array_equal(np.concatenate([k for k, _, _ in parts]), whole_k)
    assert np.array_equal(np.concatenate([v for _, v, _ in parts]), whole_v)
    lost = 2
    survivors = np.concatenate([k for i, (k, _, _) in enumerate(parts) if i != lost])
    assert np.array_equal(np.setdiff1d(whole_k, survivors), parts[lost][0])
    with pytest.raises(CodecError):                    # the codec path expects whole messages
        F.FastSGDCodec().decode(frames[0], Context("t", 5 * 10**6))
    with pytest.raises(ValueError):
        F.encode_frames(keys, vals, max_bytes=25)


# ----------------------------------------------------------------------------- codec / PS path

def test_registry_defaults_and_statelessness():
    codec = registry.get("fastsgd")
    assert isinstance(codec, F.FastSGDCodec) and not codec.homomorphic
    assert (codec.b, codec.tau, codec.l, codec.error_feedback) == (1.1, 128, 2, False)
    rng = np.random.default_rng(6)
    x = rng.standard_normal(30000).astype(np.float32)
    x[rng.random(x.size) < 0.5] = 0
    ctx = Context("t", x.size)
    state = codec.new_state()
    first = codec.encode(x, state, None, ctx)
    assert state == {} and codec.encode(x, state, None, ctx) == first
    assert registry.get("fastsgd").encode(x, {}, None, ctx) == first       # docs/codec-fastsgd.md note 6 item 12
    mag = np.abs(x.astype(np.float64))
    thr = float(np.float32(mag.sum())) / 1.1 ** 128
    np.testing.assert_array_equal(np.flatnonzero(codec.decode(first, ctx)), np.flatnonzero(mag >= thr))


def test_ps_aggregate_is_exact_decode_mean_reencode():
    """§6 item 9: the PS sum equals Σ decode(msg_w) in float64; downlink obeys the cap and bounds."""
    b, tau = 1.05, 64                                    # cap 22 per message: the union exceeds it
    codec = F.FastSGDCodec(b=b, tau=tau)
    rng = np.random.default_rng(4)
    dim, W = 50000, 4
    grads = []
    for _ in range(W):
        g = np.zeros(dim, np.float32)
        idx = rng.choice(dim, 2000, replace=False)
        g[idx] = rng.standard_normal(2000) * 0.01
        g[idx[:15]] = rng.choice([-1, 1], 15) * rng.uniform(10, 20, 15)    # spikes that pass the filter
        grads.append(g)
    est, ups, down = run_round(codec, grads, rng)
    ctx = Context("t", dim, contributors=W)
    acc = np.zeros(dim)
    for u in ups:
        acc += codec.decode(u, ctx).astype(np.float64)
    mean_hat = acc / W
    nz = np.flatnonzero(mean_hat)
    assert down == F.encode(nz, mean_hat[nz], b=b, tau=tau)
    assert nz.size > F.kept_cap(b, tau) and np.count_nonzero(est) <= F.kept_cap(b, tau)
    kept = np.flatnonzero(est)
    assert np.all(np.sign(est[kept]) == np.sign(mean_hat[kept]))
    assert np.all(np.abs(est[kept]) <= np.abs(mean_hat[kept]) * (1 + 1e-7))
    assert np.all(np.abs(est[kept]) >= np.abs(mean_hat[kept]) / b * (1 - 1e-6))
    np.testing.assert_array_equal(codec.decode(down, ctx), est)
    summed = F.FastSGDCodec(b=b, tau=tau, reduce="sum").aggregate(ups, {}, ctx)
    assert F.decode(summed)[2]["S"] == pytest.approx(W * F.decode(down)[2]["S"], rel=1e-6)


def test_run_round_nmse_bound_for_correlated_workers():
    """Two log-quantization stages, each a same-sign underestimate by a factor in [1/b, 1]. Where the
    workers agree in sign and nothing is filtered, est ∈ [mean/b², mean], so NMSE ≤ (1 − 1/b²)²."""
    rng = np.random.default_rng(5)
    dim, W, b = 20000, 4, 1.1
    base = rng.standard_normal(dim)
    grads = [(base + 0.05 * rng.standard_normal(dim)).astype(np.float32) for _ in range(W)]
    est, ups, down = run_round(F.FastSGDCodec(b=b), grads, rng)
    mean = np.mean(np.array(grads, np.float64), axis=0)
    nmse = np.sum((est - mean) ** 2) / np.sum(mean ** 2)
    assert 1e-4 < nmse <= (1 - 1 / b**2) ** 2
    assert sum(map(len, ups)) < 0.5 * W * 4 * dim           # ~2 bytes per coordinate vs 4


def test_codec_rejects_inconsistent_payloads():
    codec = F.FastSGDCodec()
    ctx = Context("t", 1000)
    x = np.zeros(1000, np.float32)
    x[[3, 500, 999]] = [1.0, -2.0, 0.5]
    good = codec.encode(x, {}, None, ctx)
    with pytest.raises(CodecError, match="dimension"):
        codec.decode(good, Context("t", 999))
    for other in (F.FastSGDCodec(b=1.05), F.FastSGDCodec(tau=64), F.FastSGDCodec(l=3)):
        with pytest.raises(CodecError, match="this codec uses"):
            other.decode(good, ctx)
        with pytest.raises(CodecError):
            other.aggregate([good], {}, ctx)
    with pytest.raises(CodecError):
        codec.aggregate([], {}, ctx)
    with pytest.raises(CodecError):
        codec.aggregate([good, good[:-1]], {}, ctx)
    with pytest.raises(ValueError):
        codec.encode(x[:10], {}, None, ctx)


def test_error_feedback_extension_telescopes_per_tensor():
    """Extension (docs/codec-fastsgd.md note 1.7, off by default): Σ_t ĝ_t + e_T = Σ_t g_t, with state kept per tensor."""
    codec = F.FastSGDCodec(b=1.05, tau=64, error_feedback=True)        # harsh filter: ≤ 22 kept
    rng = np.random.default_rng(7)
    dims = {"a": 3000, "b": 500}
    states = {k: codec.new_state() for k in dims}
    sent = {k: np.zeros(n) for k, n in dims.items()}
    total = {k: np.zeros(n) for k, n in dims.items()}
    for t in range(25):
        for key, n in dims.items():
            g = rng.standard_normal(n).astype(np.float32)
            ctx = Context(key, n, t)
            sent[key] += codec.decode(codec.encode(g, states[key], None, ctx), ctx)
            total[key] += g
    for key in dims:
        np.testing.assert_allclose(sent[key] + states[key]["e"], total[key], rtol=0, atol=1e-9)
    # a tensor's stream with its own state alone reproduces the same residual
    rng = np.random.default_rng(7)
    solo = codec.new_state()
    for t in range(25):
        for key, n in dims.items():
            g = rng.standard_normal(n).astype(np.float32)
            if key == "b":
                codec.encode(g, solo, None, Context(key, n, t))
    np.testing.assert_array_equal(solo["e"], states["b"]["e"])
