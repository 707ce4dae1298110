"""Fast Walsh–Hadamard and randomized Hadamard transforms."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from thc_ps.compression.hadamard import fwht, hadamard_matrix, irht, rademacher_signs, rht


def dense(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


@pytest.mark.parametrize("n", [1, 2, 4, 64, 128, 1 << 13])
def test_fwht_matches_dense_matrix(n):
    x = np.random.default_rng(n).standard_normal((3, n)).astype(np.float32)
    assert np.allclose(fwht(x), x @ dense(n).T, atol=1e-5)


def test_fwht_rejects_non_power_of_two():
    with pytest.raises(ValueError):
        fwht(np.zeros(12, np.float32))


@pytest.mark.parametrize("n", [256, 1 << 15])
def test_rht_round_trip_and_orthogonality(n):
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    s = rademacher_signs(7, 3, 0, n)
    y = rht(x, s)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-5)
    assert np.allclose(irht(y, s), x, atol=1e-4)
    m = hadamard_matrix(64).astype(np.float64)
    assert np.allclose(m @ m.T, np.eye(64), atol=1e-6)


def test_torch_equals_numpy():
    x = np.random.default_rng(2).standard_normal(1 << 14).astype(np.float32)
    s = rademacher_signs(1, 2, 3, x.size)
    assert np.allclose(rht(torch.from_numpy(x), s).numpy(), rht(x, s), atol=1e-5)


def test_signs_shared_across_processes():
    code = ("from thc_ps.compression.hadamard import rademacher_signs as r;"
            "import hashlib;print(hashlib.sha256(r(11, 5, 2, 4096).tobytes()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import hashlib
    assert out.stdout.strip() == hashlib.sha256(rademacher_signs(11, 5, 2, 4096).tobytes()).hexdigest()
    assert not np.array_equal(rademacher_signs(11, 5, 2, 4096), rademacher_signs(11, 6, 2, 4096))
    assert set(np.unique(rademacher_signs(0, 0, 0, 1000))) == {-1.0, 1.0}


def test_c_fwht_equals_matrix_form():
    for n in (1, 2, 1024, 1 << 12, 1 << 15):
        x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        assert np.allclose(fwht(x), fwht(x, exact=False), atol=1e-5)
        assert np.array_equal(fwht(x), fwht(x.copy()))      # deterministic


def test_a_rounds_sign_diagonals_are_drawn_once_for_all_its_blocks():
    """A 2^24 round at the default 2^20 blocks has 16 diagonals and takes each three times
    (encode, error-feedback decode, decode): the second and third walks must find every one
    kept (the same object), and the bits must be what a fresh draw gives."""
    from thc_ps.compression import hadamard
    first = [hadamard.rademacher_bits(5, 77, j, 1 << 20) for j in range(16)]
    for _ in range(2):
        assert all(hadamard.rademacher_bits(5, 77, j, 1 << 20) is first[j] for j in range(16))
    fresh = np.random.default_rng(np.random.SeedSequence([5, 77, 3])).bytes((1 << 20) // 8)
    assert first[3] == fresh


def test_the_sign_cache_is_bounded_by_bytes_and_drops_the_oldest():
    from thc_ps.compression.hadamard import _BitsCache
    cache = _BitsCache(limit_bytes=1000)

    def key(k, rnd=0):
        return (7, rnd, k, 2400)            # (job seed, round, block, n): blocks of one round
    for k in range(5):
        cache.put(key(k), bytes(300))
    assert cache.nbytes == 900 and cache.get(key(0)) is None and cache.get(key(1)) is None
    assert cache.get(key(2)) is not None     # a hit makes 2 the newest: 3 goes next
    cache.put(key(5), bytes(300))
    assert cache.get(key(3)) is None and cache.get(key(2)) is not None and cache.nbytes == 900
    cache.put(key(6), bytes(5000))           # larger than the bound: kept alone
    assert cache.nbytes == 5000 and cache.get(key(6)) is not None and cache.get(key(5)) is None


def test_the_sign_cache_keeps_only_the_newest_rounds():
    """A round's diagonals are not drawn again once later rounds began: a long job of small
    rounds keeps `rounds` rounds' bits, far below the byte bound, and a late draw of an old
    round is not kept."""
    from thc_ps.compression.hadamard import _BitsCache
    cache = _BitsCache(limit_bytes=1 << 20, rounds=2)
    for rnd in range(100):
        for block in range(3):
            cache.put((1, rnd, block, 800), bytes(100))
    assert cache.nbytes == 2 * 3 * 100
    assert cache.get((1, 99, 0, 800)) is not None and cache.get((1, 97, 2, 800)) is None
    cache.put((1, 10, 0, 800), bytes(100))
    assert cache.get((1, 10, 0, 800)) is None
    cache.put((2, 0, 0, 800), bytes(100))    # another job's seed has rounds of its own
    assert cache.get((2, 0, 0, 800)) is not None and cache.get((1, 98, 1, 800)) is not None
