"""THC math: homomorphism, unbiasedness, error feedback, torch/numpy agreement, NMSE trends."""
from fractions import Fraction

import numpy as np
import pytest
import torch

from thc_ps.compression import nmse, thc
from thc_ps.compression.codec import ErrorFeedback
from thc_ps.compression.hadamard import irht, rademacher_signs
from thc_ps.proto.packing import LaneOverflowError
from thc_ps.proto.tables import lower_interval_index


def _round(grads, cfg, rng, round_no=0):
    layout = thc.make_layout(grads[0].size, cfg.block_log2)
    norms = np.max([thc.block_norms(g, layout) for g in grads], axis=0)
    zs = [thc.encode(g, norms, cfg, layout, round_no, rng.random(layout.padded_dim, dtype=np.float32))
          for g in grads]
    return layout, norms, zs


def test_a_tensors_rest_goes_in_power_of_two_blocks():
    """docs/protocol.md §4 step 1: whole blocks, then the rest rounded up to a multiple of
    2^tail_log2 and cut at its binary digits, largest first; a small rest is one block."""
    assert thc.make_layout(570_112).padded == (1 << 19, 1 << 15, 1 << 14)           # DDP's LM bucket
    assert thc.make_layout(297_216).padded == (1 << 18, 1 << 15, 1 << 12)
    assert thc.make_layout(2_067_010).padded_dim == 2_068_480                        # the WideMLP
    assert thc.make_layout(4097).padded == (8192,) and thc.make_layout(8193).padded == (8192, 4096)
    assert thc.make_layout(5000, 11, 11).padded == (2048, 2048, 1024)                # the old rule
    assert thc.make_layout(5000, 11, 6).padded == (2048, 2048, 512, 256, 128, 64)
    assert thc.make_layout(100, 20, 12).padded == (128,)
    assert thc.make_layout((2 << 20) - 100).padded == (1 << 20, 1 << 20)             # the rest rounds up to a block
    rng = np.random.default_rng(5)
    for _ in range(300):
        block, tail = int(rng.integers(4, 22)), int(rng.integers(0, 24))
        d = int(rng.integers(1, 5 << block))
        lay = thc.make_layout(d, block, tail)
        assert lay.starts[0] == 0 and sum(lay.lengths) == d
        assert all(a + n == b for a, n, b in zip(lay.starts, lay.lengths, lay.starts[1:]))
        assert all(p & (p - 1) == 0 and 0 < n <= p for n, p in zip(lay.lengths, lay.padded))
        assert all(n == p for n, p in zip(lay.lengths[:-1], lay.padded[:-1]))     # only the last one pads
        assert list(lay.padded) == sorted(lay.padded, reverse=True) and max(lay.padded) <= 1 << block
        rest = d % (1 << block)
        if rest > 1 << tail:
            assert lay.padded_dim - d < 1 << tail
        elif rest:
            assert lay.padded[-1] == 1 << (rest - 1).bit_length()
    assert thc.ThcConfig(tail_log2=6).layout(5000) == thc.make_layout(5000, 20, 6)
    with pytest.raises(ValueError, match="tail_log2"):
        thc.ThcConfig(tail_log2=31)


def test_tensors_back_to_back_are_cut_one_by_one_and_no_block_holds_two():
    """docs/protocol.md §4 step 1: a vector of several tensors is cut tensor by tensor (each by
    the one-tensor rule, its blocks after the last one's; an empty tensor has none), so every
    block lies inside one tensor; one tensor given as its own segment is cut as before."""
    assert thc.make_layout(5000, 11, 6, (7, 0, 2100, 1000, 1893)).padded == \
        (8, 2048, 64, 1024, 1024, 512, 256, 128)
    assert thc.make_layout(5000, 11, 6, (5000,)) == thc.make_layout(5000, 11, 6)
    cfg = thc.ThcConfig(block_log2=11, tail_log2=6)
    assert cfg.layout(5000, (3000, 2000)) == thc.make_layout(5000, 11, 6, (3000, 2000))
    assert cfg.layout(5000, [3000, 2000]) is cfg.layout(5000, (3000, 2000))     # cut once, kept
    assert cfg.layout(5000) != cfg.layout(5000, (3000, 2000))
    rng = np.random.default_rng(8)
    for _ in range(200):
        block, tail = int(rng.integers(4, 16)), int(rng.integers(0, 18))
        sizes = [int(n) for n in rng.integers(0, 3 << block, int(rng.integers(1, 9)))]
        if not sum(sizes):
            continue
        lay = thc.make_layout(sum(sizes), block, tail, sizes)
        want, at = [], 0
        for n in sizes:
            if n:
                one = thc.make_layout(n, block, tail)
                want += [(at + s, k, p) for s, k, p in zip(one.starts, one.lengths, one.padded)]
            at += n
        assert list(zip(lay.starts, lay.lengths, lay.padded)) == want
        ends = np.cumsum(sizes)
        for s, k in zip(lay.starts, lay.lengths):       # a block's first and last coordinate: one tensor
            assert np.searchsorted(ends, s, side="right") == np.searchsorted(ends, s + k - 1, side="right")
    for bad in ((3000, 1999), (3000, 2001), (5001, -1)):
        with pytest.raises(ValueError, match="adding up to 5,000"):
            thc.make_layout(5000, 11, 6, bad)


