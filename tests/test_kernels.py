"""The fused worker kernels (compression/_kernels.c): AVX2 and scalar paths bit for bit, the
fused encode/decode against the separate passes they replace, and identity across processes."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from thc_ps.compression import _kernels as K
from thc_ps.compression import thc
from thc_ps.compression.hadamard import fwht, rademacher_bits
from thc_ps.proto.packing import pack_indices, packed_size
from thc_ps.proto.tables import solve_table

SIMD = [0] + [1] * K.has_avx2() + [2] * K.has_avx512()   # scalar, AVX2, AVX-512
BEST = "avx512" if K.has_avx512() else "avx2" if K.has_avx2() else "scalar"   # the path THC_KERNELS unset takes
needs_avx2 = pytest.mark.skipif(not K.has_avx2(), reason="CPU without AVX2: only the scalar path runs")


def bits_of(a):
    return np.ascontiguousarray(a).view(np.uint32 if a.dtype == np.float32 else np.uint8)


def ugly(n, seed):
    """Heavy-tailed values with exact zeros, ties and huge magnitudes mixed in."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * rng.lognormal(0, 2, n)).astype(np.float32)
    x[::7] = 0.0
    x[1::11] = x[0]
    return x


@needs_avx2
@pytest.mark.parametrize("simd", SIMD[1:])
@pytest.mark.parametrize("n", [1, 2, 8, 64, 128, 256, 512, 1024, 4096, 1 << 13, 1 << 15, 1 << 17, 1 << 19])
def test_fwht_simd_equals_scalar_bitwise(simd, n):
    """Each vector path (AVX2; AVX-512, whose leaves are 128 coordinates) against the scalar
    FWHT, bit for bit."""
    x = ugly(n, n)
    a, b = x.copy(), x.copy()
    K.fwht(a, 0)
    K.fwht(b, simd)
    assert np.array_equal(bits_of(a), bits_of(b))


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("n", [128, 1 << 12, 1 << 16])
def test_fwht_each_path_is_orthogonal_and_involutive(simd, n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    y = x.copy()
    K.fwht(y, simd)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-5)
    assert np.allclose(y, fwht(x, exact=False), atol=1e-5)      # the BLAS matrix form
    K.fwht(y, simd)
    assert np.allclose(y, x, atol=1e-5)                         # H·H = I


#: AVX2 blockings (L1 piece, low chunk, top level bits, strip floats) that put every level
#: layout of the transform (leaves only, low chunks, one level above, several; levels of up to 3
#: stages in place and longer ones, or a carried sink, in strips of a few
#: columns) within reach of small blocks; None: the shipped one.
LAYOUTS = [None, (128, 128, 1, 16), (128, 256, 2, 32), (128, 512, 3, 64), (256, 1024, 2, 256),
           (128, 256, 5, 256), (128, 128, 10, 16384)]


