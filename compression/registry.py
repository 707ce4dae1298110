"""Codec registry: `--codec NAME` everywhere resolves here.

Entries are import paths, so a codec module is imported only when used.  The names are the
job contract's (proto/job.py CODECS): a job may name exactly the codecs listed here.
"""
from __future__ import annotations

import importlib

_REGISTRY = {
    "thc": "thc_ps.compression.codecs_builtin:ThcCodec",
    "uhc": "thc_ps.compression.codecs_builtin:UhcCodec",
    "topk": "thc_ps.compression.codecs_builtin:TopKCodec",
    "terngrad": "thc_ps.compression.codecs_builtin:TernGradCodec",
    "none": "thc_ps.compression.codecs_builtin:NoneCodec",
    "3lc": "thc_ps.compression.threelc:ThreeLCCodec",
    "skcompress": "thc_ps.compression.skcompress:SKCompressCodec",
    "fastsgd": "thc_ps.compression.fastsgd:FastSGDCodec",
    "casq": "thc_ps.compression.casq:CASQCodec",
}


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str, **params):
    """Instantiate codec `name` with keyword parameters (unknown names raise ValueError)."""
    try:
        path = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; choose from {', '.join(_REGISTRY)}") from None
    module, cls = path.split(":")
    try:
        factory = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"codec {name!r} is not available in this build ({exc})") from None
    return factory(**params)
