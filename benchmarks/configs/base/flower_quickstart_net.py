"""A plugin: the Flower quickstart's model (examples/flower/gradleak_flower/task.py) as gradleak's
``flower_quickstart_net``, so that ``gradleak run`` audits the very model the quickstart's ServerApp audits
(benchmarks/serverapp_attack_speed.py; flower_quickstart_inprocess.toml names it)."""

from __future__ import annotations

import sys
from pathlib import Path

from torch import nn

from gradleak.registry import MODELS

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "flower"))
from gradleak_flower.task import Net  # noqa: E402


def quickstart_net(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    if tuple(input_shape) != (3, 32, 32) or num_classes != 10:
        raise ValueError(f"the quickstart's Net is for CIFAR-10 (3, 32, 32), 10 classes; got {input_shape}")
    return Net()


MODELS.register(
    "flower_quickstart_net", quickstart_net, summary="plugin: the Flower quickstart's CNN", modality="image"
)
