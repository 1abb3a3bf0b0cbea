"""A gradleak plugin: a user's own data set and model, registered without editing gradleak.

``kidneys``: OrganAMNIST relabelled as "kidney (left or right) or not", the kind of derived task a
hospital builds from its own archive; ``tiny_mlp``: a two-layer perceptron. Use it with

    gradleak run --plugin examples/plugins/organ_kidney.py examples/plugins/kidney_audit.toml

(the config also names it in ``experiment.plugins``, so ``gradleak run --trust-config-plugins
examples/plugins/kidney_audit.toml`` works alone) and see its entries with ``gradleak list --plugin examples/plugins/organ_kidney.py``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from gradleak.data import ImageDataset, load_dataset
from gradleak.registry import DATASETS, MODELS

KIDNEYS = (4, 5)  # OrganAMNIST's kidney-left and kidney-right


def load_kidneys(
    split: str = "train", root: str | os.PathLike[str] | None = None, limit: int | None = None
) -> ImageDataset:
    """A DatasetLoader: OrganAMNIST's ``split``, label 1 for a kidney slice, 0 for any other organ."""
    organs = load_dataset("organamnist", split, root, limit)
    labels = torch.isin(organs.labels, torch.tensor(KIDNEYS)).long()
    return ImageDataset("kidneys", organs.images, labels, num_classes=2)


class TinyMLP(nn.Module):
    """A ModelFactory: ``TinyMLP(input_shape, num_classes, hidden=64)``."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, hidden: int = 64) -> None:
        super().__init__()
        c, h, w = input_shape
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(c * h * w, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


DATASETS.register(
    "kidneys", load_kidneys, summary="plugin: OrganAMNIST, kidney or not (2 classes)", modality="image"
)
MODELS.register("tiny_mlp", TinyMLP, summary="plugin: a two-layer perceptron", modality="image")
