"""Shared fixtures: tiny synthetic datasets and models (fast), and the real data root."""

from __future__ import annotations

import pytest
import torch

from gradleak.data.base import ImageDataset

# One intra-op thread: the tests' tensors are tiny, and OpenMP workers spin-waiting beside another busy
# process made a 2-image Inverting-Gradients step up to 100x slower (1.2 s instead of 0.012 s) on 2 cores.
torch.set_num_threads(1)


def synthetic_dataset(
    n: int = 24, shape: tuple[int, int, int] = (1, 12, 12), classes: int = 3, seed: int = 0
):
    g = torch.Generator().manual_seed(seed)
    return ImageDataset(
        "synthetic",
        torch.rand((n, *shape), generator=g),
        torch.randint(0, classes, (n,), generator=g),
        classes,
    )


@pytest.fixture
def tiny_data() -> ImageDataset:
    return synthetic_dataset()
