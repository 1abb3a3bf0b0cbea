"""Robbing the Fed that knows Aegis: the server sizes its imprint bins for the real *and* synthetic samples.

What it knows about the defense: that the client runs Aegis (paper 000) with a synthetic cache of
``cache_size`` images (M; the paper's default 2048, a public option of the defense), and a bound
``real_samples`` on the client's real images per epoch. Nothing about the cache's content.

Why it works. Aegis' protection against an imprint layer of k bins is bin crowding: under lambda weighting
every real and synthetic sample of an epoch adds to the imprint layer's update with the same weight, and a
bin's recovery (weight update over bias update, :mod:`gradleak.attacks.linear.imprint`) is the weighted mean
of the samples that fired it, so a real image is recovered only when no other sample shares its bin. With
bins at quantiles of the public measurement and synthetic samples distributed like the real ones (the
acceptance filter makes them so), a bin's occupancy is about Poisson with mean (n + M) / k, and a sample is
alone with probability

    p = exp(-(n + M) / k)                                                            (paper 000's B + M > k)

(0.14 for paper 000's k = 1024, M = 2048, n = 0; 0.13 with n = 64: its Table A.5's 11.6 % on
OrganAMNIST). Paper 000 rests its protection on B + M > k and notes that a server changing the leakage
capacity needs a new evaluation; this attack is that server: it inverts the relation,
``k = ceil((real_samples + cache_size) / ln(1 / isolation))``
(8,899 bins for 512 + 2,048 samples at isolation 0.75), and returns every non-empty bin (it cannot tell from
the update which bins hold a real image; matching picks the best one per real image, the "all bins"
read-out of docs/defenses.md). The imprint layer grows to k x (C H W) weights (7 M for 28 x 28 grey images).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from gradleak.attacks.linear.robbing_the_fed import RobbingTheFed, RobbingTheFedConfig
from gradleak.registry import ATTACKS
from gradleak.types import Observation, Reconstruction

MAX_ISOLATION = 0.99


@dataclass(frozen=True)
class RtFAegisConfig:
    """``cache_size`` Aegis' M; ``real_samples`` the server's bound on a client's real images per epoch;
    ``isolation`` the probability a sample should have its bin to itself (sets k, eq. above); ``imprint``
    every other option of :class:`~gradleak.attacks.linear.robbing_the_fed.RobbingTheFedConfig` (its
    ``num_bins`` and ``max_images`` are set here: k, and every bin returned)."""

    cache_size: int = 2048
    real_samples: int = 512
    isolation: float = 0.75
    imprint: RobbingTheFedConfig = field(default_factory=RobbingTheFedConfig)

    def __post_init__(self) -> None:
        for key in ("cache_size", "real_samples"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"rtf_aegis {key} must be an int >= 1, got {v!r}")
        if not 0 < self.isolation <= MAX_ISOLATION:
            raise ValueError(
                f"rtf_aegis isolation must be in (0, {MAX_ISOLATION}] (0.99 already needs k = 100 (n + M) "
                f"bins), got {self.isolation}"
            )
        if not isinstance(self.imprint, RobbingTheFedConfig):
            raise ValueError(
                f"rtf_aegis imprint must be a table of robbing_the_fed options, got {self.imprint!r}"
            )
        default = RobbingTheFedConfig()
        for key in ("num_bins", "max_images"):
            if getattr(self.imprint, key) != getattr(default, key):
                raise ValueError(
                    f"rtf_aegis sets imprint.{key} itself (from cache_size, real_samples and isolation); "
                    f"remove it, or use robbing_the_fed"
                )

    @property
    def num_bins(self) -> int:
        """k such that a sample is alone in its bin with probability ``isolation`` (eq. above)."""
        return math.ceil((self.real_samples + self.cache_size) / math.log(1 / self.isolation))


class RtFAegis:
    """Robbing the Fed with k sized for Aegis' real + synthetic samples; see the module docstring."""

    def __init__(self, config: RtFAegisConfig | None = None) -> None:
        self.config = config or RtFAegisConfig()
        k = self.config.num_bins
        self._rtf = RobbingTheFed(dataclasses.replace(self.config.imprint, num_bins=k, max_images=k))

    def prepare(
        self, model: nn.Module, public_images: torch.Tensor | None, *, generator: torch.Generator
    ) -> tuple[nn.Module, Mapping[str, object]]:
        malicious, secrets = self._rtf.prepare(model, public_images, generator=generator)
        return malicious, {**secrets, "attack": "rtf_aegis"}

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        rec = self._rtf.reconstruct(obs, generator=generator)
        stats = {**rec.stats, "isolation": self.config.isolation}
        return Reconstruction(images=rec.images, labels=rec.labels, stats=stats)


ATTACKS.register(
    "rtf_aegis",
    RtFAegis,
    config_cls=RtFAegisConfig,
    summary="adaptive Robbing the Fed vs Aegis: bins sized for real + synthetic samples, every bin returned",
    modality="image",
)
