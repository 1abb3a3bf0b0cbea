"""Outpost (Wang, Hugh and Li, "More than Enough is Too Much: Adaptive Defenses against Gradient Leakage in
Production Federated Learning", IEEE INFOCOM 2023): risk-scaled Gaussian noise on the most informative
coordinates of the gradient, at local steps whose probability decays.

At local step ``t`` (0-based) the client perturbs the step's gradient with probability
``1 / (1 + beta t)`` (iteration-based decay: the early steps, whose gradients inversion attacks read best,
are perturbed most often). When it does, for every parameter tensor ``l``:

- risk ``r_l = min(Var(W_l), 1)``: the spread of the layer's current weights (the paper's privacy-leakage
  risk: a narrow weight distribution, as at initialisation, is what makes inversion easy);
- pruning: entries of ``g_l`` below the ``prune`` percentile of ``|g_l|`` are set to zero;
- noise ``N(0, (r_l * noise)^2)`` on the coordinates whose empirical Fisher information ``g^2`` is in the
  top ``phi`` % over the whole model (one threshold across layers).

Defaults (``beta`` 0.125, ``phi`` 40, ``prune`` 80, ``noise`` 0.8) are those of the authors' own
implementation in the Plato framework (its gradient-leakage example's README). **Deviation**: that code
averages ``g^2`` over each tensor's first axis before thresholding (one Fisher value per input column);
here every coordinate has its own, the empirical Fisher of the step's gradient that the paper describes.
The draws come from the client's generator (OS-seeded in deployment).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from gradleak.defenses.base import Defense, SetupContext
from gradleak.device import normal
from gradleak.registry import DEFENSES


@dataclass(frozen=True)
class OutpostConfig:
    """``beta``: the decay of the perturbation probability ``1 / (1 + beta t)``; ``phi``: the % of
    coordinates (by empirical Fisher information, over the model) that get noise; ``prune``: the percentile
    of each tensor's ``|g|`` below which entries are zeroed; ``noise``: the noise scale, times each layer's
    risk."""

    beta: float = 0.125
    phi: float = 40.0
    prune: float = 80.0
    noise: float = 0.8

    def __post_init__(self) -> None:
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise ValueError(f"beta must be a finite number >= 0, got {self.beta!r}")
        if not 0 < self.phi <= 100:
            raise ValueError(f"phi must be a percentage in (0, 100], got {self.phi!r}")
        if not 0 <= self.prune < 100:
            raise ValueError(f"prune must be a percentile in [0, 100), got {self.prune!r}")
        if not (math.isfinite(self.noise) and self.noise >= 0):
            raise ValueError(f"noise must be a finite number >= 0, got {self.noise!r}")


def kth_smallest(values: torch.Tensor, fraction: float) -> torch.Tensor:
    """The ``fraction`` (0..1) percentile of ``values`` with lower interpolation (numpy's
    ``method="lower"``: the sorted value at index ``floor(fraction * (n - 1))``), for any size."""
    flat = values.reshape(-1)
    return flat.kthvalue(math.floor(fraction * (len(flat) - 1)) + 1).values


class Outpost(Defense):
    name = "outpost"

    def __init__(self, config: OutpostConfig | None = None) -> None:
        self.config = config or OutpostConfig()
        self.generator: torch.Generator | None = None
        self.perturbed = 0  # steps perturbed in this local training run

    def setup(self, model: nn.Module, context: SetupContext) -> None:
        generator = context.generator
        self.generator = generator
        self.perturbed = 0

    def probability(self, step: int) -> float:
        """The chance that local step ``step`` (0-based) is perturbed."""
        return 1.0 / (1.0 + self.config.beta * step)

    @torch.no_grad()
    def on_gradients(self, model: nn.Module, step: int) -> None:
        if self.generator is None:
            raise RuntimeError("outpost needs setup() before on_gradients()")
        if float(torch.rand((), generator=self.generator)) >= self.probability(step):
            return
        self.perturbed += 1
        cfg = self.config
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return
        fisher = torch.cat([p.grad.reshape(-1).pow(2) for p in params])  # type: ignore[union-attr]
        threshold = kth_smallest(fisher, 1 - cfg.phi / 100)
        for p in params:
            g = p.grad
            assert g is not None
            risk = min(float(p.detach().var()) if p.numel() > 1 else 0.0, 1.0)
            informative = g.pow(2) >= threshold  # the mask is read before pruning changes g
            if cfg.prune > 0:
                g.masked_fill_(g.abs() < kth_smallest(g.abs(), cfg.prune / 100), 0.0)
            noise = normal(g.shape, self.generator, g) * (risk * cfg.noise)
            g.add_(torch.where(informative, noise, torch.zeros_like(noise)))


DEFENSES.register(
    "outpost",
    Outpost,
    config_cls=OutpostConfig,
    summary="Outpost: risk-scaled noise on high-Fisher coordinates, iteration-decayed (Wang et al. 2023)",
)

__all__ = ["Outpost", "OutpostConfig", "kth_smallest"]
