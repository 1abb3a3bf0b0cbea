"""Gradient pruning (Zhu et al. 2019, DLG Sec. 5): zero the smallest-magnitude entries of the update.

Per parameter tensor, entries whose magnitude is below the ``ratio`` quantile are set to zero before
upload; ``ratio = 0.9`` keeps the largest 10 % of each tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradleak.defenses.base import Defense
from gradleak.registry import DEFENSES
from gradleak.types import Update


@dataclass(frozen=True)
class PruningConfig:
    ratio: float = 0.9  # fraction of entries zeroed per tensor

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio < 1.0:
            raise ValueError(f"pruning ratio must be in [0, 1), got {self.ratio}")


class Pruning(Defense):
    name = "pruning"

    def __init__(self, config: PruningConfig) -> None:
        self.config = config

    def on_update(self, update: Update) -> Update:
        out: dict[str, torch.Tensor] = {}
        for name, t in update.tensors.items():
            k = int(self.config.ratio * t.numel())  # entries to zero
            if k == 0:
                out[name] = t.clone()
                continue
            flat = t.reshape(-1)
            drop = flat.abs().argsort()[:k]
            pruned = flat.clone()
            pruned[drop] = 0.0
            out[name] = pruned.reshape(t.shape)
        return update.replace(out)


DEFENSES.register("pruning", Pruning, config_cls=PruningConfig, summary="zero the smallest update entries")
