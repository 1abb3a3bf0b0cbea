"""CIFAR-10 test set loader (the only CIFAR-10 split available offline).

Reads ``<root>/cifar10-test-jpeg/<class>/NNNN.jpg`` (32x32 RGB JPEG, lossy re-encoding of the original
test set) with Pillow. The class index is the position of the folder name in :data:`CIFAR10_CLASSES`;
samples are ordered by class, then by file name. The full decode (about 2 s for 10,000 files) is cached
in memory per data root; a ``limit`` decodes only a class-balanced selection of files.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from gradleak.data.base import ImageDataset
from gradleak.data.medmnist import to_chw_float
from gradleak.data.root import CIFAR10_HOW_TO_GET, check_limit, check_split, require_file, resolve_data_root
from gradleak.registry import DATASETS

logger = logging.getLogger(__name__)

CIFAR10_CLASSES: tuple[str, ...] = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
CIFAR10_DIR = "cifar10-test-jpeg"
_SUFFIXES = (".jpg", ".jpeg")


def _class_files(root: Path) -> list[list[Path]]:
    """Sorted JPEG files of each class folder, in :data:`CIFAR10_CLASSES` order."""
    base = require_file(root, CIFAR10_DIR, CIFAR10_HOW_TO_GET)
    per_class: list[list[Path]] = []
    for name in CIFAR10_CLASSES:
        folder = require_file(root, f"{CIFAR10_DIR}/{name}", CIFAR10_HOW_TO_GET)
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in _SUFFIXES)
        if not files:
            raise ValueError(f"cifar10: no JPEG files in {folder} (under {base})")
        per_class.append(files)
    return per_class


def _decode(files: list[Path]) -> np.ndarray:
    out = np.empty((len(files), 32, 32, 3), dtype=np.uint8)
    for i, path in enumerate(files):
        with Image.open(path) as img:
            arr = np.asarray(img.convert("RGB"))
        if arr.shape != (32, 32, 3):
            raise ValueError(f"cifar10: {path} is {arr.shape[1]}x{arr.shape[0]}, expected 32x32")
        out[i] = arr
    return out


def balanced_counts(limit: int, available: list[int]) -> list[int]:
    """``limit // K`` files per class, the remainder from the first classes, capped by what exists."""
    per, rem = divmod(limit, len(available))
    return [min(n, per + (1 if c < rem else 0)) for c, n in enumerate(available)]


@functools.lru_cache(maxsize=2)
def _decode_all(root: str) -> tuple[np.ndarray, np.ndarray]:
    """Full decode (uint8 ``(N, 32, 32, 3)``, int64 labels), cached per resolved root. Do not mutate."""
    per_class = _class_files(Path(root))
    files = [p for group in per_class for p in group]
    labels = np.concatenate([np.full(len(g), c, dtype=np.int64) for c, g in enumerate(per_class)])
    images = _decode(files)
    images.setflags(write=False)
    labels.setflags(write=False)
    logger.debug("decoded %d CIFAR-10 JPEGs under %s", len(files), root)
    return images, labels


def load_cifar10(
    split: str = "test", root: str | os.PathLike[str] | None = None, limit: int | None = None
) -> ImageDataset:
    """CIFAR-10 test set: 10,000 images, 1000 per class, 3x32x32, 10 classes.

    ``split`` must be ``"test"`` (the default). With ``limit``, the first ``limit // 10`` files of each
    class (plus one more for the first ``limit % 10`` classes) are taken, so small subsets hold every class.
    """
    check_split("cifar10", split, ("test",), "only the CIFAR-10 test set is available offline")
    check_limit(limit)
    data_root = resolve_data_root(root)
    if limit is None:
        images, labels = _decode_all(str(data_root))
    else:
        per_class = _class_files(data_root)
        counts = balanced_counts(limit, [len(g) for g in per_class])
        files = [p for group, k in zip(per_class, counts, strict=True) for p in group[:k]]
        labels = np.concatenate([np.full(k, c, dtype=np.int64) for c, k in enumerate(counts)])
        images = _decode(files)
    return ImageDataset(
        "cifar10", to_chw_float(images), torch.from_numpy(labels.copy()), len(CIFAR10_CLASSES)
    )


DATASETS.register(
    "cifar10",
    load_cifar10,
    summary="CIFAR-10 test set (10,000 JPEGs), 10 classes, 3x32x32 (split 'test')",
    modality="image",
)