@pytest.mark.parametrize("dim,block_log2", [(1000, 23), (5000, 10)])
def test_homomorphism(dim, block_log2):
    cfg = thc.ThcConfig(block_log2=block_log2, seed=3)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(dim).astype(np.float32) for _ in range(4)]
    layout, norms, zs = _round(grads, cfg, rng)
    tab = cfg.table.values
    per_worker = [thc.decode(thc.lookup_sum([z], tab), 1, norms, cfg, layout, 0) for z in zs]
    joint = thc.decode(thc.lookup_sum(zs, tab), 4, norms, cfg, layout, 0)
    assert np.allclose(np.mean(per_worker, axis=0), joint, atol=1e-5)
    assert len(layout.starts) == (1 if block_log2 == 23 else 5)


def test_lookup_sum_exact_integers():
    tab = (0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30)
    zs = [np.array([0, 15, 7], np.uint8), np.array([15, 15, 1], np.uint8)]
    assert thc.lookup_sum(zs, tab).tolist() == [30, 60, 17]


def test_stochastic_round_unbiased():
    table = np.array([0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30])
    rng = np.random.default_rng(5)
    y = np.repeat(np.array([0.0, 0.4, 2.9, 13.5, 29.99, 30.0], np.float32), 200000)
    z = thc.stochastic_round(y, table, lower_interval_index(table), rng.random(y.size, dtype=np.float32))
    means = table[z].reshape(6, -1).mean(axis=1)
    assert np.allclose(means, [0.0, 0.4, 2.9, 13.5, 29.99, 30.0], atol=0.02)


@pytest.mark.parametrize("rotation", ["round", "job"])
def test_encode_decode_unbiased_without_clamping(rotation):
    # p tiny: t_p ≈ 4.9 so no coordinate is clamped and the estimate is unbiased (for any
    # one D: under a job's single rotation too).
    cfg = thc.ThcConfig(p="1/1000000", granularity=30, rotation=rotation)
    rng = np.random.default_rng(9)
    x = rng.standard_normal(256).astype(np.float32)
    layout = thc.make_layout(x.size)
    norms = thc.block_norms(x, layout)
    trials = 3000
    acc = np.zeros((trials, x.size))
    for t in range(trials):
        z = thc.encode(x, norms, cfg, layout, 0, rng.random(layout.padded_dim, dtype=np.float32))
        acc[t] = thc.decode(thc.lookup_sum([z], cfg.table.values), 1, norms, cfg, layout, 0)
    mean, se = acc.mean(axis=0), acc.std(axis=0) / np.sqrt(trials)
    assert np.all(np.abs(mean - x) < 5 * se + 1e-6)
    assert np.abs(mean - x).max() > 0  # a real estimate, not the input


