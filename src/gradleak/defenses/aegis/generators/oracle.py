"""The oracle "generator": real images of the requested class that the client does not hold, drawn from a
sanctioned public split. It is what a perfect in-distribution generator would give (paper 000's cache
constraint ``E||D_i - D_i'||^2 <= H`` at its best), so an Aegis run with it separates the cost of the
synthetic step itself from the generator's shortfall. A diagnostic: a deployment needs a real generator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from gradleak.data.base import ImageDataset
from gradleak.defenses.aegis.generators.base import GeneratorRefusal, PublicSplit, check_labels
from gradleak.registry import GENERATORS


@dataclass(frozen=True)
class OracleGeneratorConfig:
    """``public``: the split the real images come from (it must not overlap the clients' data); required
    when the oracle is used (checked then: its default names none)."""

    public: PublicSplit = field(default_factory=PublicSplit)


class RealImageGenerator:
    """Samples, for each label, a uniformly drawn real image of that class (with replacement)."""

    def __init__(self, pool: ImageDataset) -> None:
        self.pool = pool
        self.image_shape = pool.input_shape
        self.num_classes = pool.num_classes
        self._members = {int(y): (pool.labels == y).nonzero().flatten() for y in pool.labels.unique()}

    @property
    def classes(self) -> list[int]:
        return sorted(self._members)

    def sample(self, labels: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
        check_labels(labels, self.num_classes)
        missing = sorted({int(y) for y in labels} - set(self._members))
        if missing:
            raise ValueError(f"the public split has no image of classes {missing}; it has {self.classes}")
        out = torch.empty(len(labels), *self.image_shape)
        for y in sorted({int(v) for v in labels}):
            where = (labels == y).nonzero().flatten()
            members = self._members[y]
            out[where] = self.pool.images[
                members[torch.randint(0, len(members), (len(where),), generator=generator)]
            ]
        return out


def fit_oracle(
    data: ImageDataset,
    config: OracleGeneratorConfig,
    *,
    generator: torch.Generator | None = None,
    root: str | os.PathLike[str] | None = None,
) -> RealImageGenerator:
    pool = config.public.load_for(data, root)  # raises when no split is named or it does not fit the task
    shared = _shared_images(pool, data)
    if shared:  # fail closed: the "oracle" would put the client's own images into its cache
        raise GeneratorRefusal(
            f"public split {config.public.dataset}/{config.public.split} holds {shared} of the client's own "
            "images; the oracle must draw images the client does not hold"
        )
    return RealImageGenerator(pool)


def _shared_images(a: ImageDataset, b: ImageDataset) -> int:
    """How many images of ``b`` appear, pixel for pixel, in ``a``."""
    seen = {x.numpy().tobytes() for x in a.images}
    return sum(x.numpy().tobytes() in seen for x in b.images)


GENERATORS.register(
    "oracle",
    fit_oracle,
    config_cls=OracleGeneratorConfig,
    summary="diagnostic: real images of the class from a public split the clients do not hold",
)
