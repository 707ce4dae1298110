"""SKCompress: golden vectors and acceptance checks (docs/codec-skcompress.md)."""
import numpy as np
import pytest

from thc_ps.compression import skcompress as S
from thc_ps.compression.codec import CodecError, Context, run_round


def test_golden_fixed_prefix_vector():
    block = S.encode_keys(np.array([3, 300, 70000, 70001]), force=(4, "A"))
    assert block[0] == 0x40                           # m_int = 4, scheme A
    np_, nl = int.from_bytes(block[1:5], "little"), int.from_bytes(block[5:9], "little")
    assert block[9:9 + np_] == bytes([0x18])
    assert block[9 + np_:9 + np_ + nl] == bytes.fromhex("03012901104401")
    keys, _ = S.decode_keys(block, 0, 4)
    assert keys.tolist() == [3, 300, 70000, 70001]


def test_fig7_huffman():
    lens = S.huffman_lengths(np.array([6, 3, 2, 1]))
    assert sorted(lens.tolist()) == [1, 2, 3, 3]
    assert int((np.array([6, 3, 2, 1]) * lens).sum()) == 21
    cells = np.array([0] * 6 + [1] * 3 + [2] * 2 + [3])
    bits = S.pack_fields(S.canonical_codes(lens)[cells], lens[cells])
    assert S.huffman_decode(bits, lens, cells.size).tolist() == cells.tolist()


