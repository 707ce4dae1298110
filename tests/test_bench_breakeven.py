"""The break-even arithmetic of bench/bench_breakeven.py."""
import math

from bench.bench_breakeven import break_even_bps, ring_bytes


def test_ring_bytes_per_rank():
    assert ring_bytes(1 << 20, 4) == 1.5 * 4 * (1 << 20)
    assert ring_bytes(1000, 2) == 4000


def test_break_even_rate():
    # 6 MB against 2 MB per rank, 100 ms slower: 8·4e6 / 0.1 = 320 Mbit/s
    assert math.isclose(break_even_bps(6e6, 2e6, 0.2, 0.3), 3.2e8)
    # faster and smaller: THC-PS wins at every rate; larger and slower: at none
    assert break_even_bps(6e6, 2e6, 0.3, 0.2) == math.inf
    assert break_even_bps(2e6, 6e6, 0.2, 0.3) == 0.0
    # below B* THC-PS's total time is smaller, above it larger
    b_star = break_even_bps(6e6, 2e6, 0.2, 0.3)
    for rate, thc_wins in ((b_star / 2, True), (b_star * 2, False)):
        assert (0.3 + 8 * 2e6 / rate < 0.2 + 8 * 6e6 / rate) is thc_wins