def _clamp_bias(p: str, draws: int = 200) -> tuple[float, float, float]:
    """Four ranks' heavy-tailed vectors (a shared part and each rank's own) through rounds of
    one rotation that differ only in their uniforms: (bias², the bias estimate's own sampling
    variance, one round's noise), all relative to ‖x̄‖²."""
    rng = np.random.default_rng(11)
    d = 4096
    common = rng.standard_normal(d) * rng.lognormal(0, 1, d)
    xs = [(common + rng.standard_normal(d) * rng.lognormal(0, 1, d)).astype(np.float32) for _ in range(4)]
    cfg = thc.ThcConfig(p=p, rotation="job")
    layout = cfg.layout(d, None)
    norms = np.max([thc.block_norms(v, layout) for v in xs], axis=0)
    mean = np.mean(xs, axis=0, dtype=np.float64)
    ests = np.empty((draws, d))
    for k in range(draws):
        zs = [thc.encode(v, norms, cfg, layout, 0, rng.random(layout.padded_dim, dtype=np.float32)) for v in xs]
        ests[k] = thc.decode(thc.lookup_sum(zs, cfg.table.values), 4, norms, cfg, layout, 0)
    scale, avg = float(np.sum(mean ** 2)), ests.mean(axis=0)
    sampling = float(np.sum((ests - avg) ** 2)) / (draws - 1) / scale / draws
    noise = float(np.mean(np.sum((ests - mean) ** 2, axis=1))) / scale
    return float(np.sum((avg - mean) ** 2)) / scale - sampling, sampling, noise


def test_the_library_support_without_error_feedback_leaves_almost_no_clamp_bias():
    """At 1/32 the clamp's error is a bias far above its sampling error (error feedback carries
    it; without, one rotation per job repeats it every round).  At the support the library
    proposes without error feedback it is a tenth of that or less, and under what an average
    over rounds with Adam's β₁ = 0.9 leaves of the rounding noise (noise · 0.1/1.9)."""
    from thc_ps.torch import P_WITHOUT_FEEDBACK, job_proposal
    narrow, sampling, _ = _clamp_bias("1/32")
    assert narrow > 20 * sampling
    wide, sampling, noise = _clamp_bias(P_WITHOUT_FEEDBACK)
    assert wide < narrow / 10
    assert wide < noise * 0.1 / 1.9
    assert Fraction(job_proposal(4, {}, error_feedback=False).p) == Fraction(P_WITHOUT_FEEDBACK) < Fraction(1, 32)
    assert Fraction(job_proposal(4, {}, error_feedback=True).p) == thc.ThcConfig().p == Fraction(1, 32)
    assert Fraction(job_proposal(4, {"p": "1/64"}, error_feedback=False).p) == Fraction(1, 64)


def test_the_library_table_without_error_feedback_is_five_bits_and_keeps_the_lanes():
    """Without error feedback a launch proposes 5-bit indices at g = 31, whose sums take the
    lanes 4 bits at g = 30 take for every rank count (the bytes down do not change), and its
    rounding noise is below the 4-bit table's; with error feedback, or with b or g given, the
    proposal is JobConfig's (a given b keeps g's default, and the reverse)."""
    from thc_ps.proto.job import JobConfig
    from thc_ps.torch import TABLE_WITHOUT_FEEDBACK, job_proposal
    five = job_proposal(4, {}, error_feedback=False)
    assert (five.bits, five.granularity) == (TABLE_WITHOUT_FEEDBACK["bits"], TABLE_WITHOUT_FEEDBACK["granularity"])
    assert (five.bits, five.granularity) == (5, 31)
    plain = JobConfig(num_workers=4)
    assert (job_proposal(4, {}, error_feedback=True).bits, job_proposal(4, {}, True).granularity) == \
        (plain.bits, plain.granularity) == (4, 30)
    assert (job_proposal(4, {"bits": 4}, False).granularity, job_proposal(4, {"granularity": 60}, False).bits) == (30, 4)
    for n in range(1, 33):
        assert job_proposal(n, {}, False).lane_bits == JobConfig(num_workers=n).lane_bits, n
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(1 << 14) * rng.lognormal(0, 1, 1 << 14)).astype(np.float32)

    def mse(b, g):
        cfg = thc.ThcConfig(bits=b, granularity=g, p=Fraction(five.p))
        errs = []
        for r in range(8):
            rnd = thc.WorkerRound(cfg, x, None, "k")
            z = rnd.encode(rnd.norms(), np.random.default_rng(r), r)
            errs.append(np.mean((rnd.decode(thc.lookup_sum([z], cfg.table.values)) - x) ** 2))
        return float(np.mean(errs))
    assert mse(5, 31) < 0.5 * mse(4, 30)         # 0.30 of it on this draw
    assert mse(5, 31) < 0.6 * mse(4, 30)


