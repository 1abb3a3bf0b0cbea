"""LEAF FEMNIST loader (handwritten digits and letters, 62 classes, partitioned by writer).

Reads every json shard of ``<root>/femnist-leaf/{train,test}/``. Each shard holds ``users``,
``num_samples`` and ``user_data[user] = {"x": [[784 floats]], "y": [int]}``.

Pixel polarity: LEAF stores the NIST scans as they are, *dark ink on a white background*: background
pixels are 1.0 and strokes are near 0.0 (about 89% of the pixels are exactly 1.0). The loader keeps the
values as stored (already in [0, 1]; no inversion), reshaped row-major to ``(1, 28, 28)`` (upright).

Labels: 0-9 digits, 10-35 upper-case ``A-Z``, 36-61 lower-case ``a-z``. ``groups`` is the writer index,
numbered in the order writers are first seen across the shard files sorted by their shard number
(``all_data_0_...``, ``all_data_1_...``, ``all_data_2_...``, ..., ``all_data_10_...``), users within a
shard in the shard's ``users`` order.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import torch

from gradleak.data.base import ImageDataset
from gradleak.data.root import (
    FEMNIST_HOW_TO_GET,
    DataFileMissingError,
    check_limit,
    check_split,
    require_file,
    resolve_data_root,
)
from gradleak.registry import DATASETS

logger = logging.getLogger(__name__)

FEMNIST_DIR = "femnist-leaf"
NUM_CLASSES = 62
SPLITS = ("train", "test")


def _natural_key(path: Path) -> tuple[object, ...]:
    """Sort ``all_data_2_...`` before ``all_data_10_...``."""
    return tuple(int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", path.name))


def shard_files(root: Path, split: str) -> list[Path]:
    """The split's json shards in shard-number order."""
    folder = require_file(root, f"{FEMNIST_DIR}/{split}", FEMNIST_HOW_TO_GET)
    files = sorted(folder.glob("*.json"), key=_natural_key)
    if not files:
        raise DataFileMissingError(
            f"missing data files: no *.json shards in {str(folder)!r} (data root in use: {str(root)!r}). "
            f"To get them: {FEMNIST_HOW_TO_GET}"
        )
    return files


@functools.lru_cache(maxsize=4)
def _read_split(root: str, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[str, ...]]:
    """(x float32 (N, 784), y int64, writer index int64, writer ids), cached. Do not mutate."""
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    gs: list[np.ndarray] = []
    writers: dict[str, int] = {}
    for path in shard_files(Path(root), split):
        with path.open("r", encoding="utf-8") as fh:
            shard = json.load(fh)
        for user in shard["users"]:
            data = shard["user_data"][user]
            x = np.asarray(data["x"], dtype=np.float32).reshape(-1, 784)
            y = np.asarray(data["y"], dtype=np.int64).reshape(-1)
            if x.shape[0] != y.shape[0]:
                raise ValueError(f"femnist: {path} user {user}: {x.shape[0]} images but {y.shape[0]} labels")
            writer = writers.setdefault(user, len(writers))
            xs.append(x)
            ys.append(y)
            gs.append(np.full(y.shape[0], writer, dtype=np.int64))
    x_all, y_all, g_all = np.concatenate(xs), np.concatenate(ys), np.concatenate(gs)
    if x_all.size and (x_all.min() < 0.0 or x_all.max() > 1.0):
        raise ValueError(f"femnist/{split}: pixel values outside [0, 1]")
    if y_all.size and (y_all.min() < 0 or y_all.max() >= NUM_CLASSES):
        raise ValueError(f"femnist/{split}: labels outside [0, {NUM_CLASSES})")
    for arr in (x_all, y_all, g_all):
        arr.setflags(write=False)
    logger.debug("read femnist/%s: %d samples, %d writers under %s", split, len(y_all), len(writers), root)
    return x_all, y_all, g_all, tuple(writers)


def writer_ids(split: str = "train", root: str | os.PathLike[str] | None = None) -> tuple[str, ...]:
    """LEAF writer ids, position = the ``groups`` value the loader gives that writer."""
    check_split("femnist", split, SPLITS)
    return _read_split(str(resolve_data_root(root)), split)[3]


def load_femnist(
    split: str = "train", root: str | os.PathLike[str] | None = None, limit: int | None = None
) -> ImageDataset:
    """LEAF FEMNIST (5% non-IID sample): train 16 writers / 2328, test 184 writers / 4088; 1x28x28.

    Images are dark ink on white (see the module docstring). ``groups`` holds the writer index;
    ``limit`` keeps the first ``limit`` samples (whole writers first, in writer order).
    """
    check_split("femnist", split, SPLITS)
    check_limit(limit)
    x, y, g, _ = _read_split(str(resolve_data_root(root)), split)
    if limit is not None:
        x, y, g = x[:limit], y[:limit], g[:limit]
    images = torch.tensor(x.reshape(-1, 1, 28, 28), dtype=torch.float32)
    return ImageDataset(
        "femnist", images, torch.tensor(y, dtype=torch.int64), NUM_CLASSES, torch.tensor(g, dtype=torch.int64)
    )


DATASETS.register(
    "femnist",
    load_femnist,
    summary="LEAF FEMNIST by writer, 62 classes, 1x28x28, dark ink on white",
    modality="image",
)
