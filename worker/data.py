"""Fashion-MNIST from Debian's `dataset-fashion-mnist` package (idx files, gzip).

Nothing is downloaded: the files come from the installed package, or a
directory the user names with $THC_FASHION_MNIST.
"""
from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np

DEFAULT_DIR = Path("/usr/share/datasets/fashion-mnist")
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
INSTALL_HINT = ("Fashion-MNIST not found: install Debian's package (as root: apt-get install -y "
                "dataset-fashion-mnist) or set THC_FASHION_MNIST to a directory holding "
                "the four *-idx*-ubyte.gz files")


class DatasetMissing(FileNotFoundError):
    pass


def data_dir() -> Path:
    return Path(os.environ.get("THC_FASHION_MNIST", DEFAULT_DIR))


def read_idx(path: Path) -> np.ndarray:
    """Parse an idx file (optionally gzip-compressed): big-endian dims, then uint8 data."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte idx file")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims}, file holds {data.size} values")
    return data.reshape(dims)


def load(split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images float32 in [0, 1] of shape (N, 1, 28, 28), labels int64)."""
    d = data_dir()
    img_name, lab_name = FILES[split]
    if not (d / img_name).exists() or not (d / lab_name).exists():
        raise DatasetMissing(INSTALL_HINT)
    x = read_idx(d / img_name).astype(np.float32)[:, None] / 255.0
    y = read_idx(d / lab_name).astype(np.int64)
    if len(x) != len(y):
        raise ValueError(f"{split}: {len(x)} images but {len(y)} labels")
    return x, y


def shard(n_items: int, rank: int, world: int, seed: int, epoch: int) -> np.ndarray:
    """This rank's indices of a per-epoch permutation shared by all ranks."""
    perm = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(n_items)
    return perm[rank::world]
