"""SME: Surrogate Model Extension (Zhu, Yao & Blaschko, ICML 2023), as summarised in paper 001, Sec. 2.2.

The surrogate weights lie on the segment between the observed endpoints, ``w_alpha = alpha w_0 +
(1 - alpha) w_T`` with a learnable alpha in [0, 1] (projected after each step), and the dummy batch X is
fitted so that ``grad_w l(f_{w_alpha}(X), Y)`` aligns with ``Delta w = w_0 - w_T`` under the cosine loss of
Eq. 3, plus TV (Eq. 9). No calibration: the calibrated and honest losses coincide. Shared machinery:
:mod:`gradleak.attacks.image.surrogate`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradleak.attacks.image.surrogate import SurrogateAttack, SurrogateConfig
from gradleak.device import DEVICE_TYPES
from gradleak.registry import ATTACKS


@dataclass(frozen=True)
class SMEConfig(SurrogateConfig):
    """SME's defaults are the official SME code's settings (its experiments/configs/cifar_sme.json and
    adversary: Adam lr 1e-3 for alpha, and the shared optimiser settings of :class:`SurrogateConfig`);
    chosen on held-out updates of the official victim (benchmarks/configs/sme_tuning.toml, seed 1, k 50,
    T 100: docs/attacks-multistep.md). Paper 001's own SME runs (the paper001_* benchmarks) pin the earlier
    settings: ``lr_decay = false, box = false, lr_path = 1e-2, tv_weight = 1e-2``."""

    lr_path: float = 1e-3  # Adam lr of alpha
    init_alpha: float = 0.5  # the official code's alpha (cifar_sme.json)


class SME(SurrogateAttack):
    """Straight-line surrogate with a learnable position alpha."""

    name, path, label, config_cls = "sme", "line", "SME", SMEConfig
    config: SMEConfig


ATTACKS.register(
    "sme",
    SME,
    config_cls=SMEConfig,
    summary="SME: line surrogate between w0 and wT (Zhu 2023); FedAvg deltas",
    modality="image",
    devices=DEVICE_TYPES,
)
