"""A tiny seeded image dataset for tests that build their own (imported as ``synthetic``: a name no other
test module or conftest has, so it resolves the same whichever test directories a run collects)."""

from __future__ import annotations

import torch

from gradleak.data.base import ImageDataset


def synthetic_dataset(
    n: int = 24, shape: tuple[int, int, int] = (1, 12, 12), classes: int = 3, seed: int = 0
) -> ImageDataset:
    g = torch.Generator().manual_seed(seed)
    return ImageDataset(
        "synthetic",
        torch.rand((n, *shape), generator=g),
        torch.randint(0, classes, (n,), generator=g),
        classes,
    )