def _every_kernel(p, n, simd, seed, scale=1.0, zero=False):
    """Every fused kernel of a block of p (x of n <= p values) on one path, as {name: bytes}:
    fwht, rht_rotate with and without a carry and from pieces, rht_encode (bytes, packed,
    counter stream; 5-bit indices of a 32-level table too), rht_decode from values, nibbles,
    bytes and 8-bit lanes / k, quantize_ef (bytes, nibbles, 5 bits) with its residual apart
    and over its input."""
    rng = np.random.default_rng(seed)
    x = np.zeros(n, np.float32) if zero else ugly(n, seed) * np.float32(scale)
    carry = ugly(p, seed + 1) * np.float32(scale)
    signs = rademacher_bits(seed, 1, 2, p)
    tab = bytes(solve_table(4, 30, "1/32").values)
    tab5 = bytes(solve_table(5, 31, "1/512").values)
    big_m = 0.0 if zero else 2.5 * float(np.linalg.norm(x.astype(np.float64))) / np.sqrt(p)
    out = {}
    w = np.zeros(p, np.float32)
    w[:n] = x
    K.fwht(w, simd)
    out["fwht"] = w
    cuts = np.sort(rng.integers(0, n + 1, 5))
    pieces = [x[a:b] for a, b in zip([0, *cuts], [*cuts, n])] + [x[n:]]      # some empty
    for name, src, c in (("rotate", x, None), ("rotate+carry", x, carry), ("rotate pieces", tuple(pieces), carry)):
        r = np.full(p, np.nan, np.float32)
        K.rht_rotate(src, p, signs, c, r, simd)
        out[name] = r
    u = rng.random(p, dtype=np.float32)
    for name, uu, packed, t, g in (("encode", u, 0, tab, 30), ("encode packed", u, 4, tab, 30),
                                   ("encode stream", (99, 64), 4, tab, 30), ("encode 5 bits", u, 5, tab5, 31),
                                   ("encode 5 bits stream", (99, 64), 5, tab5, 31)):
        z = np.empty(packed_size(p, packed) if packed else p, np.uint8)
        K.rht_encode(x, p, signs, big_m, g, t, uu, z, packed, np.empty(p, np.float32), simd)
        out[name] = z
    zi = rng.integers(0, 16, p).astype(np.uint8)
    lanes = rng.integers(0, 121, p).astype(np.uint8)
    for name, src, kind, t in (("decode values", carry, 0, b""), ("decode nibbles", pack_indices(zi, 4), 1, tab),
                               ("decode bytes", zi, 2, tab),
                               ("decode lanes/3", lanes, 3, (np.arange(256) / 3).astype(np.float32).tobytes())):
        d = np.full(n, np.nan, np.float32)
        K.rht_decode(src, kind, 2.0 * big_m / 90, big_m, p, signs, t, d, None if n == p else np.empty(p, np.float32),
                     simd)
        out[name] = d
    for packed, t, g in ((0, tab, 30), (4, tab, 30), (5, tab5, 31)):
        z, r = np.empty(packed_size(p, packed) if packed else p, np.uint8), np.full(p, np.nan, np.float32)
        K.quantize_ef(out["rotate+carry"], big_m, g, t, (5, 0), z, packed, r, simd)
        inplace = out["rotate+carry"].copy()
        K.quantize_ef(inplace, big_m, g, t, (5, 0), z, packed, inplace, simd)
        out[f"quantize_ef {packed}"], out[f"quantize_ef residual {packed}"] = z, r
        out[f"quantize_ef over its input {packed}"] = inplace
        assert np.array_equal(bits_of(inplace), bits_of(r))
    return {k: bits_of(v).tobytes() for k, v in out.items()}


@needs_avx2
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p,n", [(128, 128), (128, 77), (256, 255), (1024, 1000), (4096, 4096), (8192, 8191),
                                 (1 << 14, 12289), (1 << 15, 1 << 15)])
def test_every_kernel_equals_the_scalar_path_in_every_level_layout(layout, p, n):
    """Each fused kernel's vector paths (AVX2, and AVX-512 where the CPU has it; every blocking
    of the transform) and its scalar path give the same bits, for blocks of odd and even
    lengths, with and without the carried residual, an all-zero block (M = 0) and a huge-norm
    one (values ~1e28, finite throughout)."""
    old = K._tune(*layout) if layout else None
    try:
        for seed, scale, zero in ((p + n, 1.0, False), (3, 1e28, False), (4, 1.0, True)):
            b = _every_kernel(p, n, 0, seed, scale, zero)
            for simd in SIMD[1:]:
                a = _every_kernel(p, n, simd, seed, scale, zero)
                assert (simd, [k for k in a if a[k] != b[k]]) == (simd, [])
    finally:
        if old:
            K._tune(*old)


@needs_avx2
@pytest.mark.parametrize("p,n", [(1 << 20, 1 << 20), (1 << 20, 1_018_434), (1 << 21, (1 << 21) - 3)])
def test_every_kernel_equals_the_scalar_path_at_full_size(p, n):
    """The shipped blocking at a codec block of 2^20 (one level above the low chunks) and 2^21
    (two levels), the WideMLP's last block (1,018,434 of 2^20) among them."""
    b = _every_kernel(p, n, 0, 11)
    for simd in SIMD[1:]:
        a = _every_kernel(p, n, simd, 11)
        assert (simd, [k for k in a if a[k] != b[k]]) == (simd, [])


