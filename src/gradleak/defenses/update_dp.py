"""Update-level clipping and Gaussian noise: the outgoing update, not each step's gradient.

The client clips its whole update (all tensors jointly) to L2 norm ``clip`` and adds N(0, (sigma * clip)^2)
to every entry: ``u' = u * min(1, C / ||u||_2) + N(0, sigma^2 C^2 I)`` (the local-DP Gaussian mechanism on
the update, as in DP-FedAvg, McMahan et al. 2018, Alg. 1 with the noise added on the client). It acts only on
the outgoing update, so it also runs as a Flower mod (:mod:`gradleak.integrations.flower`). No privacy
accounting here: a formal epsilon needs the accountant of DP-SGD (Opacus), which works per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from gradleak.defenses.base import Defense
from gradleak.registry import DEFENSES
from gradleak.types import Update


@dataclass(frozen=True)
class UpdateNoiseConfig:
    clip: float = 1.0  # C: the L2 bound of the whole update
    sigma: float = 1.0  # noise multiplier: each entry gets N(0, (sigma * C)^2)

    def __post_init__(self) -> None:
        if not (0 < self.clip < math.inf and 0 <= self.sigma < math.inf):
            raise ValueError(
                f"need finite clip > 0 and finite sigma >= 0; got clip={self.clip}, sigma={self.sigma}"
            )


class UpdateNoise(Defense):
    name = "update_noise"

    def __init__(self, config: UpdateNoiseConfig) -> None:
        self.config = config
        self._generator: torch.Generator | None = None

    def setup(self, model: nn.Module, *, generator: torch.Generator) -> None:
        self._generator = generator

    def on_update(self, update: Update) -> Update:
        if self._generator is None:
            raise RuntimeError(
                "update_noise needs setup() first (it draws its noise from the client's generator)"
            )
        c, sigma = self.config.clip, self.config.sigma
        norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in update.tensors.values()))
        scale = min(1.0, c / norm) if norm > 0 else 1.0
        out = {}
        for name, t in update.tensors.items():
            noise = torch.randn(t.shape, generator=self._generator, dtype=torch.float64,
                                device=self._generator.device) * (sigma * c)  # fmt: skip
            out[name] = (t.double() * scale + noise.to(t.device)).to(t.dtype)
        return update.replace(out)


DEFENSES.register(
    "update_noise",
    UpdateNoise,
    config_cls=UpdateNoiseConfig,
    summary="clip the whole update to L2 norm C, add N(0, (sigma C)^2) per entry (local DP on the update)",
)
