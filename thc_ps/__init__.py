"""THC-PS: a parameter server for Tensor Homomorphic Compression.

The library a training script imports (`import thc_ps`): `connect` joins this rank to a PS
job and `hook` is the DDP communication hook that sends gradient buckets through it
(thc_ps/torch.py; docs/api.md).  They are loaded on first use, so that importing the
package (as the PS and the `thc` command do) does not import torch.
"""
from __future__ import annotations

import os as _os

# The project's folders (worker, proto, ...) are thc_ps.worker, thc_ps.proto, ...: an installed
# wheel holds them inside this package; in a checkout they are the top-level folders beside it,
# so the checkout's root is on this package's path (`python -m thc_ps.deploy.cli` from the
# root, or any Python with PYTHONPATH=root, as Mininet's hosts run, needs no install).
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(_os.path.join(_root, "worker")):
    __path__.append(_root)

__all__ = ["connect", "hook", "State", "Refused", "default_job_name"]


def __getattr__(name: str):
    if name in __all__:
        from thc_ps import torch as api
        return getattr(api, name)
    raise AttributeError(f"module 'thc_ps' has no attribute {name!r}")
