"""Robbing the Fed (Fowl, Geiping, Czaja, Goldblum, Goldstein; ICLR 2022): an imprint block of k bins.

``prepare`` plants an :class:`~gradleak.models.malicious.ImprintBlock` in front of the honest classifier:
one linear measurement ``<a, x>`` of the input per bin (``a`` random or mean brightness), biases at the
quantiles of that measurement over the server's *public* images (the paper's binning), a ReLU so the bins
are cumulative, and a back-connection with one weight for every bin. ``reconstruct`` inverts the imprint
layer's update analytically (differences of consecutive bins, weight update over bias update; see
:mod:`gradleak.attacks.linear.imprint`) and returns one image per non-empty bin, at most as many as the
update reports samples.

Local optimisers: the ratio survives FedSGD and SGD steps (the delta is a positive multiple of a sum of
gradients) but not Adam, whose per-coordinate normalisation keeps little more than signs. With
``tuned_for = "adam"`` the server scales the back-connection (from public data only) so every imprint
gradient stays ``adam_margin`` times below Adam's ``eps`` (1e-8, PyTorch's default), where Adam's step
``m / (sqrt(v) + eps)`` is linear in the gradient; docs/attacks-linear.md reports how well that works.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from gradleak.attacks.checks import require_image_input
from gradleak.attacks.linear.imprint import (
    MEASUREMENTS,
    ImprintSecrets,
    calibrate_back_weight,
    features_to_images,
    invert_bins,
    local_step_count,
    place_bins,
    program_bins,
)
from gradleak.models.malicious import ImprintBlock, imprint_parameter_names, insert_imprint
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation, Reconstruction

log = logging.getLogger(__name__)

ADAM_EPS = 1e-8
TUNINGS = ("sgd", "adam")
DEFAULT_SCALE = {"sgd": 1e-3, "adam": 3e-2}


def scale_for(scale: float | None, tuned_for: str) -> float:
    return DEFAULT_SCALE[tuned_for] if scale is None else float(scale)


@dataclass(frozen=True)
class RobbingTheFedConfig:
    """``num_bins`` k; ``measurement`` random | mean | positive; ``scale`` the gain of the imprint rows in
    units of the public measurement's standard deviation (None: ``DEFAULT_SCALE[tuned_for]``, chosen on
    OrganAMNIST train samples, see docs/attacks-linear.md); ``back_weight`` the back-connection weight (for
    ``tuned_for = "sgd"``); ``tuned_for = "adam"`` recalibrates it to keep imprint gradients at
    ``adam_margin * 1e-8``; ``max_images`` caps the output (None: the update's sample count);
    ``rel_tol`` is the relative bias mass below which a bin counts as empty; ``center`` subtracts the
    public mean image before the imprint layer (a fixed buffer: the bins drift less over local steps)."""

    num_bins: int = 1024
    measurement: str = "random"
    scale: float | None = None
    back_weight: float = 10.0
    tuned_for: str = "sgd"
    adam_margin: float = 1e-4
    max_images: int | None = None
    rel_tol: float = 1e-6
    center: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.num_bins, int) or self.num_bins < 2:
            raise ValueError(f"num_bins must be an int >= 2, got {self.num_bins!r}")
        if self.measurement not in MEASUREMENTS:
            raise ValueError(f"measurement must be one of {MEASUREMENTS}, got {self.measurement!r}")
        if self.tuned_for not in TUNINGS:
            raise ValueError(f"tuned_for must be one of {TUNINGS}, got {self.tuned_for!r}")
        for key in ("scale", "back_weight", "adam_margin"):
            v = getattr(self, key)
            if key == "scale" and v is None:
                continue
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"{key} must be a positive finite number, got {v!r}")
        if self.max_images is not None and self.max_images < 1:
            raise ValueError(f"max_images must be >= 1, got {self.max_images}")
        if not 0 <= self.rel_tol < 1:
            raise ValueError(f"rel_tol must be in [0, 1), got {self.rel_tol}")


def require_public(public_images: torch.Tensor | None, name: str) -> torch.Tensor:
    if public_images is None or public_images.dim() != 4 or len(public_images) < 2:
        raise ValueError(
            f"{name} needs public auxiliary images (N >= 2, C, H, W) to place its bins; got "
            f"{None if public_images is None else tuple(public_images.shape)}"
        )
    return public_images


def output_classes(model: nn.Module, sample: torch.Tensor) -> int:
    with torch.no_grad():
        return int(model(sample[:1]).shape[-1])


class RobbingTheFed:
    """The attack; see the module docstring."""

    def __init__(self, config: RobbingTheFedConfig | None = None) -> None:
        self.config = config or RobbingTheFedConfig()

    def prepare(
        self, model: nn.Module, public_images: torch.Tensor | None, *, generator: torch.Generator
    ) -> tuple[nn.Module, Mapping[str, object]]:
        cfg = self.config
        public = require_public(public_images, "robbing_the_fed")
        dim = int(public[0].numel())
        offset, direction, cuts = place_bins(
            public, cfg.measurement, cfg.num_bins, generator, center=cfg.center
        )
        block = ImprintBlock(dim, cfg.num_bins, back_weight=cfg.back_weight, offset=offset)
        program_bins(block.linear, direction, cuts, scale_for(cfg.scale, cfg.tuned_for))
        malicious = insert_imprint(model, block)
        if cfg.tuned_for == "adam":
            w = calibrate_back_weight(
                malicious, block, public, output_classes(malicious, public), cfg.adam_margin * ADAM_EPS,
                generator,
            )  # fmt: skip
            log.info("robbing_the_fed: back-connection weight %.3g keeps imprint gradients below Adam eps", w)
        weight_name, bias_name = imprint_parameter_names()
        secrets = ImprintSecrets(
            weight_name, bias_name, cfg.num_bins, (dim,), block.linear.bias.detach(), block.offset.detach()
        )
        return malicious, {"attack": "robbing_the_fed", **secrets.to_mapping()}

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        require_image_input(obs)
        cfg = self.config
        start = time.perf_counter()
        secrets = ImprintSecrets.from_observation(obs)
        dim = int(torch.tensor(obs.input_shape).prod())
        if int(torch.tensor(secrets.feature_shape).prod()) != dim:
            raise AttackInputError(
                f"the imprint layer reads {secrets.feature_shape} features, the input has {dim} values"
            )
        limit = cfg.max_images or max(1, obs.update.num_samples)
        rec = invert_bins(
            obs.update.tensors[secrets.weight_name],
            obs.update.tensors[secrets.bias_name],
            max_items=limit,
            rel_tol=cfg.rel_tol,
        )
        images = features_to_images(secrets.restore(rec.features), obs.input_shape)
        if len(images) == 0:  # nothing fired: one grey image, scored as a failure
            log.warning("robbing_the_fed: no bin carries any update mass")
            images = torch.full((1, *obs.input_shape), 0.5)
        steps = local_step_count(obs)
        stats = {
            "seconds": time.perf_counter() - start,
            "bins": float(secrets.num_bins),
            "bins_recovered": float(len(rec.bins)),
        }
        if steps is not None:
            stats["local_steps"] = float(steps)
        return Reconstruction(images=images, labels=None, stats=stats)


ATTACKS.register(
    "robbing_the_fed",
    RobbingTheFed,
    config_cls=RobbingTheFedConfig,
    summary="malicious server: imprint block of k bins, analytic recovery (Fowl et al. 2022)",
    modality="image",
)