@pytest.mark.parametrize("rotation", ["round", "job"])
def test_error_feedback_telescopes(rotation):
    cfg = thc.ThcConfig(seed=1, rotation=rotation)
    rng = np.random.default_rng(2)
    layout = thc.make_layout(3000)
    memory = ErrorFeedback()
    sent, total = np.zeros(3000), np.zeros(3000)
    for r in range(5):
        g = rng.lognormal(0, 1, 3000).astype(np.float32)
        total += g
        rnd = thc.WorkerRound(cfg, g, memory, "g")
        norms = rnd.norms()
        z = rnd.encode(norms, rng, r)
        sent += thc.decode(thc.lookup_sum([z], cfg.table.values), 1, norms, cfg, layout, r)
        rnd.feedback()
    err = memory.errors["g"]
    if rotation == "job":     # kept rotated, padding included: back to the gradient's domain
        assert err.shape == (layout.padded_dim,)
        err = irht(err, rademacher_signs(cfg.seed, 0, 0, layout.padded_dim))[:3000]
    # Σ decoded + final error == Σ gradients: nothing is lost, clamping included.
    assert np.allclose(sent + err, total, atol=1e-3)
    assert np.abs(err).max() > 0


def test_a_job_rotation_keeps_the_residual_rotated():
    """rotation "job": x = R∇ + e_R, Z from it, and e_R = R − X equals the rotation of the
    gradient-domain residual x − RHT⁻¹(X) (up to float32 rounding); the next round's x is
    R∇' + e_R bit for bit; the signs are round 0's in every round."""
    dim = 1 << 12                 # a power of two: no padding, so both domains hold the same vector
    cfg = thc.ThcConfig(seed=6, block_log2=11, rotation="job")
    layout = thc.make_layout(dim, cfg.block_log2)
    rng = np.random.default_rng(8)
    memory = ErrorFeedback()
    g1, g2 = (rng.standard_normal(dim).astype(np.float32) * 3 for _ in range(2))
    a = thc.WorkerRound(cfg, g1, memory, "k")
    assert np.array_equal(a.x, thc.rotate(g1, cfg, layout))
    norms = a.norms()
    assert np.allclose(norms, thc.block_norms(g1, layout), rtol=1e-5)     # ‖R_j‖ = ‖x_j‖
    z = a.encode(norms, np.random.default_rng(1), 7)
    assert np.array_equal(z, thc.encode(g1, norms, cfg, layout, 7, thc.CounterUniforms(
        thc.key_from(np.random.default_rng(1)))))
    own = thc.decode_own(z, norms, cfg, layout, 7)
    want = thc.rotate(g1 - own, cfg, layout)
    assert np.abs(a.residual() - want).max() < 1e-5 * np.abs(want).max()
    a.feedback()
    e = memory.errors["k"].copy()
    b = thc.WorkerRound(cfg, g2, memory, "k")
    assert np.array_equal(b.x, thc.rotate(g2, cfg, layout) + e)
    assert np.array_equal(own, thc.decode_own(z, norms, cfg, layout, 0))        # D of round 0 in round 7


@pytest.mark.parametrize("bits,g", [(4, 30), (5, 31)])
@pytest.mark.parametrize("tail_log2", [10, 6])
def test_a_job_rotation_round_block_by_block_equals_the_whole_round(tail_log2, bits, g):
    """The pipelined calls (start_packed, encode_blocks, residual_blocks) of a rotated round
    make the bytes and the residual of encode(packed=True) + residual(), bit for bit (3500 in
    blocks of 2^10: a rest of 428 in one block of 512, or in 256 + 128 + 64 with tail_log2 6),
    for nibbles and for 5-bit indices (5 bytes to 8 coordinates)."""
    cfg = thc.ThcConfig(bits=bits, granularity=g, seed=2, block_log2=10, rotation="job", tail_log2=tail_log2)
    dim = 3500
    rng = np.random.default_rng(3)
    g = (rng.standard_normal(dim) * rng.lognormal(0, 1, dim)).astype(np.float32)
    whole = thc.WorkerRound(cfg, g, ErrorFeedback(), "w")
    piece = thc.WorkerRound(cfg, g, ErrorFeedback(), "w")
    assert piece.can_pipeline()
    norms = whole.norms() * 0.8           # some coordinates clamped
    z = whole.encode(norms, np.random.default_rng(5), 4, packed=True)
    buf = piece.start_packed(norms, np.random.default_rng(5), 4)
    for j in reversed(range(len(piece.layout.starts))):
        piece.encode_blocks(range(j, j + 1))
    res = piece.residual_blocks(range(0, 1))
    assert np.array_equal(buf, z)
    assert np.array_equal(res.view(np.uint32), whole.residual().view(np.uint32))


