"""MedMNIST v2 loaders: OrganAMNIST, PneumoniaMNIST, the offline PathMNIST test subset, and ``medmnist``:
any official archive by its flag (``data.dataset = "medmnist"``, ``data.options = {flag = "bloodmnist"}``
reads ``<root>/medmnist/bloodmnist.npz``; ``bloodmnist_64`` the 64x64 one).

Files are the official MedMNIST ``.npz`` archives under ``<root>/medmnist/``: ``{split}_images`` uint8
``(N, 28, 28)`` (grayscale) or ``(N, 28, 28, 3)`` (RGB) and ``{split}_labels`` ``(N, 1)``. Loaders return
float32 images in [0, 1] as ``(N, C, 28, 28)`` and int64 labels ``(N,)``.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import numpy as np
import torch

from gradleak.data.base import ImageDataset
from gradleak.data.root import MEDMNIST_HOW_TO_GET, check_limit, check_split, require_file, resolve_data_root
from gradleak.registry import DATASETS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MedMNISTSpec:
    """One MedMNIST flavour as stored offline."""

    name: str
    relpath: str
    splits: tuple[str, ...]
    num_classes: int
    channels: int
    split_note: str = ""


SPECS: dict[str, MedMNISTSpec] = {
    "organamnist": MedMNISTSpec("organamnist", "medmnist/organamnist.npz", ("train", "val", "test"), 11, 1),
    "pneumoniamnist": MedMNISTSpec(
        "pneumoniamnist", "medmnist/pneumoniamnist.npz", ("train", "val", "test"), 2, 1
    ),
    "pathmnist": MedMNISTSpec(
        "pathmnist",
        "medmnist/pathmnist_test_subset.npz",
        ("test",),
        9,
        3,
        split_note="only a 718-image subset of the PathMNIST test split is available offline",
    ),
}


def to_chw_float(images: np.ndarray) -> torch.Tensor:
    """uint8 ``(N, H, W)`` or ``(N, H, W, C)`` -> float32 ``(N, C, H, W)`` in [0, 1]."""
    if images.dtype != np.uint8:
        raise ValueError(f"expected uint8 images, got {images.dtype}")
    if images.ndim == 3:
        images = images[:, None, :, :]
    elif images.ndim == 4:
        images = images.transpose(0, 3, 1, 2)
    else:
        raise ValueError(f"expected (N, H, W) or (N, H, W, C) images, got shape {images.shape}")
    contiguous = np.ascontiguousarray(images)
    if not contiguous.flags.writeable:  # torch.from_numpy warns on read-only arrays
        contiguous = contiguous.copy()
    return torch.from_numpy(contiguous).to(torch.float32).div_(255.0)


def load_medmnist(
    spec: MedMNISTSpec,
    split: str = "train",
    root: str | os.PathLike[str] | None = None,
    limit: int | None = None,
) -> ImageDataset:
    """Load ``split`` of a MedMNIST flavour; ``limit`` keeps the first ``limit`` samples."""
    check_split(spec.name, split, spec.splits, spec.split_note)
    check_limit(limit)
    path = require_file(resolve_data_root(root), spec.relpath, MEDMNIST_HOW_TO_GET)
    with np.load(path, mmap_mode=None) as npz:
        images = npz[f"{split}_images"]
        labels = npz[f"{split}_labels"]
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    if labels.shape[0] != images.shape[0]:
        raise ValueError(f"{spec.name}/{split}: {images.shape[0]} images but {labels.shape[0]} labels")
    if labels.size and (labels.min() < 0 or labels.max() >= spec.num_classes):
        raise ValueError(f"{spec.name}/{split}: labels outside [0, {spec.num_classes}) in {path}")
    tensor = to_chw_float(images)
    if tensor.shape[1] != spec.channels:
        raise ValueError(f"{spec.name}/{split}: expected {spec.channels} channels, got {tensor.shape[1]}")
    logger.debug("loaded %s/%s: %d samples from %s", spec.name, split, len(labels), path)
    return ImageDataset(spec.name, tensor, torch.from_numpy(labels), spec.num_classes)


FLAG = re.compile(r"^[a-z]+mnist(_(64|128|224))?$")


@dataclass(frozen=True)
class MedMNISTFile:
    """An official MedMNIST v2 archive by ``flag`` (its file name without ``.npz``: ``bloodmnist``,
    ``dermamnist_64``, ...). Channels and splits are read from the file; ``num_classes`` defaults to the
    largest label in any split plus one (give it when a class may be missing from the file)."""

    flag: str = ""
    num_classes: int | None = None

    def __post_init__(self) -> None:
        if not FLAG.match(self.flag):
            raise ValueError(
                f"flag must name an official MedMNIST 2D archive such as 'bloodmnist' or 'dermamnist_64' "
                f"(the file medmnist/<flag>.npz), got {self.flag!r}"
            )
        if self.num_classes is not None and self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")


def file_spec(config: MedMNISTFile, root: str | os.PathLike[str] | None) -> MedMNISTSpec:
    """The spec of an official archive, read from the file (splits, channels, classes)."""
    relpath = f"medmnist/{config.flag}.npz"
    path = require_file(resolve_data_root(root), relpath, MEDMNIST_HOW_TO_GET)
    with np.load(path) as npz:
        splits = tuple(s for s in ("train", "val", "test") if f"{s}_images" in npz.files)
        if not splits:
            raise ValueError(f"{path} holds no train/val/test_images arrays: not a MedMNIST archive")
        labels = [np.asarray(npz[f"{s}_labels"]) for s in splits]
        shape = npz[f"{splits[0]}_images"].shape
    if any(lab.ndim == 2 and lab.shape[1] > 1 for lab in labels):
        raise ValueError(f"{config.flag}: multi-label archives (ChestMNIST) are not supported")
    if len(shape) not in (3, 4):
        raise ValueError(f"{config.flag}: images of shape {shape} are not 2D (MedMNIST 3D is not supported)")
    classes = config.num_classes or int(max(int(lab.max()) for lab in labels if lab.size) + 1)
    return MedMNISTSpec(config.flag, relpath, splits, classes, 1 if len(shape) == 3 else int(shape[-1]))


def load_medmnist_file(
    split: str = "train",
    root: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    *,
    config: MedMNISTFile,
) -> ImageDataset:
    """``split`` of the official MedMNIST archive ``config.flag`` (see :class:`MedMNISTFile`)."""
    return load_medmnist(file_spec(config, root), split, root, limit)


def load_organamnist(
    split: str = "train", root: str | os.PathLike[str] | None = None, limit: int | None = None
) -> ImageDataset:
    """OrganAMNIST (abdominal CT): train 34561 / val 6491 / test 17778, 11 classes, 1x28x28."""
    return load_medmnist(SPECS["organamnist"], split, root, limit)


def load_pneumoniamnist(
    split: str = "train", root: str | os.PathLike[str] | None = None, limit: int | None = None
) -> ImageDataset:
    """PneumoniaMNIST (chest X-ray): train 3882 (of 4708) / val 524 / test 624, 2 classes, 1x28x28."""
    return load_medmnist(SPECS["pneumoniamnist"], split, root, limit)


def load_pathmnist(
    split: str = "test", root: str | os.PathLike[str] | None = None, limit: int | None = None
) -> ImageDataset:
    """PathMNIST (colon pathology): only a 718-image test subset offline, 9 classes, 3x28x28.

    ``split`` defaults to ``"test"``, the only split available offline; any other split is a ValueError.
    """
    return load_medmnist(SPECS["pathmnist"], split, root, limit)


DATASETS.register(
    "organamnist",
    load_organamnist,
    summary="OrganAMNIST abdominal CT, 11 classes, 1x28x28 (train/val/test)",
    modality="image",
)
DATASETS.register(
    "pneumoniamnist",
    load_pneumoniamnist,
    summary="PneumoniaMNIST chest X-ray, 2 classes, 1x28x28 (train/val/test)",
    modality="image",
)
DATASETS.register(
    "medmnist",
    load_medmnist_file,
    config_cls=MedMNISTFile,
    summary="any official MedMNIST v2 2D archive by flag: data.options = {flag = 'bloodmnist'}",
    modality="image",
)
DATASETS.register(
    "pathmnist",
    load_pathmnist,
    summary="PathMNIST colon pathology, 9 classes, 3x28x28 (718-image test subset)",
    modality="image",
)
