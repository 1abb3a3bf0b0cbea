"""Gradient pruning (Zhu et al. 2019, DLG Sec. 5): zero the smallest-magnitude entries of the update.

Per parameter tensor, entries whose magnitude is below the ``ratio`` quantile are set to zero before
upload; ``ratio = 0.9`` keeps the largest 10 % of each tensor. Exactly ``floor(ratio * n)`` entries are
zeroed: the ``k``-th smallest magnitude is found by selection (``kthvalue``, not a full sort) and ties at that
magnitude are broken by position.
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


def smallest(values: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of exactly ``k`` (>= 1) entries of the 1-D ``values`` with the smallest values."""
    kth = values.kthvalue(k).values
    mask = values < kth
    missing = k - int(mask.sum())
    if missing > 0:  # ties at the k-th value: take the first ones
        mask[torch.nonzero(values == kth).flatten()[:missing]] = True
    return mask


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
            out[name] = t.reshape(-1).masked_fill(smallest(t.reshape(-1).abs(), k), 0.0).reshape(t.shape)
        return update.replace(out)


DEFENSES.register("pruning", Pruning, config_cls=PruningConfig, summary="zero the smallest update entries")
