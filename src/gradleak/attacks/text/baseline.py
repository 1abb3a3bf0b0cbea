"""Matched random-gradient null baseline and the validity gate of paper 002 (Sec. VI-C).

A probe counts as a valid attack only when its undefended ROUGE-1 exceeds both 0.10 and a matched
random-gradient null baseline by at least 0.05; a valid probe is blocked by a defense that brings its
ROUGE-1 to at most max(0.05, null + 0.05). The null observation replaces every update tensor by Gaussian
noise of the same shape and Frobenius norm (drawn from an explicit generator), so the attack runs on an
input with the same scale but no data in it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import torch

from gradleak.device import normal
from gradleak.types import Observation, Update

VALID_MIN_R1 = 0.10
VALID_MARGIN = 0.05
BROKEN_R1 = 0.05


def null_observation(obs: Observation, generator: torch.Generator) -> Observation:
    """``obs`` with each update tensor, and each of its views', replaced by norm-matched Gaussian noise
    (independent draws: the null views share no data either)."""
    update = _null(obs.update, generator)  # first: the update's null does not depend on the views
    return replace(obs, update=update, views=tuple(_null(v, generator) for v in obs.views))


def _null(update: Update, generator: torch.Generator) -> Update:
    noise = {}
    for name, t in update.tensors.items():
        z = normal(t.shape, generator, t)  # float32 draws from the CPU generator, on t's device and dtype
        norm = float(t.norm())
        noise[name] = (
            z * (norm / float(z.norm())) if norm > 0 and float(z.norm()) > 0 else torch.zeros_like(t)
        )
    return dataclasses.replace(update.replace(noise), buffers={})  # a null update carries no statistics


def is_valid(r1: float, null_r1: float) -> bool:
    """Paper 002's gate: undefended R-1 > 0.10 and > null + 0.05."""
    return r1 > VALID_MIN_R1 and r1 > null_r1 + VALID_MARGIN


def is_blocked(defended_r1: float, null_r1: float) -> bool:
    """A valid probe is blocked when the defended R-1 is at most max(0.05, null + 0.05)."""
    return defended_r1 <= max(BROKEN_R1, null_r1 + VALID_MARGIN)