def test_lanes_over_k_take_the_table_values():
    """The 8-bit lanes' Y/k (decode_lanes' table of numpy's b/k in float32): the AVX2 decode
    divides instead of looking the table up, which is the same float32 for every byte and
    every k a job can have; a table that is not b/k is looked up."""
    from thc_ps.proto.headers import MAX_WORKERS
    b = np.arange(256)
    for k in range(1, MAX_WORKERS + 1):
        assert np.array_equal(bits_of((b / k).astype(np.float32)), bits_of(b.astype(np.float32) / np.float32(k)))
    p = 256
    signs = rademacher_bits(0, 0, 0, p)
    for k in (1, 2, 3, 7, 32):
        for tab in ((b / k).astype(np.float32), ((b / k) + (b == 200)).astype(np.float32)):
            got = {simd: np.empty(p, np.float32) for simd in SIMD}
            for simd in SIMD:
                K.rht_decode(b.astype(np.uint8), 3, 0.25, 1.5, p, signs, tab.tobytes(), got[simd], None, simd)
            a = tab * np.float32(0.25) - np.float32(1.5)
            K.fwht(a, 0)
            K.apply_signs(a, signs)
            assert all(np.array_equal(bits_of(g), bits_of(a)) for g in got.values())


def test_rotate_reads_pieces_as_their_concatenation():
    """rht_rotate of a gradient in pieces (empty ones, pieces shorter than a leaf, a last piece
    ending inside the block) equals the rotation of the pieces concatenated, on both paths;
    pieces that are not float32, or longer than the block, are refused."""
    rng = np.random.default_rng(8)
    p = 1 << 13
    signs = rademacher_bits(2, 0, 0, p)
    for n in (p, p - 1, 3000):
        x = ugly(n, n)
        cuts = sorted({0, n, *rng.integers(0, n, 40).tolist(), 5, 6, 64, 65})
        pieces = [x[a:b] for a, b in zip(cuts, cuts[1:])]
        pieces[3:3] = [x[:0], x[:0]]                    # empty pieces anywhere
        pieces.append(x[:0])
        for simd in SIMD:
            want, got = np.empty(p, np.float32), np.empty(p, np.float32)
            K.rht_rotate(x, p, signs, None, want, simd)
            K.rht_rotate(pieces, p, signs, None, got, simd)
            assert np.array_equal(bits_of(got), bits_of(want))
    with pytest.raises(ValueError, match="float32"):
        K.rht_rotate([x[:10], np.zeros(4, np.float64)], p, signs, None, np.empty(p, np.float32))
    with pytest.raises(ValueError, match="inconsistent"):
        K.rht_rotate([np.zeros(p, np.float32), np.zeros(1, np.float32)], p, signs, None, np.empty(p, np.float32))


def test_tune_refuses_blockings_it_cannot_run():
    if not K.has_avx2():
        pytest.skip("the AVX2 blocking only")
    for bad in ((64, 128, 5, 4096), (4096, 2048, 5, 4096), (4096, 1 << 15, 11, 4096), (4096, 1 << 15, 5, 100),
                (4096, 1 << 15, 5, 1 << 15)):
        with pytest.raises(ValueError, match="_tune"):
            K._tune(*bad)


def _encode_both(x, p, signs, big_m, g, tab, u, packed, simd):
    out = np.empty(packed_size(p, packed) if packed else p, np.uint8)
    K.rht_encode(x, p, signs, big_m, g, tab, u, out, packed, np.empty(p, np.float32), simd)
    return out


@pytest.mark.parametrize("bits,g", [(4, 30), (4, 51), (4, 63), (3, 36), (2, 36), (4, 100), (5, 31), (5, 63),
                                    (5, 120), (4, 255), (8, 255)])
@pytest.mark.parametrize("p,n", [(128, 128), (1 << 14, 1 << 14), (1 << 14, 9000), (1 << 17, 1 << 17), (64, 5)])
def test_rht_encode_paths_equal_separate_passes(bits, g, p, n):
    """Fused encode (every path) == apply_signs + fwht + quantize, every index, and packed
    b-bit as proto/packing.py packs them (5 bits at g = 31 and 63: the 32-level permutes)."""
    tab = bytes(solve_table(bits, g, "1/32").values)
    rng = np.random.default_rng(p + n + g)
    x = ugly(n, g)
    if n == 5:            # non-finite input: every output NaN, clamped like the scalar loop
        x[1], x[2], x[3] = np.inf, -np.inf, np.nan
    u = rng.random(p, dtype=np.float32)
    signs = rademacher_bits(9, 2, 0, p)
    big_m = 2.5 * float(np.linalg.norm(x[np.isfinite(x)])) / np.sqrt(p)
    padded = np.zeros(p, np.float32)
    padded[:n] = x
    ref = np.empty(p, np.uint8)
    K.apply_signs(padded, signs)
    K.fwht(padded, 0)
    K.quantize(padded, big_m, g, tab, u, ref)
    for simd in SIMD:
        got = _encode_both(x, p, signs, big_m, g, tab, u, False, simd)
        assert np.array_equal(got, ref)
        assert np.array_equal(_encode_both(x, p, signs, big_m, g, tab, u, bits, simd), pack_indices(ref, bits))
        # an all-zero round (M = 0): every coordinate at y = g/2
        zero = _encode_both(x, p, signs, 0.0, g, tab, u, False, simd)
        K.quantize(padded, 0.0, g, tab, u, ref)
        assert np.array_equal(zero, ref)
        K.quantize(padded, big_m, g, tab, u, ref)
    assert ref.max() < len(tab)