@pytest.mark.parametrize("cuts", [(0, 2, 18, 512, 994, 1024), (0, 256, 1024), (0, 1024)])
def test_a_job_rotation_block_quantized_in_spans_equals_the_whole_block(cuts):
    """encode_span over cuts of each block (spans of 2, 16, 494 coordinates: starts that are
    not a multiple of any vector width) makes the bytes and residual of encode(packed=True),
    bit for bit; the rest of the blocks whole."""
    cfg = thc.ThcConfig(seed=3, block_log2=10, rotation="job", tail_log2=6)
    dim = 3500
    rng = np.random.default_rng(4)
    g = (rng.standard_normal(dim) * rng.lognormal(0, 1, dim)).astype(np.float32)
    whole = thc.WorkerRound(cfg, g, ErrorFeedback(), "w")
    piece = thc.WorkerRound(cfg, g, ErrorFeedback(), "w")
    norms = whole.norms() * 0.7
    z = whole.encode(norms, np.random.default_rng(6), 2, packed=True)
    buf = piece.start_packed(norms, np.random.default_rng(6), 2)
    for j, p in enumerate(piece.layout.padded):
        if p == 1024:
            for lo, hi in zip(cuts, cuts[1:]):
                piece.encode_span(j, lo, hi)
        else:
            piece.encode_blocks(range(j, j + 1))
    assert np.array_equal(buf, z)
    assert np.array_equal(piece.residual_blocks(range(0, 1)).view(np.uint32), whole.residual().view(np.uint32))


def test_a_span_outside_its_block_or_at_an_odd_offset_is_refused():
    cfg = thc.ThcConfig(seed=3, block_log2=10, rotation="job")
    g = np.ones(2048, np.float32)
    rnd = thc.WorkerRound(cfg, g, ErrorFeedback(), "w")
    rnd.start_packed(rnd.norms(), np.random.default_rng(0), 0)
    for lo, hi in ((1, 8), (0, 1026), (8, 8)):
        with pytest.raises(ValueError, match="on whole bytes of 4-bit"):
            rnd.encode_span(0, lo, hi)
    five = thc.WorkerRound(thc.ThcConfig(bits=5, granularity=31, seed=3, block_log2=10, rotation="job"), g,
                           ErrorFeedback(), "w")
    five.start_packed(five.norms(), np.random.default_rng(0), 0)
    five.encode_span(0, 8, 16)                  # 5 whole bytes
    with pytest.raises(ValueError, match="on whole bytes of 5-bit"):
        five.encode_span(0, 2, 16)              # even, but bit 10 of the stream
    per_round = thc.WorkerRound(thc.ThcConfig(seed=3, block_log2=10, rotation="round"), g, ErrorFeedback(), "w")
    with pytest.raises(ValueError, match="encodes whole blocks"):
        per_round.encode_span(0, 0, 8)


@pytest.mark.parametrize("bits,g", [(4, 30), (5, 31)])
@pytest.mark.parametrize("tail_log2", [11, 6])
def test_a_job_rotation_numpy_reference_equals_the_kernels(monkeypatch, tail_log2, bits, g):
    cfg = thc.ThcConfig(seed=9, block_log2=11, rotation="job", bits=bits, granularity=g, tail_log2=tail_log2)
    dim = 5000
    rng = np.random.default_rng(11)
    g = (rng.standard_normal(dim) * rng.lognormal(0, 2, dim)).astype(np.float32)
    carry = rng.standard_normal(cfg.layout(dim).padded_dim).astype(np.float32)

    def run():
        memory = ErrorFeedback()
        memory.update("r", carry.copy())
        rnd = thc.WorkerRound(cfg, g, memory, "r")
        x = rnd.x.copy()
        z = rnd.encode(rnd.norms(), np.random.default_rng(2), 1, packed=True)
        return x, z, rnd.residual().copy()
    fast = run()
    monkeypatch.setattr(thc, "_kernels", None)
    slow = run()
    for a, b in zip(fast, slow):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("rotation", ["job", "round"])
