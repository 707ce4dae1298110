"""`thc bench codecs`: every codec side by side on the same workload, in one run.

For n workers and dimension d: compression ratio each way, NMSE of one round (lognormal
and normal gradients, independent per worker), encode and decode speed per worker, PS
time per round (THC: the C lookup-and-sum of n packed payloads; the others: decode, sum,
re-encode), and optionally the end-to-end round time over the UDP transport and PS.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from thc_ps.compression import registry
from thc_ps.compression.codec import Context, combine_preliminary


def _timed(fn, repeat=2):
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _ps_time_thc(codec, ups, ctx) -> float:
    """THC at the PS is the C engine's lookup-and-sum over the packed payloads."""
    from thc_ps.ps_server._fastpath import lookup_accumulate
    count = codec.cfg.layout(ctx.dim).padded_dim
    acc = np.zeros(count, np.uint8)
    table = list(codec.cfg.table.values)
    t = time.perf_counter()
    for u in ups:
        lookup_accumulate(acc, u, table, codec.cfg.bits)
    return time.perf_counter() - t


def measure(name: str, workers: int, dim: int, seed: int = 0) -> dict:
    codec = registry.get(name)
    row = {"codec": name, "workers": workers, "dim": dim, "homomorphic": codec.homomorphic}
    for dist in ("lognormal", "normal"):
        rng = np.random.default_rng(seed)
        grads = [(rng.lognormal(0, 1, dim) if dist == "lognormal" else rng.standard_normal(dim)).astype(np.float32)
                 for _ in range(workers)]
        mean = np.mean(grads, axis=0)
        states = [codec.new_state() for _ in range(workers)]
        shared = combine_preliminary([codec.preliminary(g, s) for g, s in zip(grads, states)])
        ctx = Context("t", dim, 1, shared, workers)
        enc_t, ups = _timed(lambda: [codec.encode(g, s, rng, ctx) for g, s in zip(grads, states)], 1)
        if codec.name == "thc":
            ps_t = _ps_time_thc(codec, ups, ctx)
            down = codec.aggregate(ups, codec.new_ps_state(), ctx)
        else:
            ps_t, down = _timed(lambda: codec.aggregate(ups, codec.new_ps_state(), ctx), 1)
        dec_t, est = _timed(lambda: codec.decode(down, ctx), 1)
        row[f"nmse_{dist}"] = float(np.sum((est - mean) ** 2) / np.sum(mean ** 2))
        if dist == "lognormal":
            up_bytes = float(np.mean([len(u) for u in ups]))
            row.update(ratio_up=4.0 * dim / up_bytes, ratio_down=4.0 * dim / len(down),
                       bits_up=8 * up_bytes / dim, bits_down=8 * len(down) / dim,
                       encode_mcoord_s=dim * workers / enc_t / 1e6, decode_mcoord_s=dim / dec_t / 1e6,
                       ps_ms=ps_t * 1e3)
    return row


def run(workers=4, dims=(1 << 20, 1 << 24), e2e_dims=(1 << 20, 1 << 24), rounds=2, out="docs", log=print) -> Path:
    from thc_ps.deploy.launch import run_launch
    names = []
    for n in registry.names():
        try:
            registry.get(n)
            names.append(n)
        except ValueError as exc:
            log(f"skipping {n}: {exc}")
    rows = []
    for d in dims:
        for n in names:
            r = measure(n, workers, d)
            if d in e2e_dims:
                doc = run_launch(workers=workers, rounds=rounds, dim=d, codec=n, check=False, timeout_ms=2000)
                r["round_ms"] = doc["mean_round_ms"]
            rows.append(r)
            log(f"d=2^{d.bit_length() - 1} {n:<10} up {r['ratio_up']:6.1f}x down {r['ratio_down']:6.1f}x "
                f"nmse {r['nmse_lognormal']:.3g}/{r['nmse_normal']:.3g} enc {r['encode_mcoord_s']:.0f} "
                f"dec {r['decode_mcoord_s']:.0f} Mcoord/s PS {r['ps_ms']:.1f} ms"
                + (f" round {r['round_ms']:.0f} ms" if "round_ms" in r else ""))
    return write_doc(rows, workers, out)


def write_doc(rows, workers, out) -> Path:
    outdir = Path(out)
    outdir.mkdir(exist_ok=True)
    lines = ["| d | codec | homomorphic | ratio up | ratio down | bits up | bits down | NMSE lognormal | "
             "NMSE normal | encode Mcoord/s | decode Mcoord/s | PS ms/round | round ms (UDP) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| 2^{r['dim'].bit_length() - 1} | {r['codec']} | {'yes' if r['homomorphic'] else 'no'} | "
                     f"{r['ratio_up']:.1f} | {r['ratio_down']:.1f} | {r['bits_up']:.2f} | {r['bits_down']:.2f} | "
                     f"{r['nmse_lognormal']:.3g} | {r['nmse_normal']:.3g} | {r['encode_mcoord_s']:.1f} | "
                     f"{r['decode_mcoord_s']:.1f} | {r['ps_ms']:.2f} | "
                     + (f"{r['round_ms']:.2f}" if "round_ms" in r else "-") + " |")
    (outdir / "codecs-table.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        big = max(r["dim"] for r in rows)
        sel = [r for r in rows if r["dim"] == big]
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        ax[0].scatter([r["bits_up"] for r in sel], [r["nmse_lognormal"] for r in sel])
        for r in sel:
            ax[0].annotate(r["codec"], (r["bits_up"], r["nmse_lognormal"]))
        ax[0].set(xlabel="bits per coordinate up", ylabel="NMSE (lognormal)", yscale="log",
                  title=f"accuracy vs bandwidth, n={workers}, d=2^{big.bit_length() - 1}")
        ax[1].bar([r["codec"] for r in sel], [r["ps_ms"] for r in sel])
        ax[1].set(ylabel="PS time per round (ms)", yscale="log", title="PS-side work per round")
        ax[1].tick_params(axis="x", rotation=45)
        fig.tight_layout()
        fig.savefig(outdir / "codecs.png", dpi=100)
    except ImportError:
        pass
    return outdir / "codecs-table.md"