@pytest.mark.parametrize("kind", [0, 1, 2])
@pytest.mark.parametrize("p,nout", [(128, 128), (1 << 15, 1 << 15), (1 << 15, 20000), (1 << 18, 1 << 18), (64, 3)])
def test_rht_decode_paths_equal_separate_passes(kind, p, nout):
    tab = solve_table(4, 30, "1/32").values
    rng = np.random.default_rng(p + kind)
    z = rng.integers(0, 16, p).astype(np.uint8)
    v = rng.random(p, dtype=np.float32) * 30 if kind == 0 else np.asarray(tab, np.float32)[z]
    src = v if kind == 0 else pack_indices(z, 4) if kind == 1 else z
    signs = rademacher_bits(4, 1, 0, p)
    c, m = 2.0 * 0.37 / (30 * 3), 0.37
    a = v * np.float32(c) - np.float32(m)
    K.fwht(a, 0)
    K.apply_signs(a, signs)
    for simd in SIMD:
        out = np.full(nout, np.nan, np.float32)
        K.rht_decode(src, kind, c, m, p, signs, bytes(tab), out, None if nout == p else np.empty(p, np.float32), simd)
        assert np.array_equal(bits_of(out), bits_of(a[:nout]))


@pytest.mark.parametrize("p,n", [(8, 8), (128, 128), (1 << 14, 9000), (1 << 17, 1 << 17)])
def test_rht_rotate_equals_separate_passes_plus_carry(p, n):
    """rht_rotate (AVX2 and scalar) == apply_signs + fwht, then + carry in float32, bit for bit."""
    x, carry = ugly(n, p), ugly(p, p + 1)
    signs = rademacher_bits(3, 0, 1, p)
    ref = np.zeros(p, np.float32)
    ref[:n] = x
    K.apply_signs(ref, signs)
    K.fwht(ref, 0)
    for simd in SIMD:
        for c in (None, carry):
            out = np.full(p, np.nan, np.float32)
            K.rht_rotate(x, p, signs, c, out, simd)
            assert np.array_equal(bits_of(out), bits_of(ref if c is None else ref + carry))


