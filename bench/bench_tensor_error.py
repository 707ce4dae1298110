"""Per-tensor error of one THC round on the example language model's gradients: a bucket cut
into RHT blocks as one vector against each tensor in blocks of its own (docs/design.md, "A
block never spans two tensors").

    .venv/bin/python bench/bench_tensor_error.py [--steps 50] [--workers 4] [--out FILE.json]

The model (examples/char_lm.py's defaults) trains `--steps` steps with AdamW on one process
first, so the gradients are a training run's, not an initialisation's; then each of
`--workers` ranks takes its own batch's gradient and one THC round (the job's defaults, no
error feedback) averages them, in process, twice: the model's gradients as one vector, and
tensor by tensor (`thc.make_layout`'s segments).  Per tensor it prints the relative error
‖x̂_t − x̄_t‖ / ‖x̄_t‖ of both, with the tensor's RMS gradient.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np



def one_round(cfg, vectors, segments, seed: int) -> np.ndarray:
    """The average of `vectors` through one THC round (Alg. 2–3, in process)."""
    from thc_ps.compression import thc
    layout = cfg.layout(vectors[0].size, segments)
    norms = np.max([thc.block_norms(v, layout) for v in vectors], axis=0)
    rng = np.random.default_rng(seed)
    zs = [thc.encode(v, norms, cfg, layout, 0, rng.random(layout.padded_dim, dtype=np.float32)) for v in vectors]
    return thc.decode(thc.lookup_sum(zs, cfg.table.values), len(vectors), norms, cfg, layout, 0)


def lm_gradients(steps: int, workers: int, seed: int) -> tuple[list, list]:
    """The example LM (examples/char_lm.py's defaults) trained `steps` steps with AdamW on one
    process, then each of `workers` ranks' gradient on its own batch: (tensor names, per rank
    the list of its tensors' gradients as float32 arrays)."""
    import torch
    import torch.nn.functional as F

    from thc_ps.deploy import lm_experiment as lm
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    ex = lm.example()
    data = ex.text_bytes(4.0)
    train = data[:len(data) * 9 // 10]
    model = ex.CharLM(64, 128, 4, heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    for step in range(steps):
        x, y = ex.batch(train, 16 * workers, 64, seed=seed * 1_000_003 + step)
        opt.zero_grad()
        F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
        opt.step()
        if (step + 1) % 10 == 0:
            print(f"  trained {step + 1}/{steps} steps", file=sys.stderr, flush=True)
    grads = []
    for r in range(workers):
        x, y = ex.batch(train, 16, 64, seed=10 ** 6 + r)
        model.zero_grad()
        F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
        grads.append([p.grad.detach().numpy().reshape(-1).astype(np.float32) for p in model.parameters()])
    return [n for n, _ in model.named_parameters()], grads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50, help="training steps before the gradients are taken")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the table as JSON here")
    args = ap.parse_args(argv)
    if args.steps < 0 or args.workers < 1:
        ap.error("--steps must be 0 or more and --workers 1 or more")
    from thc_ps.compression import thc
    names, grads = lm_gradients(args.steps, args.workers, args.seed)
    sizes = [g.size for g in grads[0]]
    mean = np.mean([np.concatenate(g) for g in grads], axis=0)
    cfg = thc.ThcConfig()
    whole = one_round(cfg, [np.concatenate(g) for g in grads], None, 1)
    cut = one_round(cfg, [np.concatenate(g) for g in grads], sizes, 1)
    rows, at = [], 0
    print(f"{'tensor':42s} {'size':>7s} {'RMS grad':>9s} {'one vector':>10s} {'per tensor':>10s}")
    for name, n in zip(names, sizes):
        t = mean[at:at + n]
        norm = float(np.linalg.norm(t)) or 1.0
        row = {"tensor": name, "size": n, "rms": float(np.linalg.norm(t) / np.sqrt(n)),
               "one_vector": float(np.linalg.norm(whole[at:at + n] - t) / norm),
               "per_tensor": float(np.linalg.norm(cut[at:at + n] - t) / norm)}
        rows.append(row)
        print(f"{name:42s} {n:7d} {row['rms']:9.2e} {row['one_vector']:10.3f} {row['per_tensor']:10.3f}")
        at += n
    for key in ("one_vector", "per_tensor"):
        errs = [r[key] for r in rows]
        print(f"{key.replace('_', ' ')}: relative error per tensor {min(errs):.3f}–{max(errs):.3f}, median "
              f"{float(np.median(errs)):.3f}")
    write_rows(args.out, {"steps": args.steps, "workers": args.workers, "seed": args.seed}, rows)
    return 0


def write_rows(out: str | None, meta: dict, rows: list) -> None:
    """The run's settings and rows as JSON where --out says (nothing without it)."""
    if out:
        Path(out).write_text(json.dumps({**meta, "rows": rows}, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
