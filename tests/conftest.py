"""Shared fixtures: tiny synthetic datasets and models (fast), and the real data root."""

from __future__ import annotations

import pytest
import torch

from gradleak.data.base import ImageDataset


def synthetic_dataset(n: int = 24, shape: tuple[int, int, int] = (1, 12, 12), classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return ImageDataset(
        "synthetic", torch.rand((n, *shape), generator=g), torch.randint(0, classes, (n,), generator=g), classes
    )


@pytest.fixture
def tiny_data() -> ImageDataset:
    return synthetic_dataset()