@pytest.mark.parametrize("bits,g", [(4, 30), (4, 63), (2, 36), (5, 31), (5, 63), (5, 120), (4, 255), (8, 255)])
@pytest.mark.parametrize("n", [2, 128, 1000, 1002, 1040, 1048, 1 << 16])
def test_quantize_ef_equals_quantize_and_own_decode(bits, g, n):
    """quantize_ef: the indices of the separate quantizer (and of the counter stream's C
    encode), and R − (T[Z]·c − m) with c = float32(2M/g), m = float32(M), bit for bit.  The
    AVX2 path stores 32 indices at a time and the rest 8 at a time: n = 1000, 1040 and 1048
    leave 8, 16 and 24 of them.  The AVX-512 path takes 16 at a time and hands the rest to the
    AVX2 loop (n = 1000, 1048: 8 left) and what that leaves to the scalar one (n = 2, 1002)."""
    tab = solve_table(bits, g, "1/32").values
    x = ugly(n, g + n)
    u = np.random.default_rng(n).random(n, dtype=np.float32)
    for big_m in (2.5 * float(np.linalg.norm(x)) / np.sqrt(n), 0.0):
        ref = np.empty(n, np.uint8)
        K.quantize(x, big_m, g, bytes(tab), u, ref)
        c, m = (np.float32(2.0 * big_m / g), np.float32(big_m))
        want = x - (np.asarray(tab, np.float32)[ref] * c - m)
        for simd in SIMD:
            z, r = np.empty(n, np.uint8), np.full(n, np.nan, np.float32)
            K.quantize_ef(x, big_m, g, bytes(tab), u, z, 0, r, simd)
            assert np.array_equal(z, ref)
            assert np.array_equal(bits_of(r), bits_of(want))
            if n * bits % 8 == 0:       # packed b-bit: whole bytes only (n = 1000: 625 at 5 bits)
                zp, rp = np.empty(n * bits // 8, np.uint8), np.full(n, np.nan, np.float32)
                K.quantize_ef(x, big_m, g, bytes(tab), u, zp, bits, rp, simd)
                assert np.array_equal(zp, pack_indices(ref, bits))
                assert np.array_equal(bits_of(rp), bits_of(want))
    # the counter stream: the same indices as the fused encode of an unrotated block
    p = 1 << 12
    signs = rademacher_bits(1, 0, 0, p)
    y, rot = ugly(p, 5), np.empty(p, np.float32)
    K.rht_rotate(y, p, signs, None, rot)
    big_m = 2.2 * float(np.linalg.norm(y)) / np.sqrt(p)
    for simd in SIMD:
        fused, alone = np.empty(p, np.uint8), np.empty(p, np.uint8)
        K.rht_encode(y, p, signs, big_m, 30, bytes(solve_table(4, 30, "1/32").values), (77, 4096), fused, 0,
                     np.empty(p, np.float32), simd)
        K.quantize_ef(rot, big_m, 30, bytes(solve_table(4, 30, "1/32").values), (77, 4096), alone, 0, None, simd)
        assert np.array_equal(fused, alone)


def test_kernel_argument_checks():
    x = np.zeros(100, np.float32)
    with pytest.raises(ValueError):
        K.fwht(x)
    tab = bytes(solve_table(4, 30, "1/32").values)
    u = np.zeros(128, np.float32)
    with pytest.raises(ValueError):      # output too small
        K.rht_encode(x, 128, bytes(16), 1.0, 30, tab, u, np.empty(10, np.uint8), 0, np.empty(128, np.float32))
    with pytest.raises(ValueError):      # input longer than the block
        K.rht_encode(np.zeros(200, np.float32), 128, bytes(16), 1.0, 30, tab, u, np.empty(128, np.uint8), 0,
                     np.empty(128, np.float32))
    with pytest.raises(ValueError):      # table that does not end at g
        K.rht_encode(x, 128, bytes(16), 1.0, 31, tab, u, np.empty(128, np.uint8), 0, np.empty(128, np.float32))
    with pytest.raises(ValueError):      # fewer outputs than p need a work buffer
        K.rht_decode(u, 0, 1.0, 0.0, 128, bytes(16), b"", np.empty(100, np.float32), None)
    with pytest.raises(ValueError):      # a carry shorter than the block
        K.rht_rotate(x, 128, bytes(16), np.zeros(64, np.float32), np.empty(128, np.float32))
    with pytest.raises(ValueError):      # a residual buffer shorter than the input
        K.quantize_ef(u, 1.0, 30, tab, u, np.empty(128, np.uint8), 0, np.empty(100, np.float32))
    with pytest.raises(ValueError):      # packed nibbles need an even count
        K.quantize_ef(u[:3], 1.0, 30, tab, u, np.empty(2, np.uint8), 4, None)
    with pytest.raises(ValueError):      # 5-bit indices must end on a byte
        K.quantize_ef(u[:12], 1.0, 31, bytes(solve_table(5, 31, "1/32").values), u, np.empty(8, np.uint8), 5, None)
    with pytest.raises(ValueError):      # 16 levels do not fit 3 bits
        K.quantize_ef(u, 1.0, 30, tab, u, np.empty(48, np.uint8), 3, None)
    with pytest.raises(ValueError):      # no 9-bit packing
        K.rht_encode(x, 128, bytes(16), 1.0, 30, tab, u, np.empty(144, np.uint8), 9, np.empty(128, np.float32))
    assert K.simd() == (os.environ.get("THC_KERNELS") or BEST)
    if not K.has_avx512():
        with pytest.raises(RuntimeError, match="AVX-512"):
            K.quantize_ef(u, 1.0, 30, tab, u, np.empty(128, np.uint8), 0, None, 2)
    with pytest.raises(ValueError, match="simd=3"):
        K.quantize_ef(u, 1.0, 30, tab, u, np.empty(128, np.uint8), 0, None, 3)


@pytest.mark.parametrize("dim,block_log2,bits,g", [(1, 23, 4, 30), (3, 23, 4, 30), (1000, 23, 4, 30),
                                                   (70000, 14, 4, 30), (5000, 10, 3, 36), (300001, 17, 2, 36)])
def test_thc_fused_equals_reference_and_packing(dim, block_log2, bits, g):
    cfg = thc.ThcConfig(bits=bits, granularity=g, block_log2=block_log2, seed=5)
    rng = np.random.default_rng(dim)
    x = ugly(dim, dim)
    layout = thc.make_layout(dim, block_log2)
    norms = thc.block_norms(x, layout)
    u = rng.random(layout.padded_dim, dtype=np.float32)
    z = thc.encode(x, norms, cfg, layout, 3, u)
    zp = thc.encode_packed(x, norms, cfg, layout, 3, u)
    assert np.array_equal(zp, pack_indices(z, bits))
    ref = thc.encode(x, norms, cfg, layout, 3, u, use_kernels=False)   # numpy ops, BLAS-free C FWHT
    assert np.array_equal(z, ref)           # the same float32 operations, index for index
    y = thc.lookup_sum([z], cfg.table.values)
    own = thc.decode(y, 1, norms, cfg, layout, 3)
    for got in (thc.decode_own(z, norms, cfg, layout, 3), thc.decode_own(zp, norms, cfg, layout, 3, packed=True)):
        assert np.array_equal(bits_of(got), bits_of(own))
    t = thc.decode_own(torch.from_numpy(z), norms, cfg, layout, 3).numpy()
    assert np.allclose(t, own, atol=1e-4 * max(1e-30, np.abs(own).max()))


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 33, 1000, 4096, 100003])
def test_block_sum_of_squares_is_defined_to_the_bit(n):
    """The norm's Σ x² (docs/protocol.md §4 step 2): the AVX2 and scalar kernels and the numpy
    fallback all give the float64 of 16 lanes added in index order, then left to right."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * rng.lognormal(0, 3, n)).astype(np.float32)
    lanes = [0.0] * 16
    for i, v in enumerate(x.tolist()):
        lanes[i % 16] += v * v
    want = 0.0
    for v in lanes:
        want += v
    assert all(K.sumsq(x, simd) == want for simd in SIMD)
    saved = thc._kernels
    try:
        thc._kernels = None
        assert thc.sum_of_squares(x) == want
    finally:
        thc._kernels = saved
    layout = thc.make_layout(max(n, 1), 23, 23)      # one block, whatever n
    if n:
        assert thc.block_norms(x, layout)[0] == np.float32(np.sqrt(want))
        assert thc.block_norms(torch.from_numpy(x), layout)[0] == np.float32(np.sqrt(want))


_DIGEST = """
import hashlib, numpy as np
from thc_ps.compression import _kernels, thc
cfg = thc.ThcConfig(seed=7, block_log2=16)
rng = np.random.default_rng(1)
x = (rng.standard_normal(200000) * rng.lognormal(0, 2, 200000)).astype(np.float32)
layout = thc.make_layout(x.size, cfg.block_log2)
norms = thc.block_norms(x, layout)
zp = thc.encode_packed(x, norms, cfg, layout, 4, rng.random(layout.padded_dim, dtype=np.float32))
y = thc.lookup_sum([thc.encode(x, norms, cfg, layout, 4, rng.random(layout.padded_dim, dtype=np.float32))] * 3,
                   cfg.table.values)