def test_c_huffman_decoder_equals_reference_and_rejects_bad_streams():
    rng = np.random.default_rng(3)
    for g in (2, 16, 256):
        freq = rng.zipf(1.5, g).astype(np.int64)
        lens = S.huffman_lengths(freq)
        cells = rng.choice(g, 5000, p=freq / freq.sum())
        bits = S.pack_fields(S.canonical_codes(lens)[cells], lens[cells])
        assert S.huffman_decode(bits, lens, cells.size).tolist() == cells.tolist()
        assert S.huffman_decode_py(bits, lens, cells.size).tolist() == cells.tolist()
        for decode in (S.huffman_decode, S.huffman_decode_py):
            with pytest.raises(CodecError):
                decode(bits[: len(bits) // 2], lens, cells.size)           # stream runs out
    lens = np.array([1, 2, 0, 0])              # codes 0 and 10: "11" is no code
    for decode in (S.huffman_decode, S.huffman_decode_py):
        with pytest.raises(CodecError):
            decode(b"\xc0", lens, 1)
        with pytest.raises(CodecError):
            decode(b"\x00", np.zeros(4, np.int64), 1)                  # empty table


def test_fig9_interval_case():
    delta = np.array([3, 20, 7, 300, 15, 100, 1, 2000])
    c = S.interval_counts(delta, 4)
    assert c.tolist() == [1, 2, 1, 3, 1, 2, 1, 3] and 4 * c.sum() == 56
    lens = S.huffman_lengths(np.bincount(c - 1, minlength=8))
    assert int((np.bincount(c - 1, minlength=8) * lens).sum()) == 12


@pytest.mark.parametrize("keys", [[], [0], [2**32 - 1], list(range(100, 200)), [5, 2**25, 2**31 + 7],
                                  [0, 1, 2, 2**30]])
def test_keys_round_trip_edge_cases(keys):
    k = np.array(keys, dtype=np.int64)
    for force in (None, (2, "A"), (4, "A"), (8, "B"), (16, "B")):
        got, _ = S.decode_keys(S.encode_keys(k, force), 0, k.size)
        assert got.tolist() == keys


def test_selector_is_brute_force_minimum_and_size_matches():
    rng = np.random.default_rng(0)
    keys = np.cumsum(rng.pareto(1.2, 3000).astype(np.int64) + 1)
    delta = np.diff(keys, prepend=0)
    best = S.choose_key_scheme(delta)
    sizes = []
    for m_int in (2, 4, 8, 16):
        for scheme in ("A", "B"):
            c = S.interval_counts(delta, 32 // m_int)
            if c.max() > m_int:
                continue
            block = S.encode_keys(keys, (m_int, scheme))
            sizes.append(len(block))
            assert S.decode_keys(block, 0, keys.size)[0].tolist() == keys.tolist()
    assert len(S.encode_keys(keys)) <= min(sizes)
    assert best[0] <= min(8 * s for s in sizes)


def test_minmax_never_overestimates_and_is_order_independent():
    rng = np.random.default_rng(1)
    keys = np.sort(rng.choice(10**6, 5000, replace=False))
    ranks = rng.integers(0, 32, keys.size)
    table = S.minmax_build(keys, ranks, 2, 1000, 31, seed=7)
    perm = rng.permutation(keys.size)
    assert np.array_equal(table, S.minmax_build(keys[perm], ranks[perm], 2, 1000, 31, seed=7))
    est = S.minmax_query(table, keys, seed=7)
    assert np.all(est <= ranks) and np.all(ranks - est <= 31)
    big = S.minmax_build(keys, ranks, 2, 10**6, 31, seed=7)
    assert np.mean(S.minmax_query(big, keys, seed=7) == ranks) > 0.99


def test_exact_rank_fraction_matches_eq2():
    rng = np.random.default_rng(2)
    n = 20000
    keys = np.sort(rng.choice(10**7, n, replace=False))
    ranks = rng.permutation(n)            # distinct items, as in Eq. 2
    t = int(0.2 * n)
    est = S.minmax_query(S.minmax_build(keys, ranks, 2, t, n, seed=1), keys, seed=1)
    frac = np.mean(est == ranks)
    assert 0.29 <= frac <= 0.35           # Eq. 2: ≈ 0.297 for ρ = 0.2, s = 2


def kdd_like(d=200_000, D=2_000_000, seed=3):
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(D, d, replace=False)), rng.normal(0, 1e-3, d), D


def test_values_signs_bounds_fidelity_and_ratio():
    keys, vals, D = kdd_like()
    msg = S.encode(keys, vals, D)
    k, v, _ = S.decode(msg)
    assert np.array_equal(k, keys)
    assert np.all(np.sign(v) == np.sign(vals))
    for side in (vals < 0, vals > 0):
        mag = np.abs(vals[side])
        sp = S.quantile_splits(mag, int(round(256 * side.mean())))
        true_mid = ((sp[:-1] + sp[1:]) / 2)[S.bucket_ranks(mag, sp)]
        assert np.all(np.abs(v[side]) <= true_mid + 1e-15)
    cos = np.dot(v, vals) / np.linalg.norm(v) / np.linalg.norm(vals)
    assert cos >= 0.95
    assert 8.5 <= 12 * keys.size / len(msg) <= 11.5
    assert msg == S.encode(keys, vals, D)          # deterministic


def test_quantizer_theorem2_bound():
    keys, vals, D = kdd_like(50_000)
    err = 0.0
    for side in (vals < 0, vals > 0):
        mag = np.abs(vals[side])
        q_s = int(round(256 * side.mean()))
        sp = S.quantile_splits(mag, q_s)
        rank = S.bucket_ranks(mag, sp)
        counts = np.bincount(rank, minlength=q_s)
        assert counts.max() - counts.min() <= 2
        err += np.sum((((sp[:-1] + sp[1:]) / 2)[rank] - mag) ** 2)
    scale = np.abs(vals).max()
    assert err / scale**2 <= vals.size / (4 * 256) * 2


def test_codec_round_and_rejections():
    codec = S.SKCompressCodec()
    rng = np.random.default_rng(4)
    grads = []
    for _ in range(3):
        g = np.zeros(100_000, np.float32)
        idx = rng.choice(100_000, 10_000, replace=False)
        g[idx] = rng.normal(0, 1e-3, 10_000)
        grads.append(g)
    est, ups, down = run_round(codec, grads, rng)
    mean = np.mean(grads, axis=0)
    assert np.dot(est, mean) / np.linalg.norm(est) / np.linalg.norm(mean) > 0.8
    ctx = Context("t", 100_000)
    for bad in (ups[0][:20], ups[0][:-3], ups[0] + b"\x00", b"SKC2" + ups[0][4:]):
        with pytest.raises(CodecError):
            codec.decode(bad, ctx)
    with pytest.raises(CodecError):
        codec.decode(ups[0], Context("t", 99_999))
    with pytest.raises(ValueError):
        S.encode([5, 3], [1.0, 1.0], 10)
