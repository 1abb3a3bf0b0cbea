"""NL-SME (Xia et al. 2025), as summarised in paper 001, Sec. 2.2.

The surrogate weights lie on the quadratic Bezier curve of paper 001's Eq. 4,
``w(t) = (1-t)^2 w_0 + 2 (1-t) t P1 + t^2 w_T``, with a learnable control point P1 (initialised at the
midpoint) and one learnable position t in [0, 1]; the gradient at w(t) is rescaled coordinatewise by a
calibration vector d (clamped to [0.1, 10], pulled to 1 by R_d = ||d - 1||^2), and P1 is kept near the
straight line by R_p = ||P1 - (w_0 + w_T)/2||^2. Objective: Eq. 10 with G replaced by the single-point
gradient. Results report both the calibrated and the honest (d = 1) cosine loss. Shared machinery:
:mod:`gradleak.attacks.image.surrogate`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradleak.attacks.image.surrogate import SurrogateAttack, SurrogateConfig
from gradleak.device import DEVICE_TYPES
from gradleak.registry import ATTACKS


@dataclass(frozen=True)
class NLSMEConfig(SurrogateConfig):
    """NL-SME's own options, paper 001's values (``lr_t``: ours, the paper gives none); the shared
    optimiser settings (decay, box, TV) are :class:`SurrogateConfig`'s, tuned on held-out updates."""

    lr_path: float = 1e-3  # Adam lr of P1
    lr_t: float = 1e-2  # Adam lr of t (our choice; not given in paper 001)
    lr_d: float = 2.5e-3
    p_weight: float = 1e-3
    d_weight: float = 1e-6
    init_t: float = 0.5
    calibrate: bool = True


class NLSME(SurrogateAttack):
    """Bezier surrogate read at one learnable position, with calibration."""

    name, path, label, config_cls = "nlsme", "bezier_t", "NL-SME", NLSMEConfig
    config: NLSMEConfig


ATTACKS.register(
    "nlsme",
    NLSME,
    config_cls=NLSMEConfig,
    summary="NL-SME: Bezier surrogate at one learnable t + calibration d (Xia 2025); FedAvg deltas",
    modality="image",
    devices=DEVICE_TYPES,
)
