"""Offline datasets and federated partitions.

Importing this package registers the loaders (``organamnist``, ``pneumoniamnist``, ``pathmnist``,
``cifar10``, ``femnist``) in :data:`gradleak.registry.DATASETS`; :func:`load_dataset` loads one by name.
"""

from __future__ import annotations

import os

from gradleak.data import cifar, femnist, medmnist  # noqa: F401  (registers the loaders)
from gradleak.data.base import ImageDataset
from gradleak.data.partition import (
    PARTITIONERS,
    as_rng,
    dirichlet,
    iid,
    label_skew,
    natural,
    partition,
    partition_options,
)
from gradleak.data.root import DataFileMissingError, require_file, resolve_data_root
from gradleak.registry import DATASETS

__all__ = [
    "PARTITIONERS",
    "DataFileMissingError",
    "ImageDataset",
    "as_rng",
    "dirichlet",
    "iid",
    "label_skew",
    "load_dataset",
    "natural",
    "partition",
    "partition_options",
    "require_file",
    "resolve_data_root",
]


def load_dataset(
    name: str, split: str | None = None, root: str | os.PathLike[str] | None = None, limit: int | None = None
) -> ImageDataset:
    """Load dataset ``name`` (see ``DATASETS.names()``); unknown names raise the registry's error.

    ``split=None`` uses the loader's default: ``"train"`` where a train split exists, ``"test"`` for
    ``pathmnist`` and ``cifar10``, whose test data is all that is available offline.
    """
    loader = DATASETS.get(name)
    kwargs: dict[str, object] = {"root": root, "limit": limit}
    if split is not None:
        kwargs["split"] = split
    dataset: ImageDataset = loader(**kwargs)
    return dataset
