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


# Tests that start a Ray cluster or a Flower SuperLink share one pytest-xdist worker (``make test`` runs
# ``--dist loadgroup``): two local Ray clusters at once on 2 cores made both miss their round timeouts.
# Flower tests that drive a strategy over in-process ClientApps (tests/flowergrid.py) start neither and run
# on either worker.
_ONE_AT_A_TIME = ("run_simulation", "FlowerRunner", "run_app", "flwr run")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    sources: dict[str, bool] = {}
    for item in items:
        path = str(item.path)
        if path not in sources:
            text = item.path.read_text(encoding="utf-8") if item.path.suffix == ".py" else ""
            sources[path] = any(marker in text for marker in _ONE_AT_A_TIME)
        if sources[path]:
            item.add_marker(pytest.mark.xdist_group("ray"))
