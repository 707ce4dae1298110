"""THC-PS under PyTorch Lightning: its DDPStrategy takes the state and the hook.

    dist.init_process_group("gloo")              # before the Trainer: Lightning then keeps it
    state = thc_ps.connect(ps="HOST:PORT")
    trainer = L.Trainer(strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=thc_ps.hook),
                        callbacks=[thc_ps.lightning.HookOnCPU(state)], ...)

Lightning's DDPStrategy registers a communication hook only when its device is CUDA (a
limit of DDP's hooks in PyTorch 1.8 that no longer holds); on CPU `HookOnCPU` registers it
once Lightning has wrapped the model.  Needs the `lightning` package (thc-ps[lightning]).
"""
import lightning.pytorch as pl

from thc_ps.torch import hook as ps_hook


class HookOnCPU(pl.Callback):
    """Registers THC-PS's hook on the model Lightning wrapped in DistributedDataParallel,
    where Lightning itself does not (any device but CUDA), before the first step."""

    def __init__(self, state, hook=ps_hook):
        self.state, self.hook = state, hook

    def on_fit_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        if getattr(strategy, "root_device", None) is not None and strategy.root_device.type == "cuda":
            return                                  # Lightning registered ddp_comm_hook itself
        model = strategy.model
        if not hasattr(model, "register_comm_hook"):
            raise ValueError(f"HookOnCPU needs a DDP strategy (the model is a {type(model).__name__}, "
                             f"not DistributedDataParallel)")
        model.register_comm_hook(self.state, self.hook)