def test_five_bit_indices_go_block_by_block_and_equal_the_numpy_reference(monkeypatch, rotation):
    """5-bit indices at g = 31 (every block a multiple of 8 coordinates: whole bytes): a round's
    pipelined calls make the packed bytes and the residual of the whole round, and both equal
    those of the numpy reference (thc.py without its C kernels) bit for bit: the C packing, the
    32-level quantizer and, with a rotation per round, the own decode of widened indices."""
    cfg = thc.ThcConfig(bits=5, granularity=31, p=Fraction(1, 512), seed=7, block_log2=10, rotation=rotation,
                        tail_log2=6)
    rng = np.random.default_rng(13)
    g = (rng.standard_normal(3500) * rng.lognormal(0, 1, 3500)).astype(np.float32)

    def run(piecewise):
        rnd = thc.WorkerRound(cfg, g, ErrorFeedback(), "w")
        norms = rnd.norms() * 0.8           # some coordinates clamped
        if not piecewise:
            z = rnd.encode(norms, np.random.default_rng(5), 3, packed=True)
            return z.copy(), rnd.residual().copy()
        assert rnd.can_pipeline()
        buf = rnd.start_packed(norms, np.random.default_rng(5), 3)
        blocks = len(rnd.layout.starts)
        for j in reversed(range(blocks)):
            rnd.encode_blocks(range(j, j + 1))
        for j in range(blocks):
            res = rnd.residual_blocks(range(j, j + 1))
        return buf.copy(), res.copy()
    whole, piece = run(False), run(True)
    monkeypatch.setattr(thc, "_kernels", None)
    slow = run(False)
    assert whole[0].size == thc.packed_size(cfg.layout(3500).padded_dim, 5)
    for a, b, c in zip(whole, piece, slow):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
        assert np.array_equal(a.view(np.uint8), c.view(np.uint8))


@pytest.mark.parametrize("rotation", ["job", "round"])
def test_a_gradient_in_pieces_is_the_gradient_concatenated(rotation):
    """WorkerRound of thc.Pieces (empty ones among them, one longer than a block) and of their
    concatenation with the pieces' sizes as its segments: the same x, norms, indices, residual
    and next round, bit for bit.  A job rotation reads the pieces in place: its norms are those
    of R taken right after the transform, and R − X is written over R (the memory keeps that
    vector)."""
    cfg = thc.ThcConfig(seed=4, block_log2=10, rotation=rotation)
    rng = np.random.default_rng(21)
    dim = 2500
    grads = [(rng.standard_normal(dim) * rng.lognormal(0, 1, dim)).astype(np.float32) for _ in range(2)]
    cuts = [0, 7, 7, 1000, 1030, 2500]
    sizes = tuple(b - a for a, b in zip(cuts, cuts[1:]))

    def rounds(as_pieces):
        memory, out = ErrorFeedback(), []
        for r, g in enumerate(grads):
            rnd = thc.WorkerRound(cfg, thc.Pieces([g[a:b] for a, b in zip(cuts, cuts[1:])]) if as_pieces else g,
                                  memory, "p", segments=None if as_pieces else sizes)
            assert rnd.layout.padded == (8, 1024, 32, 1024, 512)     # 7 | 993 | 30 | 1024 + 446
            x, norms = rnd.x.copy(), rnd.norms()
            if rotation == "job":
                assert np.array_equal(norms, thc.rotated_norms(rnd.x, rnd.layout))
            z = rnd.encode(norms, np.random.default_rng(r), r, packed=True)
            e = rnd.residual()
            if rotation == "job":
                assert np.shares_memory(e, rnd.x)           # over R, no third vector
            out += [x, norms, z, e.copy()]
            rnd.feedback()
        return out
    for a, b in zip(rounds(True), rounds(False)):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    with pytest.raises(ValueError, match="float32"):
        thc.Pieces([np.zeros(3, np.float64)])
    p = thc.Pieces([grads[0][:10], grads[0][10:12]])
    assert p.size == 12 and [len(a) for a in p.span(9, 11)] == [1, 1]
    assert np.array_equal(p.concatenate(), grads[0][:12])