d = thc.decode(y, 3, norms, cfg, layout, 4)
own = thc.decode_own(zp, norms, cfg, layout, 4, packed=True)
print(_kernels.simd(), hashlib.sha256(zp.tobytes() + d.tobytes() + own.tobytes()).hexdigest())
"""


def _digest(env_kernels, threads="1"):
    env = dict(os.environ)
    env.pop("THC_KERNELS", None)
    if env_kernels:
        env["THC_KERNELS"] = env_kernels
    env["THC_CODEC_THREADS"] = threads
    out = subprocess.run([sys.executable, "-c", _DIGEST], capture_output=True, text=True, check=True, env=env)
    return out.stdout.split()


def test_same_bytes_in_every_process_and_on_the_scalar_fallback():
    """Two fresh processes on the default path, one forced to the scalar fallback, one to
    AVX2 (a CPU without AVX-512, where this one has it) and one spreading the 4 RHT blocks
    over 3 codec threads produce the same packed indices, decoded average and error-feedback
    term, byte for byte."""
    a, b, s, t = _digest(None), _digest(None), _digest("scalar"), _digest(None, threads="3")
    assert a[0] == BEST and s[0] == "scalar"
    assert a[1] == b[1] == s[1] == t[1]
    if K.has_avx2():
        v = _digest("avx2")
        assert v == ["avx2", a[1]]


@pytest.mark.parametrize("value,error", [("sse", "expected scalar, avx2 or avx512"),
                                         ("avx512", "has no AVX-512"), ("avx2", "has no AVX2")])
def test_a_kernel_path_that_cannot_be_had_fails_the_import(value, error):
    """THC_KERNELS names the path; a word it does not know, or a path this CPU lacks, stops the
    import with that reason (an ImportError would send thc.py to its numpy code silently)."""
    if value == "avx512" and K.has_avx512() or value == "avx2" and K.has_avx2():
        pytest.skip(f"this CPU has the {value} path")
    env = dict(os.environ, THC_KERNELS=value)
    out = subprocess.run([sys.executable, "-c", "from thc_ps.compression import thc"], capture_output=True,
                         text=True, env=env)
    assert out.returncode != 0 and error in out.stderr and "ImportError" not in out.stderr


def test_codec_threads_setting(monkeypatch):
    monkeypatch.setenv("THC_CODEC_THREADS", "2")
    assert thc.codec_threads() == 2
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("THC_CODEC_THREADS", bad)
        with pytest.raises(ValueError, match="THC_CODEC_THREADS"):
            thc.codec_threads()
    # unset: this thread and one per idle core, at most the cores
    monkeypatch.delenv("THC_CODEC_THREADS")
    monkeypatch.setattr(thc.os, "cpu_count", lambda: 4)
    for idle, want in ((0, 1), (1, 2), (3, 4), (4, 4)):
        monkeypatch.setattr(thc, "idle_cores", lambda cores, idle=idle: idle)
        assert thc.codec_threads() == want


def test_idle_cores_follow_the_host_s_idle_share(monkeypatch):
    """idle_cores: every core before two samples exist, then the idle share of the last two
    samples at least SAMPLE_S apart times the cores, rounded; no /proc/stat: every core."""
    from thc_ps.compression import cores as C
    C._forget()
    stat = iter([(0, 0), (150, 400), (150, 800), (400, 1200)])
    monkeypatch.setattr(C, "cpu_times", lambda: next(stat))
    clock = iter([0.0, 0.1, 0.3, 0.6, 1.0])
    now = lambda: next(clock)       # noqa: E731
    own = lambda: 0.0               # noqa: E731 (this process used no CPU)
    assert C.idle_cores(4, now, own) == 4       # t=0: first sample, nothing to compare
    assert C.idle_cores(4, now, own) == 4       # t=0.1: too soon, no new sample
    assert C.idle_cores(4, now, own) == 2       # t=0.3: 150 of 400 jiffies idle: 1.5 cores
    assert C.idle_cores(4, now, own) == 0       # t=0.6: none idle
    assert C.idle_cores(4, now, own) == 2       # t=1.0: 250 of 400
    C._forget()
    monkeypatch.setattr(C, "cpu_times", lambda: None)
    assert C.idle_cores(2, lambda: 5.0, own) == 2 and C.idle_cores(2, lambda: 6.0, own) == 2
    C._forget()


def test_idle_cores_count_the_cores_this_process_keeps_busy_beyond_one(monkeypatch):
    """A lone worker on two cores whose two codec threads kept both busy (5% of the host
    idle, 1.9 cores of its own CPU in the window) still sees its second core: counted from the
    host's idle share alone it saw none, and took one thread and two by turns.  Ranks that
    share the cores (half a core each, none idle) see none."""
    from thc_ps.compression import cores as C
    C._forget()
    stat = iter([(0, 0), (10, 200), (10, 400)])
    monkeypatch.setattr(C, "cpu_times", lambda: next(stat))
    clock, cpu = iter([0.0, 1.0, 2.0]), iter([0.0, 1.9, 2.4])
    now, own = (lambda: next(clock)), (lambda: next(cpu))
    assert C.idle_cores(2, now, own) == 2       # first sample
    assert C.idle_cores(2, now, own) == 1       # 0.1 idle + 0.9 of its own beyond one core
    assert C.idle_cores(2, now, own) == 0       # none idle, half a core of its own
    C._forget()


def test_blocks_are_shared_evenly_among_codec_threads(monkeypatch):
    """With two codec threads each of 16 RHT blocks runs while the other thread runs one too
    (a barrier of two inside every block), so each thread takes 8: a thread takes the next
    free block, and the pool's thread does not get all but the first (it did, which left a
    lone worker's encode on one core with blocks of 2^20).  Every block runs exactly once."""
    import threading
    monkeypatch.setenv("THC_CODEC_THREADS", "2")
    meet, seen, lock = threading.Barrier(2, timeout=20), [], threading.Lock()

    def block(j):
        meet.wait()
        with lock:
            seen.append((j, threading.get_ident()))
    thc._each_block(block, 16)
    assert sorted(j for j, _ in seen) == list(range(16))
    per_thread = {}
    for _, t in seen:
        per_thread[t] = per_thread.get(t, 0) + 1
    assert sorted(per_thread.values()) == [8, 8]
    boom = RuntimeError("block 5")

    def failing(j):
        if j == 5:
            raise boom
    with pytest.raises(RuntimeError, match="block 5"):
        thc._each_block(failing, 16)


