"""The counter uniforms of THC's stochastic rounding (compression/stochastic.py): SplitMix64
itself, the C encode computing them in place against the numpy reference bit for bit, their
distribution, and a worker's one-stream randomness end to end."""
import numpy as np
import pytest

from thc_ps.compression import _kernels as K
from thc_ps.compression import stochastic as S
from thc_ps.compression import thc
from thc_ps.compression.hadamard import rademacher_bits
from thc_ps.proto.tables import solve_table

SIMD = [0] + [1] * K.has_avx2() + [2] * K.has_avx512()   # scalar, AVX2, AVX-512
MASK = (1 << 64) - 1


def splitmix64_python(seed: int, count: int) -> list:
    """SplitMix64 as a sequential generator, in Python integers (an independent reference)."""
    out, state = [], seed
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        out.append(z ^ (z >> 31))
    return out


def test_splitmix64_matches_its_published_first_output_and_a_sequential_reference():
    # SplitMix64 seeded with 0: first output 0xe220a8397b1dcdaf
    assert splitmix64_python(0, 1) == [0xE220A8397B1DCDAF]
    for key in (0, 1, 0xDEADBEEF, MASK):
        seq = splitmix64_python(key, 6)
        u = S.counter_uniforms(key, 12)
        want = [((h >> 40) if i % 2 == 0 else (h >> 8) & 0xFFFFFF) / 2 ** 24 for h in seq for i in (0, 1)]
        assert u.tolist() == want
        assert S.counter_uniforms(key, 5, start=7).tolist() == want[7:12]


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("p,n,base", [(128, 128, 0), (1 << 14, 9000, 1 << 14), (1 << 15, 1 << 15, 3),
                                      (64, 5, 0), (2, 2, 1)])
