"""3LC on the workloads of docs/codec-3lc.md notes 7.13–7.15: compression ratio, the Table 2
trend over s, and encode/decode speed.

(a) Table 2 trend, single shot (docs/codec-3lc.md note 7.13): x = clip(N(0,1), −4, 4) float32, E = 0.
    Payload-only bits per value and ratio 32/bits (the paper's accounting, docs/codec-3lc.md A8), plus
    wire bits (14-byte header included), for s = 1.0, 1.5, 1.75, 1.9 and "No ZRE".
(b) Table 2 trend with error feedback, push and pull (docs/codec-3lc.md note 2.8, note 3.2): K workers push
    gradients through their own contexts; the PS averages and re-encodes with the shared
    pull context (`run_round`). Bits averaged over all rounds, pushes and pulls separately
    and together (K pushes + 1 shared pull per round), as Table 2 averages over a run.
    (b1) i.i.d. N(0,1) per worker (docs/codec-3lc.md note 7.15); (b2) a component shared by all workers in
    the round plus i.i.d. noise (workers' gradients agree in part, as real ones do).
(c) Speed at --dim values (s = 1): MB/s of float32 input for encode (accumulate + quantize
    + base-3^5 + ZRE) and decode (ZRE + base-3^5 + dequantize), per stage and end to end,
    on the clipped Gaussian (sparse output), the dense U(−1,1) case (docs/codec-3lc.md note 7.14) and the
    error-feedback steady state (docs/codec-3lc.md note 7.15). Best of --reps.

    .venv/bin/python bench/bench_codec_3lc.py [--dim 1048576] [--workers 4] [--rounds 30] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import best  # noqa: E402
from thc_ps.compression import threelc as T  # noqa: E402
from thc_ps.compression.codec import Context, run_round  # noqa: E402

S_VALUES = (1.0, 1.5, 1.75, 1.9)
PAPER = {None: (20.0, 1.60), 1.0: (39.4, 0.812), 1.5: (70.9, 0.451), 1.75: (107, 0.298), 1.9: (160, 0.200)}
SPEC_713 = {None: 1.6, 1.0: 0.606, 1.5: 0.145, 1.75: 0.120, 1.9: 0.116}    # docs/codec-3lc.md note 7.13 [ours]


def clipped_gaussian(n, seed=0):
    return np.clip(np.random.default_rng(seed).standard_normal(n), -4, 4).astype(np.float32)


def table2_single_shot(n):
    x = clipped_gaussian(n)
    ctx = Context("t", n)
    print(f"(a) Table 2 trend, single shot: clip(N(0,1), -4, 4), n = {n}, E = 0")
    print(f"{'s':>7}{'nonzero %':>11}{'bits/value':>12}{'ratio':>8}{'wire bits':>11}"
          f"{'note 7.13':>12}{'paper bits':>12}{'paper ratio':>13}")
    for s in (None,) + S_VALUES:
        codec = T.ThreeLCCodec(s=s or 1.0, use_zre=s is not None)
        st = T.message_stats(codec.encode(x, codec.new_state(), None, ctx))
        b = st["payload_bits"]
        print(f"{'no ZRE' if s is None else s:>7}{100 * st['nonzero_fraction']:>11.3f}{b:>12.3f}{32 / b:>8.1f}"
              f"{st['wire_bits']:>11.4f}{SPEC_713[s]:>12.3f}{PAPER[s][1]:>12.3f}{PAPER[s][0]:>13.1f}")


def table2_error_feedback(n, k, rounds, shared):
    what = "i.i.d. N(0,1) gradients" if not shared else "g_w = c_t + n_w, c_t and n_w i.i.d. N(0,1)"
    print(f"\n(b{'2' if shared else '1'}) Table 2 trend with error feedback: {k} workers, {what}, n = {n}, "
          f"{rounds} rounds (push: worker contexts; pull: one shared PS context)")
    print(f"{'s':>7}{'push bits':>11}{'pull bits':>11}{'all bits':>10}{'ratio':>8}"
          f"{'last-5 push':>13}{'last-5 pull':>13}{'paper bits':>12}{'paper ratio':>13}")
    for s in S_VALUES:
        codec = T.ThreeLCCodec(s=s)
        rng = np.random.default_rng(1)
        states, ps = [codec.new_state() for _ in range(k)], codec.new_ps_state()
        push, pull = [], []
        for r in range(rounds):
            common = rng.standard_normal(n) if shared else 0.0
            grads = [(common + rng.standard_normal(n)).astype(np.float32) for _ in range(k)]
            _, ups, down = run_round(codec, grads, rng, states=states, ps_state=ps, round_no=r)
            push.append(np.mean([T.payload_bits_per_value(u) for u in ups]))
            pull.append(T.payload_bits_per_value(down))
        allb = (k * np.mean(push) + np.mean(pull)) / (k + 1)      # k pushes and one shared pull per round
        print(f"{s:>7}{np.mean(push):>11.3f}{np.mean(pull):>11.3f}{allb:>10.3f}{32 / allb:>8.1f}"
              f"{np.mean(push[-5:]):>13.3f}{np.mean(pull[-5:]):>13.3f}{PAPER[s][1]:>12.3f}{PAPER[s][0]:>13.1f}")


def speed(n, reps):
    mb = 4 * n / 1e6
    rng = np.random.default_rng(2)
    warm = T.ThreeLCCodec()
    st = warm.new_state()
    for _ in range(12):                                   # reach the §7.15 steady state
        warm.encode(rng.standard_normal(n).astype(np.float32), st, None, Context("t", n))
    inputs = {"clipped N(0,1)": (clipped_gaussian(n), None),
              "U(-1,1) dense": (np.random.default_rng(3).uniform(-1, 1, n).astype(np.float32), None),
              "EF steady N(0,1)": (rng.standard_normal(n).astype(np.float32), st["e"])}
    print(f"\n(c) speed, n = {n} float32 ({mb:.1f} MB), s = 1, MB/s of float32 input, best of {reps}")
    print(f"{'input':<18}{'bits':>6}{'quantize':>10}{'b3^5 enc':>10}{'ZRE enc':>9}{'encode':>9}"
          f"{'ZRE dec':>9}{'b3^5+deq':>10}{'decode':>9}")
    codec, ctx = T.ThreeLCCodec(), Context("t", n)
    for name, (x, e) in inputs.items():
        q, m, _ = T.quantize(x, e, 1.0)
        b = T.base35_encode(q)
        z = T.zre_encode(b)
        payload = T.pack(q, m)
        head, body = T.parse(payload)
        t_q = best(lambda: T.quantize(x, e, 1.0), reps)
        t_b = best(lambda: T.base35_encode(q), reps)
        t_z = best(lambda: T.zre_encode(b), reps)
        state = {"e": None if e is None else e.copy()}      # EF row: the state keeps evolving, as in training
        t_enc = best(lambda: codec.encode(x, state if e is not None else {}, None, ctx), reps)
        t_zd = best(lambda: T.zre_decode(z, b.size), reps)
        t_bd = best(lambda: T.base35_dequantize(b, n, m), reps)
        t_dec = best(lambda: codec.decode(payload, ctx), reps)
        print(f"{name:<18}{8 * head.length / n:>6.3f}{mb / t_q:>10.0f}{mb / t_b:>10.0f}{mb / t_z:>9.0f}"
              f"{mb / t_enc:>9.0f}{mb / t_zd:>9.0f}{mb / t_bd:>10.0f}{mb / t_dec:>9.0f}")
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    ups = [codec.encode(g, codec.new_state(), None, ctx) for g in grads]
    t_agg = best(lambda: codec.aggregate(ups, codec.new_ps_state(), Context("t", n, contributors=4)), reps)
    print(f"aggregate (4 pushes -> decode, mean, re-encode): {1e3 * t_agg:.1f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=1 << 20)
    ap.add_argument("--table-dim", type=int, default=10**6, help="n for (a), docs/codec-3lc.md note 7.13 uses 10^6")
    ap.add_argument("--ef-dim", type=int, default=1 << 18)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    table2_single_shot(args.table_dim)
    table2_error_feedback(args.ef_dim, args.workers, args.rounds, shared=False)
    table2_error_feedback(args.ef_dim, args.workers, args.rounds, shared=True)
    speed(args.dim, args.reps)


if __name__ == "__main__":
    main()