def test_a_caller_does_not_wait_for_another_callers_blocks(monkeypatch):
    """Two callers share the pool (the error-feedback decode in its helper thread and the
    lanes decode): while B's blocks hold both B's thread and the pool's one thread, A runs all
    of its blocks itself and returns, without waiting for B's to end."""
    import threading
    monkeypatch.setenv("THC_CODEC_THREADS", "2")
    thc._each_block(lambda j: None, 2)              # the pool exists with its one thread
    inside, release = threading.Barrier(3, timeout=20), threading.Event()

    def b_block(j):
        if j < 2:
            inside.wait()               # B's thread and the pool thread are both in here
        release.wait(timeout=20)
    b = threading.Thread(target=thc._each_block, args=(b_block, 4))
    b.start()
    inside.wait()
    done = []
    a = threading.Thread(target=lambda: (thc._each_block(done.append, 6)))
    a.start()
    a.join(timeout=10)
    finished_before_b = not a.is_alive()
    release.set()
    a.join(timeout=20)
    b.join(timeout=20)
    assert finished_before_b and sorted(done) == list(range(6)) and not b.is_alive()


@pytest.mark.parametrize("case", ["all", "lost", "mixed_k", "lanes16"])
def test_worker_lanes_decode_equals_per_chunk_average(case):
    """The worker's fused lanes → Y/k → RHT⁻¹ equals decode() of the per-chunk float32 Y/k,
    bit for bit; rounds with a lost chunk, mixed k or wide lanes take the per-chunk path."""
    from types import SimpleNamespace
    from thc_ps.proto.packing import pack_lanes
    from thc_ps.worker.client import average_lanes, joined_lanes
    lane_bits = 16 if case == "lanes16" else 8
    rng = np.random.default_rng(len(case))
    cfg = thc.ThcConfig(seed=2, block_log2=12)
    dim, per = 10000, 1440
    layout = thc.make_layout(dim, cfg.block_log2)
    total = layout.padded_dim
    norms = rng.random(len(layout.starts)) * 50
    chunks = [(off, min(per, total - off), b"") for off in range(0, total, per)]
    results = []
    for i, (_, count, _) in enumerate(chunks):
        k = int(rng.integers(1, 5)) if case == "mixed_k" else 3
        if case == "lost" and i % 3 == 1:
            results.append(None)
            continue
        results.append((SimpleNamespace(contributors=k), pack_lanes(rng.integers(0, 30 * k + 1, count), lane_bits)))
    want = thc.decode(average_lanes(chunks, results, total, 30, lane_bits), 1, norms, cfg, layout, 4)
    whole = joined_lanes(chunks, results, total, lane_bits)
    assert (whole is None) == (case != "all")
    if whole is not None:
        assert whole[1] == 3
        got = thc.decode_lanes(whole[0], whole[1], norms, cfg, layout, 4)
        assert np.array_equal(bits_of(got), bits_of(want))

