"""GI-NAS: gradient inversion through a generator found by training-free architecture search.

Yu et al., "GI-NAS: Boosting Gradient Inversion Attacks through Adaptive Neural Architecture Search", IEEE
TIFS 20 (2025), read against the official code (cswbyu/GI-NAS, ``model/generator.py``; read, not copied):

1. **Search.** A fixed noise z ~ N(0, 1) of the batch's shape (B, C, H, W) is drawn once. Each of
   ``candidates`` generators of :mod:`~gradleak.attacks.image.nas_space`, randomly initialised and never
   trained, is scored by the cosine gradient-matching distance (IG's Eq. 4 term over all parameters) of its
   output G(z) at the labels; the lowest keeps its initial weights.
2. **Optimisation.** Only that generator's weights are optimised (z stays fixed): Adam, learning rate
   1e-3, on the *sign* of the gradient, constant schedule, pure cosine loss (the official TV weight is 0),
   30,000 iterations, the last iterate returned. One generator produces the whole batch; its BatchNorm
   layers run in training mode, coupling the images as in the official code.

Labels are granted or recovered (iDLG) as for IG, and the client's loss is differentiated where the
recipe states it. A FedAvg delta is matched as the gradient direction -delta (the single-step reading
paper 001 Sec. 4.1 evaluates GI-NAS under).

Adaptations, each a parameter: ``batch_norm="auto"`` runs the generator's BatchNorm in evaluation mode
(the identity at initialisation) for a single image, where the official code fails (a 1 x 1 bottleneck
holds one value per channel); ``levels`` defaults to as many halvings as the image allows (5 on 32 x 32,
4 on 28 x 28, generated at 32 x 32 and centre-cropped); ``candidates`` are drawn from the space's
distribution by the attack's generator rather than read from the official list of 5,000.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from gradleak.attacks.image.ig import IGConfig, InvertingGradients, Matching
from gradleak.attacks.image.nas_space import Architecture, SkipGenerator, generated_size, sample_architectures
from gradleak.device import DEVICE_TYPES, normal
from gradleak.progress import bar
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation, Reconstruction

log = logging.getLogger(__name__)

MAX_LEVELS = 5


@dataclass(frozen=True)
class GINASConfig(IGConfig):
    """The official defaults (``runcifar10.py``, ``utils/config.py``): 5,000 candidates, width 128, Adam lr
    1e-3 on signed gradients for 30,000 iterations, TV weight 0. ``levels``: None for as many as the image
    allows (at most 5); ``batch_norm``: ``"train"``, ``"eval"`` or ``"auto"`` (train for two or more
    images). IG's ``init`` does not apply (the generator's output is the start)."""

    max_iterations: int = 30_000
    lr: float = 1e-3
    tv_weight: float = 0.0
    candidates: int = 5000
    width: int = 128
    levels: int | None = None
    batch_norm: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {self.candidates}")
        if self.width < 16 or self.width % 16:
            raise ValueError(f"width must be a positive multiple of 16, got {self.width}")
        if self.levels is not None and not 1 <= self.levels <= MAX_LEVELS:
            raise ValueError(f"levels must be in [1, {MAX_LEVELS}] or None, got {self.levels}")
        if self.batch_norm not in ("auto", "train", "eval"):
            raise ValueError(f"batch_norm must be 'auto', 'train' or 'eval', got {self.batch_norm!r}")


def default_levels(height: int, width: int) -> int:
    """As many halvings as the smaller side allows, at most :data:`MAX_LEVELS`."""
    return max(1, min(MAX_LEVELS, int(math.log2(min(height, width)))))


class GINAS(InvertingGradients):
    """See the module docstring."""

    label = "GI-NAS"
    config: GINASConfig

    def __init__(self, config: GINASConfig | None = None) -> None:
        super().__init__(config or GINASConfig())
        self.restart_stats: list[tuple[float, dict[str, float]]] = []  # each restart's final loss, search

    def _build(self, arch: Architecture, image: tuple[int, int, int], batch: int, seed: int) -> SkipGenerator:
        """A candidate for ``batch`` images of shape ``image``, its initial weights drawn from ``seed`` (the
        global RNG is left untouched); BatchNorm in training mode per ``batch_norm``."""
        with torch.random.fork_rng(devices=[]):  # the CPU generator only: no accelerator's is touched
            torch.default_generator.manual_seed(seed)
            gen = SkipGenerator(arch, image, self.config.width)
        mode = self.config.batch_norm
        return gen.train(mode == "train" or (mode == "auto" and batch >= 2))

    def search(
        self, match: Matching, z: torch.Tensor, image: tuple[int, int, int], generator: torch.Generator
    ) -> tuple[SkipGenerator, float, list[float]]:
        """Step 1: the candidate whose untrained output G(z) matches best, its distance, every distance."""
        cfg = self.config
        levels = cfg.levels or default_levels(image[1], image[2])
        archs = sample_architectures(levels, cfg.candidates, generator)
        seeds = torch.randint(2**62, (len(archs),), generator=generator).tolist()
        losses: list[float] = []
        best: tuple[float, SkipGenerator] | None = None
        for arch, seed in zip(bar(archs, desc="GI-NAS search", force=cfg.progress), seeds, strict=True):
            gen = self._build(arch, image, z.shape[0], seed).to(z)  # the noise's device and dtype
            with torch.no_grad():
                x = gen(z)
            loss = self.matching_loss(match, x)
            losses.append(loss)
            if math.isfinite(loss) and (best is None or loss < best[0]):
                best = (loss, gen)
        if best is None:
            raise AttackInputError(f"GI-NAS: no candidate of {len(archs)} gave a finite matching distance")
        return best[1], best[0], losses

    def _optimise(
        self, match: Matching, shape: tuple[int, ...], generator: torch.Generator
    ) -> tuple[torch.Tensor, float]:
        """Search, then Adam on the signed gradient of the cosine distance (plus TV) w.r.t. the generator's
        weights; the last iterate and its matching distance."""
        cfg = self.config
        n, c, h, w = shape
        if n == 1 and cfg.batch_norm == "train":
            raise AttackInputError(
                "GI-NAS: batch_norm = 'train' needs two or more images (one image gives the generator's "
                "bottleneck one value per channel); use batch_norm = 'auto' or 'eval'"
            )
        z = normal(
            (n, c, *generated_size(h, w, cfg.levels or default_levels(h, w))), generator, match.params[0]
        )
        start = time.perf_counter()
        gen, searched, losses = self.search(match, z, (c, h, w), generator)
        stats = {
            "search_seconds": time.perf_counter() - start,
            "search_loss": searched,
            "search_loss_median": float(torch.tensor(losses).nanquantile(0.5)),
        }
        weights = list(gen.parameters())
        opt = torch.optim.Adam(weights, lr=cfg.lr)
        for _ in bar(range(cfg.max_iterations), desc=self.label, force=cfg.progress):
            opt.zero_grad(set_to_none=True)
            total = self.objective(match, gen(z))
            grads = torch.autograd.grad(total, weights, allow_unused=True)  # skips the arch leaves out
            for p, g in zip(weights, grads, strict=True):
                p.grad = None if g is None else g.sign() if cfg.signed_gradients else g
            opt.step()
        with torch.no_grad():
            x = gen(z).clamp(0, 1)
        final = self.matching_loss(match, x)
        self.restart_stats.append((final, stats))
        return x, final

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        self.restart_stats = []
        rec = super().reconstruct(obs, generator=generator)
        _, search = min(self.restart_stats, key=lambda ls: ls[0])  # the restart IG's loop kept
        return Reconstruction(images=rec.images, labels=rec.labels, stats={**rec.stats, **search})


ATTACKS.register(
    "gi_nas",
    GINAS,
    config_cls=GINASConfig,
    summary="GI-NAS: a generator found by training-free architecture search, then optimised (Yu 2025)",
    modality="image",
    devices=DEVICE_TYPES,
)


__all__ = ["GINAS", "GINASConfig", "default_levels"]
