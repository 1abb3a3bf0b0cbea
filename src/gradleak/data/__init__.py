"""Offline datasets and federated partitions.

Importing this package registers the loaders (``organamnist``, ``pneumoniamnist``, ``pathmnist``,
``medmnist`` (any official MedMNIST archive by flag), ``cifar10``, ``femnist``, ``shifted`` (another
registered image set with shifted intensities), and the text data sets
``rotten_tomatoes``, ``wikitext2``, ``financial_phrasebank``, ``emotion``) in
:data:`gradleak.registry.DATASETS`; :func:`load_dataset` loads one by name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from gradleak.data import cifar, femnist, medmnist, shifted, text  # noqa: F401  (registers the loaders)
from gradleak.data.base import ImageDataset
from gradleak.data.partition import (
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
    name: str,
    split: str | None = None,
    root: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    options: Mapping[str, Any] | None = None,
) -> Any:
    """Load dataset ``name`` (see ``DATASETS.names()``): an ``ImageDataset``, or a text data set's raw
    ``TextDataset``; unknown names raise the registry's error.

    ``split=None`` uses the loader's default: ``"train"`` where a train split exists, ``"test"`` for
    ``pathmnist`` and ``cifar10``, whose test data is all that is available offline. ``options`` (the
    config's ``data.options``) build the loader's config dataclass, if it has one (``medmnist``: ``flag``).
    """
    loader = DATASETS.get(name)
    kwargs: dict[str, object] = {"root": root, "limit": limit}
    if split is not None:
        kwargs["split"] = split
    config = DATASETS.make_config(name, options)
    if config is not None:
        kwargs["config"] = config
    return loader(**kwargs)
