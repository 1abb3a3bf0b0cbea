"""Shared fixtures: tiny synthetic datasets and models (fast), and the real data root."""

from __future__ import annotations

import pytest
import torch

from gradleak.data.base import ImageDataset
from synthetic import synthetic_dataset

# One intra-op thread: the tests' tensors are tiny, and OpenMP workers spin-waiting beside another busy
# process made a 2-image Inverting-Gradients step up to 100x slower (1.2 s instead of 0.012 s) on 2 cores.
torch.set_num_threads(1)


@pytest.fixture
def tiny_data() -> ImageDataset:
    return synthetic_dataset()
