"""Process hygiene for local clusters on a small machine."""
from __future__ import annotations

import os

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def single_threaded_children() -> None:
    """Make spawned workers use one BLAS/OpenMP thread each.

    N workers on 2 cores with a multi-threaded BLAS each oversubscribe the CPU and the
    spinning BLAS threads slow every round by an order of magnitude.  Set before
    spawning; an explicit user setting wins.
    """
    for var in _THREAD_VARS:
        os.environ.setdefault(var, "1")
