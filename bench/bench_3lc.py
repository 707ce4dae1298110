"""3LC Table 2 trend: payload bits per value and compression ratio for s = 1.0 … 1.9.

Two workloads (docs/codec-3lc.md notes 7.13 and 7.15): (a) clipped Gaussian single shot (docs/codec-3lc.md note 7.13), and (b) real
gradients: a small CNN trained on Fashion-MNIST for --steps steps, each step's gradient
pushed through a 3LC context with error accumulation (the paper averages over training,
pushes and pulls; here pushes).  Payload-only accounting (docs/codec-3lc.md A8), as Table 2.

    .venv/bin/python bench/bench_3lc.py [--steps 150]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from thc_ps.compression import threelc as T
from thc_ps.compression.codec import Context

PAPER = {1.0: (39.4, 0.812), 1.5: (70.9, 0.451), 1.75: (107, 0.298), 1.9: (160, 0.200)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    args = ap.parse_args()
    x = np.clip(np.random.default_rng(0).standard_normal(10**6), -4, 4).astype(np.float32)
    x[0] = 4.0
    print("(a) clipped Gaussian N(0,1) in [-4, 4], n = 10^6, single shot")
    print(f"{'s':>5}{'bits/value':>12}{'ratio':>9}{'encode MB/s':>13}{'decode MB/s':>13}")
    for s in (1.0, 1.5, 1.75, 1.9):
        c = T.ThreeLCCodec(s=s)
        t = time.perf_counter()
        p = c.encode(x, {}, None, Context("t", x.size))
        te = time.perf_counter() - t
        t = time.perf_counter()
        c.decode(p, Context("t", x.size))
        td = time.perf_counter() - t
        b = T.payload_bits_per_value(p)
        print(f"{s:>5}{b:12.3f}{32 / b:9.1f}{4 * x.size / te / 1e6:13.0f}{4 * x.size / td / 1e6:13.0f}")

    from thc_ps.worker import data
    from thc_ps.worker.training import SmallCNN
    torch.manual_seed(0)
    xtr, ytr = data.load("train")
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    params = list(model.parameters())
    codecs = {s: (T.ThreeLCCodec(s=s), [{} for _ in params]) for s in (1.0, 1.5, 1.75, 1.9)}
    bits = {s: [] for s in codecs}
    for step in range(args.steps):
        idx = np.arange(step * 64, (step + 1) * 64) % len(xtr)
        opt.zero_grad()
        F.cross_entropy(model(torch.from_numpy(xtr[idx])), torch.from_numpy(ytr[idx])).backward()
        grads = [p.grad.detach().numpy().ravel().astype(np.float32) for p in params]
        total = sum(g.size for g in grads)
        for s, (c, states) in codecs.items():   # one context per layer tensor, as the paper
            nbits = sum(T.payload_bits_per_value(c.encode(g, st, None, Context(str(i), g.size))) * g.size
                        for i, (g, st) in enumerate(zip(grads, states)))
            bits[s].append(nbits / total)
        opt.step()
    print(f"\n(b) real gradients: SmallCNN on Fashion-MNIST, {args.steps} steps, push with error accumulation, one context per layer tensor")
    print(f"{'s':>5}{'bits/value':>12}{'ratio':>9}{'paper bits':>12}{'paper ratio':>13}")
    for s in codecs:
        b = float(np.mean(bits[s]))
        print(f"{s:>5}{b:12.3f}{32 / b:9.1f}{PAPER[s][1]:12.3f}{PAPER[s][0]:13.1f}")


if __name__ == "__main__":
    main()
