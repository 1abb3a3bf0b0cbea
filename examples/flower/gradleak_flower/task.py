"""What both apps share: the model, the nodes' data, the recipe, read from Flower's run config."""

from __future__ import annotations

import functools
from typing import Any

import torch

from gradleak.data import load_dataset, partition
from gradleak.data.base import ImageDataset
from gradleak.models import build_model
from gradleak.types import LocalTraining

SHAPE, CLASSES = (1, 28, 28), 11  # OrganAMNIST


def model() -> torch.nn.Module:
    """Paper 000's classifier; the server's initial weights come from seed 0."""
    return build_model("aegis_cnn", SHAPE, CLASSES, seed=0)


def training(run_config: dict[str, Any]) -> LocalTraining:
    return LocalTraining(
        "fedavg", epochs=int(run_config["local-epochs"]), batch_size=int(run_config["batch-size"]),
        lr=float(run_config["lr"]), optimizer="sgd",
    )  # fmt: skip


def component(run_config: dict[str, Any], key: str) -> tuple[str, dict[str, Any]]:
    """``(name, options)`` of the ``[tool.flwr.app.config]`` table ``key`` (Flower flattens it to
    ``key.name``, ``key.<option>``; override one with ``--run-config 'attack.max_iterations=3'``)."""
    prefix = f"{key}."
    values = {k[len(prefix) :]: v for k, v in run_config.items() if k.startswith(prefix)}
    if "name" not in values:
        raise ValueError(f'the run config has no {key}.name (e.g. {key}.name = "..." in pyproject.toml)')
    name = str(values.pop("name"))
    return name, values


@functools.lru_cache(maxsize=4)
def node_data(partition_id: int, num_partitions: int, limit: int, seed: int) -> ImageDataset:
    """Node ``partition_id``'s share of OrganAMNIST's first ``limit`` training images (label skew,
    at most 5 organs per node), the same on every node: each loads and partitions it, then keeps its own."""
    train = load_dataset("organamnist", "train", None, limit)
    parts = partition("label_skew", train, num_partitions, seed, max_classes_per_client=5)
    return train.subset(parts[partition_id])
