"""One rank of the Lightning test (tests/test_api.py), started by torchrun: the example's
char LM trained by a Lightning Trainer whose DDPStrategy sends its gradients through THC-PS.

Lightning initializes the process group only when none exists, so the script starts it
first: then `thc_ps.connect` can run before the Trainer, and its state and hook go to
DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...); on CPU, where Lightning registers no
communication hook, thc_ps.lightning.HookOnCPU does."""
import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy

import thc_ps
from thc_ps.lightning import HookOnCPU

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from char_lm import CharLM, batch, text_bytes   # noqa: E402


class Module(L.LightningModule):
    def __init__(self, data):
        super().__init__()
        self.model, self.data = CharLM(16, 32, 1, heads=4), data

    def training_step(self, step_batch, i):
        x, y = batch(self.data, 4, 16, seed=1000 * i + self.global_rank)
        return F.cross_entropy(self.model(x).reshape(-1, 256), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ps", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    state = thc_ps.connect(ps=args.ps, warmup_steps=2)
    module = Module(text_bytes(0.2))
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), max_steps=args.steps,
                        strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=thc_ps.hook),
                        callbacks=[HookOnCPU(state)],
                        enable_progress_bar=False, enable_checkpointing=False, logger=False,
                        enable_model_summary=False)
    steps = torch.utils.data.DataLoader(range(args.steps), batch_size=1)
    trainer.fit(module, steps)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest()
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"identical": len(set(digests)) == 1, **state.totals}))
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)             # as examples/char_lm.py: no exit-time teardown under gloo's threads
