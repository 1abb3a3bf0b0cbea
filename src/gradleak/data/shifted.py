"""A registered image data set seen through another site's acquisition: the same images with their
intensities shifted (contrast, gamma, brightness, per-channel gain), as between hospitals whose scanners,
exposure or stains differ (issue 56: Aegis' generator trained on one site's public split, its clients' images
from another).

``data.dataset = "shifted"`` with ``data.options = { base = "organamnist", contrast = 1.4, gamma = 0.8 }``:
every split of ``base`` is loaded and each pixel value ``x`` in [0, 1] becomes, in this order,

    x^gamma  ->  contrast * (x - 0.5) + 0.5 + brightness  ->  gain[c] * x  ->  clamped to [0, 1]

so a split named by another experiment part under the base's own name (a generator's public split, say)
keeps the base's intensities. Labels, classes and groups are the base's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from gradleak.data.base import ImageDataset
from gradleak.registry import DATASETS

NAME = "shifted"


@dataclass(frozen=True)
class ShiftedImages:
    """``base``: a registered image data set (its loader's ``options``); ``contrast`` (> 0, 1: none),
    ``gamma`` (> 0, 1: none), ``brightness`` (an offset, 0: none), ``gain`` (one factor > 0 per channel,
    ``[]``: none; a stain or white-balance change on RGB)."""

    base: str = ""
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    contrast: float = 1.0
    gamma: float = 1.0
    brightness: float = 0.0
    gain: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.base, str) or self.base not in DATASETS or self.base.lower() == NAME:
            raise ValueError(f"base must name a registered image data set, got {self.base!r}")
        if DATASETS.entry(self.base).modality != "image":
            raise ValueError(f"base {self.base!r} is not an image data set")
        if not isinstance(self.options, Mapping):
            raise ValueError(f"options must be a table of the base loader's options, got {self.options!r}")
        DATASETS.make_config(self.base, self.options)  # the base's options, checked now
        for key in ("contrast", "gamma"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{key} must be a finite number > 0, got {v!r}")
        b = self.brightness
        if isinstance(b, bool) or not isinstance(b, int | float) or not math.isfinite(b):
            raise ValueError(f"brightness must be a finite number, got {b!r}")
        gain = tuple(self.gain) if isinstance(self.gain, list | tuple) else None
        if gain is None or any(
            isinstance(g, bool) or not isinstance(g, int | float) or not (math.isfinite(g) and g > 0)
            for g in gain
        ):
            raise ValueError(f"gain must be a list of finite factors > 0, one per channel, got {self.gain!r}")
        object.__setattr__(self, "gain", tuple(float(g) for g in gain))


def shift(images: torch.Tensor, config: ShiftedImages) -> torch.Tensor:
    """``images (N, C, H, W)`` in [0, 1] through the module's transform."""
    if config.gain and len(config.gain) != images.shape[1]:
        raise ValueError(f"gain has {len(config.gain)} factors for {images.shape[1]}-channel images")
    x = images.clamp(0, 1).pow(config.gamma)
    x = config.contrast * (x - 0.5) + 0.5 + config.brightness
    if config.gain:
        x = x * torch.tensor(config.gain, dtype=x.dtype).view(1, -1, 1, 1)
    return x.clamp(0, 1)


def load_shifted(
    split: str | None = None,
    root: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    *,
    config: ShiftedImages,
) -> ImageDataset:
    """``split`` of ``config.base`` (its loader's default split when None), shifted."""
    kwargs: dict[str, Any] = {"root": root, "limit": limit}
    if split is not None:
        kwargs["split"] = split
    base_config = DATASETS.make_config(config.base, config.options)
    if base_config is not None:
        kwargs["config"] = base_config
    data = DATASETS.get(config.base)(**kwargs)
    if not isinstance(data, ImageDataset):
        raise ValueError(f"base {config.base!r} did not load images")
    return ImageDataset(f"{data.name}+shift", shift(data.images, config), data.labels, data.num_classes,
                        data.groups)  # fmt: skip


DATASETS.register(
    NAME,
    load_shifted,
    config_cls=ShiftedImages,
    summary="a registered image set with shifted intensities (another site): data.options = {base = ...}",
    modality="image",
)
