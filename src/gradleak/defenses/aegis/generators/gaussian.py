"""Built-in class-conditional generator: a per-class Gaussian in a PCA subspace, fit on the client's
sanctioned split in seconds on a CPU.

Paper 000 (Appendix F.1) allows generators "adapted on a sanctioned client-side training split". For each
class ``y`` the client fits the mean image ``mu_y`` and the top ``d`` principal directions ``U_y`` with their
variances ``s_y^2`` of its own images of that class; a sample is ``mu_y + U_y (temperature * s_y * z)``,
``z ~ N(0, I)``, clamped to [0, 1]. Dimension ``d`` is capped at ``n_y - 1``. A class the client lacks
cannot be sampled (an error, not a silent substitute). Memorisation caveat (paper 000, Limitations): with
few images per class, samples stay inside the span of the client's own images; they never leave the client.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from gradleak.data.base import ImageDataset
from gradleak.defenses.aegis.generators.base import check_labels
from gradleak.registry import GENERATORS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GaussianGeneratorConfig:
    components: int = 32  # PCA directions per class (capped at n_y - 1)
    temperature: float = 1.0  # scale of the sampled coefficients
    min_per_class: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.components, int) or self.components < 1:
            raise ValueError(f"components must be an int >= 1, got {self.components!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.min_per_class < 1:
            raise ValueError(f"min_per_class must be >= 1, got {self.min_per_class}")


class ClassGaussianGenerator:
    """A :class:`~gradleak.defenses.aegis.generators.base.ConditionalGenerator`; build it with :meth:`fit`."""

    def __init__(
        self,
        image_shape: tuple[int, int, int],
        num_classes: int,
        means: dict[int, torch.Tensor],
        bases: dict[int, torch.Tensor],
        stds: dict[int, torch.Tensor],
        temperature: float = 1.0,
    ) -> None:
        self.image_shape = image_shape
        self.num_classes = num_classes
        self.means, self.bases, self.stds = means, bases, stds
        self.temperature = temperature

    @property
    def classes(self) -> list[int]:
        return sorted(self.means)

    @classmethod
    def fit(cls, data: ImageDataset, config: GaussianGeneratorConfig | None = None) -> ClassGaussianGenerator:
        cfg = config or GaussianGeneratorConfig()
        means, bases, stds = {}, {}, {}
        for y in sorted(int(v) for v in data.labels.unique()):
            x = data.images[data.labels == y].flatten(1).to(torch.float64)
            if len(x) < cfg.min_per_class:
                log.info("gaussian generator: class %d has %d images, skipped", y, len(x))
                continue
            mu = x.mean(dim=0)
            d = min(cfg.components, len(x) - 1)
            if d >= 1:
                _, s, vh = torch.linalg.svd(x - mu, full_matrices=False)
                bases[y] = vh[:d].T.contiguous()
                stds[y] = s[:d] / max(1.0, (len(x) - 1) ** 0.5)
            else:
                bases[y] = torch.zeros(x.shape[1], 0, dtype=torch.float64)
                stds[y] = torch.zeros(0, dtype=torch.float64)
            means[y] = mu
        if not means:
            raise ValueError(f"no class has >= {cfg.min_per_class} images to fit a generator on")
        return cls(data.input_shape, data.num_classes, means, bases, stds, cfg.temperature)

    def sample(self, labels: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
        check_labels(labels, self.num_classes)
        missing = sorted({int(y) for y in labels} - set(self.means))
        if missing:
            raise ValueError(f"generator was not fit on classes {missing}; it knows {self.classes}")
        out = torch.empty(len(labels), int(torch.tensor(self.image_shape).prod()), dtype=torch.float64)
        for y in sorted({int(v) for v in labels}):
            idx = (labels == y).nonzero().flatten()
            z = torch.randn(len(idx), len(self.stds[y]), generator=generator, dtype=torch.float64)
            out[idx] = self.means[y] + (self.temperature * z * self.stds[y]) @ self.bases[y].T
        return out.clamp(0.0, 1.0).to(torch.float32).reshape(len(labels), *self.image_shape)


def fit_gaussian(
    data: ImageDataset,
    config: GaussianGeneratorConfig,
    *,
    generator: torch.Generator | None = None,
    root: str | os.PathLike[str] | None = None,
) -> ClassGaussianGenerator:
    """The registered factory (deterministic: ``generator`` is not drawn from; it reads no files, so
    ``root`` is unused)."""
    return ClassGaussianGenerator.fit(data, config)


GENERATORS.register(
    "gaussian",
    fit_gaussian,
    config_cls=GaussianGeneratorConfig,
    summary="per-class Gaussian in a PCA subspace of the client's images (seconds on a CPU)",
)
