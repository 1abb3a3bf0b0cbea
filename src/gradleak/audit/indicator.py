"""A truth-free leakage indicator: how much better the attack explains the real update than noise.

Without the client's data a server (or an operator auditing a deployment) cannot score a reconstruction.
What it can measure is the attack's own fit: the matching loss it reaches on the real update (Inverting
Gradients' cosine distance, Geiping et al. 2020, Eq. 4; SME's and DLG's alike) against the loss it reaches
on a norm-matched Gaussian update of the same shapes (the null update of paper 002's text floor, Sec. VI-C,
:func:`gradleak.attacks.text.baseline.null_observation`). The **fit margin** ``null - real`` is near zero
when the attack finds nothing in the update it could not find in noise, and grows as the update carries
data the attack can invert. It is one-sided: a small margin says this attack failed, not that the update
is safe. How it ranks updates against the truth-based leakage over the floor is measured by
``benchmarks/truth_free_indicator.py`` (docs/deployment.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradleak.attacks.text.baseline import null_observation
from gradleak.types import Attack, Observation, Reconstruction


def fit_margin(
    attack: Attack, obs: Observation, real: Reconstruction, generator: torch.Generator
) -> dict[str, Any]:
    """``null_matching_loss`` and ``fit_margin`` for ``real`` (the attack's reconstruction of ``obs``), by
    running the attack once more on a norm-matched null update drawn from ``generator``; empty when the
    attack reports no matching loss."""
    loss = real.stats.get("matching_loss")
    if not isinstance(loss, int | float) or not math.isfinite(loss):
        return {}
    null = attack.reconstruct(null_observation(obs, generator), generator=generator)
    null_loss = null.stats.get("matching_loss")
    if not isinstance(null_loss, int | float) or not math.isfinite(null_loss):
        return {}
    return {"null_matching_loss": float(null_loss), "fit_margin": float(null_loss) - float(loss)}


__all__ = ["fit_margin"]