def test_a_rotation_the_job_does_not_know_is_refused():
    with pytest.raises(ValueError, match="rotation must be one of round, job"):
        thc.ThcConfig(rotation="epoch")
    from thc_ps.proto.job import JobConfig
    with pytest.raises(ValueError, match="rotation must be one of round, job"):
        JobConfig(num_workers=2, rotation="epoch")
    assert JobConfig(num_workers=2, rotation="round").differences({"rotation": "job"}) == \
        ["rotation: PS has 'round', worker expects 'job'"]
    assert thc.ThcConfig.of_job(JobConfig(num_workers=2, rotation="round")).rotation == "round"
    with pytest.raises(ValueError, match="one rotation"):      # rotate() under a per-round job
        thc.rotate(np.ones(8, np.float32), thc.ThcConfig(rotation="round"), thc.make_layout(8))


def test_every_default_rotation_is_the_one_in_proto_job():
    """The job's rotation unless told is thc_ps.proto.job.DEFAULT_ROTATION for the job, the codec's
    config, `thc` commands, `thc launch`'s clusters and `thc train`'s run alike."""
    import inspect

    from thc_ps.deploy import cli, launch
    from thc_ps.deploy.train import TrainConfig
    from thc_ps.proto.job import DEFAULT_ROTATION, ROTATIONS, JobConfig
    assert DEFAULT_ROTATION in ROTATIONS
    assert JobConfig(num_workers=2).rotation == thc.ThcConfig().rotation == TrainConfig().job.rotation == DEFAULT_ROTATION
    assert cli.build_parser().parse_args(["train"]).rotation == DEFAULT_ROTATION
    assert inspect.signature(launch.run_launch).parameters["rotation"].default == DEFAULT_ROTATION


def test_pooled_rounds_equal_fresh_ones_and_reuse_their_buffers():
    """A float32 round with a memory takes x and the residual from the memory's spares and
    decodes into the caller's vector: the same bytes as rounds whose memory is new every
    round (so every vector is fresh), and from the third round on x cycles through the
    buffers given back."""
    cfg = thc.ThcConfig(seed=3, block_log2=10)
    dim = 2500
    layout = thc.make_layout(dim, cfg.block_log2)
    rng = np.random.default_rng(4)
    lanes = rng.integers(0, 121, layout.padded_dim).astype(np.uint8)
    pooled, e_fresh = ErrorFeedback(), None
    est = np.empty(dim, np.float32)
    seen = []
    for r in range(5):
        g = rng.standard_normal(dim).astype(np.float32)
        fresh = ErrorFeedback()
        if e_fresh is not None:
            fresh.update("g", e_fresh.copy())
        a = thc.WorkerRound(cfg, g, pooled, "g")
        b = thc.WorkerRound(cfg, g.copy(), fresh, "g")
        assert a.pooled and not np.shares_memory(a.x, g)
        seen.append(a.x.ctypes.data)
        na, nb = a.norms(), b.norms()
        za = a.encode(na, np.random.default_rng(r), r, packed=True)
        zb = b.encode(nb, np.random.default_rng(r), r, packed=True)
        assert np.array_equal(za, zb)
        got = a.decode_lanes(lanes, 3, out=est)
        assert got is est and np.array_equal(est, b.decode_lanes(lanes, 3))
        a.feedback()
        b.feedback()
        e_fresh = fresh.errors["g"]
        assert np.array_equal(pooled.errors["g"], e_fresh)
        assert a.x is None                      # given back for the next round
    assert len(set(seen[2:])) <= 2              # x reuses the given-back buffers
    with pytest.raises(ValueError, match="out must be"):
        thc.decode_lanes(lanes, 3, na, cfg, layout, 0, out=np.empty(dim, np.float64))


