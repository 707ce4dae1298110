"""THC-PS: a parameter server for Tensor Homomorphic Compression.

The library a training script imports (`import thc_ps`): `connect` joins this rank to a PS
job and `hook` is the DDP communication hook that sends gradient buckets through it
(thc_ps/torch.py; docs/api.md).  They are loaded on first use, so that importing the
package (as the PS and the `thc` command do) does not import torch.
"""
from __future__ import annotations

__all__ = ["connect", "hook", "State", "Refused", "default_job_name"]


def __getattr__(name: str):
    if name in __all__:
        from thc_ps import torch as api
        return getattr(api, name)
    raise AttributeError(f"module 'thc_ps' has no attribute {name!r}")
