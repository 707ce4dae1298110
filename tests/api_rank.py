"""One rank of the library API's multi-process tests (tests/test_api.py), started by torchrun:
a small model on seeded random data, its gradients through `thc_ps.connect`, checkpoints
like the example's, and a JSON report from rank 0 (parameters' digest, loss, RSS, the
job's name and the gradients a step averaged)."""
import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import thc_ps

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ps", default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--codec", default=None)
    ap.add_argument("--rotation", default=None)
    ap.add_argument("--error-feedback", choices=("on", "off"), default=None,
                    help="connect(error_feedback=...) (default: the library's)")
    ap.add_argument("--warmup-steps", default=None,
                    help="connect(warmup_steps=...), one number or one per rank (A,B,...) (default: the library's)")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--job-name", default=None)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--rss-at", default="", help="steps after which rank 0 notes its RSS")
    ap.add_argument("--check-average", action="store_true", help="compare one step's gradients with the "
                    "average of the ranks' own, computed here")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    model = torch.nn.Sequential(torch.nn.Linear(32, args.width), torch.nn.LayerNorm(args.width), torch.nn.ReLU(),
                                torch.nn.Linear(args.width, 8)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.warmup_steps is not None:
        each = [int(v) for v in args.warmup_steps.split(",")]
        args.warmup_steps = each[rank] if len(each) > 1 else each[0]
    ckpt = Path(args.ckpt) / "last.pt" if args.ckpt else None
    saved = torch.load(ckpt, weights_only=False) if ckpt and ckpt.exists() else None
    if saved:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    ddp = DDP(model)
    state = thc_ps.connect(ddp, ps=args.ps, job_name=args.job_name,
                           **{k: v for k, v in (("codec", args.codec), ("rotation", args.rotation),
                                                ("warmup_steps", args.warmup_steps)) if v is not None},
                           **({"error_feedback": args.error_feedback == "on"} if args.error_feedback else {}))
    if saved:
        state.load_state_dict(saved["thc"])
    rss, checked, first = {}, None, saved["step"] if saved else 0
    marks = {int(s) for s in args.rss_at.split(",") if s}
    for step in range(first, args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=g).to(dtype), torch.randint(0, 8, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(ddp(x).float(), y).backward()
        if args.check_average and step == first:
            ref = torch.nn.Sequential(*[m for m in model])          # the same parameters, no DDP
            mine = torch.autograd.grad(F.cross_entropy(ref(x).float(), y), list(ref.parameters()))
            local = torch.cat([t.float().reshape(-1) for t in mine])
            every = [torch.zeros_like(local) for _ in range(world)]
            dist.all_gather(every, local)
            want = (sum(every[1:], every[0]) / world).to(dtype)
            got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            checked = {"equal": bool(torch.equal(got, want)), "max_diff": float((got.float() - want.float()).abs().max())}
        opt.step()
        if ckpt and args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            thc = state.state_dict()
            if rank == 0:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1, "thc": thc},
                           ckpt)
        if step + 1 in marks:
            rss[step + 1] = rss_kib()
    digest = hashlib.sha256(b"".join(p.detach().float().numpy().tobytes() for p in model.parameters())).hexdigest()
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "digest": digest, "identical": len(set(digests)) == 1, "rss_kib": rss, "job_name": state.job_name,
            "lane_bits": state.job.lane_bits, "rotation": state.job.rotation, "totals": state.totals,
            "checked": checked, "first": first, "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT")}))
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)             # as examples/char_lm.py: no exit-time teardown under gloo's threads