def test_torch_path_equals_numpy():
    cfg = thc.ThcConfig(seed=4)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(3000).astype(np.float32)
    layout = thc.make_layout(x.size)
    norms = thc.block_norms(x, layout)
    u = rng.random(layout.padded_dim, dtype=np.float32)
    z_np = thc.encode(x, norms, cfg, layout, 2, u)
    z_t = thc.encode(torch.from_numpy(x), norms, cfg, layout, 2, torch.from_numpy(u))
    assert (z_t.numpy() != z_np).mean() < 1e-3   # float rounding may flip a rare boundary draw
    y = thc.lookup_sum([z_np], cfg.table.values)
    d_np = thc.decode(y, 1, norms, cfg, layout, 2)
    d_t = thc.decode(torch.from_numpy(y), 1, norms, cfg, layout, 2)
    assert np.allclose(d_t.numpy(), d_np, atol=1e-5)


def test_zero_gradient_round():
    cfg = thc.ThcConfig()
    x = np.zeros(100, np.float32)
    layout = thc.make_layout(100)
    norms = thc.block_norms(x, layout)
    z = thc.encode(x, norms, cfg, layout, 0, np.random.default_rng(0).random(128, dtype=np.float32))
    assert np.all(thc.decode(thc.lookup_sum([z], cfg.table.values), 1, norms, cfg, layout, 0) == 0)


def test_overflow_config_refused():
    with pytest.raises(LaneOverflowError):
        thc.ThcConfig(granularity=30, lane_bits=8).check_workers(9)
    with pytest.raises(LaneOverflowError):
        nmse.one_round("thc", [np.ones(8, np.float32)] * 9, np.random.default_rng(0), lane_bits=8)


def test_uhc_homomorphic():
    cfg = thc.UhcConfig(bits=4)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(500).astype(np.float32) for _ in range(3)]
    lo, hi = min(g.min() for g in grads), max(g.max() for g in grads)
    zs = [thc.uhc_encode(g, lo, hi, cfg, rng.random(500, dtype=np.float32)) for g in grads]
    each = [thc.uhc_decode(z.astype(np.int64), 1, lo, hi, cfg) for z in zs]
    joint = thc.uhc_decode(thc.lookup_sum(zs, cfg.table.values), 3, lo, hi, cfg)
    assert np.allclose(np.mean(each, axis=0), joint, atol=1e-5)


def test_nmse_trends():
    common = dict(workers=4, dim=1 << 14, trials=4, seed=1)
    b2 = nmse.run("thc", bits=2, granularity=36, **common)["nmse"]
    b3 = nmse.run("thc", bits=3, granularity=36, **common)["nmse"]
    b4 = nmse.run("thc", bits=4, granularity=38, **common)["nmse"]
    assert b2 > 3 * b3 and b3 > 1.5 * b4      # ratios ~4 and ~2 (40-trial runs); 4 trials vary ±5%
    two = nmse.run("thc", workers=2, dim=1 << 14, trials=4, seed=1)["nmse"]
    eight = nmse.run("thc", workers=8, dim=1 << 14, trials=4, seed=1)["nmse"]
    assert eight < two  # copies with independent rounding: error shrinks with n
    tern = nmse.run("terngrad", workers=2, dim=1 << 16, trials=2, seed=1)["nmse"]
    topk = nmse.run("topk", workers=2, dim=1 << 16, trials=2, seed=1)["nmse"]
    assert tern > 20 * topk > 20 * two


def test_c_kernels_equal_numpy_reference():
    cfg = thc.ThcConfig(seed=6)
    rng = np.random.default_rng(8)
    for dim, block in ((5000, 23), (70000, 14)):
        x = (rng.standard_normal(dim) * rng.lognormal(0, 2, dim)).astype(np.float32)
        layout = thc.make_layout(dim, block)
        norms = thc.block_norms(x, layout)
        u = rng.random(layout.padded_dim, dtype=np.float32)
        fast = thc.encode(x, norms, cfg, layout, 3, u)
        ref = thc.encode(x, norms, cfg, layout, 3, u, use_kernels=False)
        assert (fast != ref).mean() < 1e-4      # float32 ops may flip a draw at a boundary
        y = thc.lookup_sum([ref], cfg.table.values)
        a = thc.decode(y, 1, norms, cfg, layout, 3)
        b = thc.decode(torch.from_numpy(y), 1, norms, cfg, layout, 3).numpy()
        assert np.allclose(a, b, atol=1e-4 * np.abs(a).max())
    zero = thc.encode(np.zeros(64, np.float32), np.zeros(1), cfg, thc.make_layout(64), 0, u[:64])
    assert zero.max() < 16
