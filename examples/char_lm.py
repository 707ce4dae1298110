"""A character-level transformer language model, trained with DDP and its gradients sent
through THC-PS.  The text is the Python standard library's own source (every machine has it).

    thc ps --bind 0.0.0.0:9000                                  # on the PS host
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        examples/char_lm.py --ps PS_HOST:9000                   # on each training host
    torchrun --standalone --nproc-per-node 2 examples/char_lm.py --no-thc   # plain DDP

With --ckpt DIR it saves a checkpoint every --ckpt-every steps and resumes from it when it
starts (torchrun --max-restarts N restarts a failed launch from there; give torchrun
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 then, see docs/api.md "Checkpoints and restarts").
"""
import argparse
import hashlib
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def text_bytes(megabytes: float) -> torch.Tensor:
    """The standard library's .py files, in name order, as one byte tensor."""
    out, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= megabytes * 1e6:
            break
    return torch.frombuffer(bytearray(b"".join(out)[:int(megabytes * 1e6)]), dtype=torch.uint8).long()


class CharLM(nn.Module):
    """A small GPT: byte embeddings, pre-norm causal transformer blocks, a byte head."""

    def __init__(self, context: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.embed, self.pos = nn.Embedding(256, dim), nn.Parameter(torch.zeros(context, dim))
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x):
        h = self.embed(x) + self.pos[:x.shape[1]]
        return self.head(self.norm(self.blocks(h, mask=self.mask[:x.shape[1], :x.shape[1]], is_causal=True)))


def batch(data, size, context, seed):
    """`size` windows of `data` at positions drawn from `seed` (one seed per rank and step)."""
    at = torch.randint(0, len(data) - context - 1, (size,), generator=torch.Generator().manual_seed(seed))
    rows = torch.stack([data[i:i + context + 1] for i in at.tolist()])
    return rows[:, :-1], rows[:, 1:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ps", default=None, help="the PS: HOST:PORT[,HOST:PORT...] (default $THC_PS)")
    ap.add_argument("--keys", default=None, help="the PS's key directory (`thc keys`)")
    ap.add_argument("--no-thc", action="store_true", help="plain DDP (gloo all-reduce), for the comparison")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-mb", type=float, default=4.0, help="megabytes of text (the last tenth validates)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--ckpt", default=None, metavar="DIR", help="save and resume here")
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--out", default=None, help="write the final metrics here (JSON)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    data = text_bytes(args.text_mb)
    train, val = data[:len(data) * 9 // 10], data[len(data) * 9 // 10:]
    model = CharLM(args.context, args.dim, args.layers, heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    ckpt = Path(args.ckpt) / "last.pt" if args.ckpt else None
    saved = torch.load(ckpt, weights_only=False) if ckpt and ckpt.exists() else None
    if saved:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    ddp = DDP(model)

    state = None
    if not args.no_thc:                                              # THC-PS: these four lines
        import thc_ps
        state = thc_ps.connect(ddp, ps=args.ps, keys=args.keys)      # this rank joins; the hook is on
        if saved:
            state.load_state_dict(saved["thc"])                      # error feedback, RNG, rounds

    def val_loss():
        model.eval()
        with torch.no_grad():
            x, y = batch(val, 64, args.context, seed=12345)
            loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).item()
        model.train()
        return loss

    first = saved["step"] if saved else 0
    if rank == 0:
        print(f"char LM: {sum(p.numel() for p in model.parameters()):,} parameters, {world} ranks, "
              f"{'plain DDP' if args.no_thc else 'THC-PS job ' + state.job_name}, steps {first}..{args.steps}",
              flush=True)
    t0, losses = time.perf_counter(), []
    for step in range(first, args.steps):
        x, y = batch(train, args.batch, args.context, seed=args.seed * 1_000_003 + rank * 7919 + step)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if ckpt and (step + 1) % args.ckpt_every == 0:
            thc = state.state_dict() if state else None              # a collective: every rank
            if rank == 0:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                            "thc": thc}, ckpt.with_suffix(".tmp"))
                os.replace(ckpt.with_suffix(".tmp"), ckpt)
        if rank == 0 and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            ms = 1e3 * (time.perf_counter() - t0) / (step + 1 - first)
            sent = f", {state.totals['bytes_up'] / 1e6:.1f} MB up" if state else ""
            print(f"step {step + 1}/{args.steps}: train loss {sum(losses[-50:]) / len(losses[-50:]):.4f}, "
                  f"val loss {val_loss():.4f}, {ms:.0f} ms/step{sent}", flush=True)

    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    if rank == 0:
        result = {"val_loss": val_loss(), "train_loss": sum(losses[-50:]) / max(len(losses[-50:]), 1),
                  "steps": args.steps, "seconds": time.perf_counter() - t0, "replicas_identical":
                  len(set(digests)) == 1, "digest": digest, "thc": dict(state.totals) if state else None}
        print(f"final val loss {result['val_loss']:.4f}, replicas identical: {result['replicas_identical']}",
              flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    if state:
        state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.13 keeps gloo's threads running past destroy_process_group once DDP was built on
    # the group, and the interpreter's exit tears C++ down under them: now and then a rank
    # aborts ("terminate called without an active exception") after the run is done.  All is
    # written and flushed here, so leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
