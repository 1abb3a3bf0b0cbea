"""SME: Surrogate Model Extension (Zhu, Yao & Blaschko, ICML 2023), as summarised in paper 001, Sec. 2.2.

The surrogate weights lie on the segment between the observed endpoints, ``w_alpha = alpha w_0 +
(1 - alpha) w_T`` with a learnable alpha in [0, 1] (projected after each step), and the dummy batch X is
fitted so that ``grad_w l(f_{w_alpha}(X), Y)`` aligns with ``Delta w = w_0 - w_T`` under the cosine loss of
Eq. 3, plus TV (Eq. 9). No calibration: the calibrated and honest losses coincide. Shared machinery:
:mod:`gradleak.attacks.image.surrogate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradleak.attacks.image.surrogate import (
    SURROGATE_NEEDS,
    SurrogateConfig,
    SurrogateSettings,
    run_surrogate,
)
from gradleak.device import DEVICE_TYPES
from gradleak.registry import ATTACKS
from gradleak.types import Observation, Reconstruction


@dataclass(frozen=True)
class SMEConfig(SurrogateConfig):
    """SME's defaults are the official SME code's settings (its experiments/configs/cifar_sme.json and
    adversary: Adam lr 1e-3 for alpha, and the shared optimiser settings of :class:`SurrogateConfig`);
    chosen on held-out updates of the official victim (benchmarks/configs/sme_tuning.toml, seed 1, k 50,
    T 100: docs/attacks-multistep.md). Paper 001's own SME runs (the paper001_* benchmarks) pin the earlier
    settings: ``lr_decay = false, box = false, lr_path = 1e-2, tv_weight = 1e-2``."""

    lr_path: float = 1e-3  # Adam lr of alpha
    init_alpha: float = 0.5  # the official code's alpha (cifar_sme.json)


class SME:
    """Straight-line surrogate with a learnable position alpha."""

    needs = SURROGATE_NEEDS

    def __init__(self, config: SMEConfig | None = None) -> None:
        self.config = config or SMEConfig()

    def settings(self) -> SurrogateSettings:
        c = self.config
        return SurrogateSettings(
            path="line",
            nodes=1,
            iterations=c.max_iterations,
            lr_x=c.lr,
            lr_path=c.lr_path,
            lr_t=1.0,
            lr_d=1.0,
            tv_weight=c.tv_weight,
            p_weight=0.0,
            d_weight=0.0,
            calibrate=False,
            init_alpha=c.init_alpha,
            lr_decay=c.lr_decay,
            box=c.box,
            progress=c.progress,
            desc="SME",
        )

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        return run_surrogate(
            obs, self.settings(), generator=generator, attack="sme", num_samples=self.config.num_samples
        )


ATTACKS.register(
    "sme",
    SME,
    config_cls=SMEConfig,
    summary="SME: line surrogate between w0 and wT (Zhu 2023); FedAvg deltas",
    modality="image",
    devices=DEVICE_TYPES,
)