@pytest.mark.parametrize("packed", [0, 4])
def test_c_encode_computes_the_counter_uniforms_bit_for_bit(simd, p, n, base, packed):
    """rht_encode given (key, base) == rht_encode given the materialized uniforms, on both
    paths, even and odd stream offsets (an odd offset takes the scalar lanes of the AVX2 sink)."""
    x = np.random.default_rng(p + n).standard_normal(n).astype(np.float32) * 3
    tab = bytes(solve_table(4, 30, 1 / 32).values)
    signs = rademacher_bits(1, 2, 0, p)
    big_m = float(np.linalg.norm(x)) * 2.6 / np.sqrt(p)
    for key in (0, 0x0123456789ABCDEF, MASK):
        outs = []
        for u in ((key, base), S.counter_uniforms(key, p, start=base)):
            out = np.empty(p // 2 if packed else p, np.uint8)
            K.rht_encode(x, p, signs, big_m, 30, tab, u, out, packed, np.empty(p, np.float32), simd)
            outs.append(out)
        assert np.array_equal(*outs)


def test_encode_takes_a_stream_and_every_path_agrees():
    """thc.encode / encode_packed with a CounterUniforms: C kernels (several blocks, threads),
    the numpy reference and torch input give the same indices."""
    import torch
    cfg = thc.ThcConfig(block_log2=12)
    layout = thc.make_layout(3 * 4096 + 1000, cfg.block_log2)
    x = np.random.default_rng(4).standard_normal(layout.dim).astype(np.float32)
    norms = thc.block_norms(x, layout)
    cu = S.CounterUniforms(987654321)
    fused = thc.encode(x, norms, cfg, layout, 5, cu)
    assert np.array_equal(fused, thc.encode(x, norms, cfg, layout, 5, cu, use_kernels=False))
    assert np.array_equal(fused, thc.encode(x, norms, cfg, layout, 5, cu.take(0, layout.padded_dim)))
    assert np.array_equal(fused, thc.encode(torch.from_numpy(x), norms, cfg, layout, 5, cu).numpy())
    from thc_ps.proto.packing import pack_indices
    assert np.array_equal(thc.encode_packed(x, norms, cfg, layout, 5, cu), pack_indices(fused, 4))


def test_counter_uniforms_are_uniform_and_pairs_uncorrelated():
    """Mean, variance, a 256-bin chi-square, the correlation of the two halves of one output
    (coordinates 2m, 2m+1) and of neighbouring outputs, and of two keys: bounds at ~5 sigma."""
    n = 1 << 20
    u = S.counter_uniforms(0x5EED, n).astype(np.float64)
    assert u.min() >= 0 and u.max() < 1
    assert np.all((u * 2 ** 24) == np.floor(u * 2 ** 24))            # k·2^-24, exact
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 5 * np.sqrt(1 / 180 / n)           # Var of U² terms: 1/180
    counts = np.bincount((u * 256).astype(int), minlength=256)
    chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
    assert chi2 < 255 + 5 * np.sqrt(2 * 255)
    bound = 5 / np.sqrt(n / 2)
    assert abs(np.corrcoef(u[0::2], u[1::2])[0, 1]) < bound           # halves of one output
    assert abs(np.corrcoef(u[1:-1:2], u[2::2])[0, 1]) < bound         # neighbouring outputs
    v = S.counter_uniforms(0x5EED + 1, n).astype(np.float64)          # the next key
    assert abs(np.corrcoef(u, v)[0, 1]) < 5 / np.sqrt(n)


def test_stochastic_rounding_with_counter_uniforms_is_unbiased():
    """Alg. 3 line 14 is unbiased: averaged over 400 keys, the table-domain value of each of
    64 coordinates is within 5 sigma of its grid coordinate y."""
    cfg = thc.ThcConfig()
    tab = cfg.table.as_array().astype(np.float64)
    y = np.linspace(0.01, 29.99, 64)
    keys = np.random.default_rng(1).integers(0, 1 << 63, 400)
    iv = thc.lower_interval_index(cfg.table.as_array())
    vals = np.array([tab[thc.stochastic_round(y, cfg.table.as_array(), iv, S.counter_uniforms(int(k), 64))]
                     for k in keys])
    lo, hi = tab[iv[np.floor(y).astype(int)]], tab[iv[np.floor(y).astype(int)] + 1]
    sigma = np.sqrt((hi - y) * (y - lo) / len(keys)) + 1e-12
    assert np.all(np.abs(vals.mean(axis=0) - y) < 5 * sigma + 1e-9)


def test_key_from_takes_one_draw_and_bad_keys_are_refused():
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    k = S.key_from(a)
    assert 0 <= k < 1 << 64 and k == S.key_from(b)
    assert a.random() == b.random()                 # both streams advanced by the same one draw
    with pytest.raises(ValueError, match="64-bit"):
        S.counter_uniforms(1 << 64, 4)
    with pytest.raises(ValueError, match="64-bit"):
        S.counter_uniforms(-1, 4)
    with pytest.raises(ValueError, match="64-bit"):
        S.CounterUniforms(1 << 64)          # before the C encode would truncate it
    with pytest.raises(ValueError, match="64-bit"):
        S.CounterUniforms(1.5)
    out = np.empty(64, np.uint8)
    with pytest.raises(TypeError):
        K.rht_encode(np.zeros(64, np.float32), 64, bytes(8), 1.0, 30, bytes(solve_table(4, 30, 1 / 32).values),
                     ("key", 0), out, 0, np.empty(64, np.float32))
    with pytest.raises(ValueError, match="inconsistent"):
        K.rht_encode(np.zeros(64, np.float32), 64, bytes(8), 1.0, 30, bytes(solve_table(4, 30, 1 / 32).values),
                     np.zeros(10, np.float32), out, 0, np.empty(64, np.float32))


def test_worker_rounds_of_changing_sizes_encode_the_one_stream_in_order():
    """A one-worker THC job through the C PS with the default one-stream randomness: every
    round's kept residual is x − RHT⁻¹(X) of indices encoded with the key the stream gives
    next, recomputed here from a copy of the stream."""
    from thc_ps.proto.job import JobConfig
    from thc_ps.ps_server.server import PSServer
    from thc_ps.worker.client import Worker
    from thc_ps.worker.transport import Transport
    job = JobConfig(num_workers=1, rotation="round")   # the residual in the gradient's domain
    server = PSServer(job, ("127.0.0.1", 0), control_port=0, engine="c").start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port)
    try:
        w = Worker(t, seed=3)
        mirror = np.random.default_rng(np.random.SeedSequence([3, 0]))     # the worker's stream
        data = np.random.default_rng(5)
        e = {}
        for r, d in enumerate([40_000, 40_000, 9_000, 40_000, 70_000]):
            g = data.standard_normal(d).astype(np.float32)
            w.allreduce(g, key=f"g{d}", round_no=r)
            mine = thc.WorkerRound(w.cfg, g + e.get(d, 0))
            mine.encode(np.asarray(w.last.norms), mirror, r, packed=True)
            e[d] = mine.residual()
            np.testing.assert_array_equal(w.errors.errors[f"g{d}"], e[d])
    finally:
        t.close()
        server.stop()
