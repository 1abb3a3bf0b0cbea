"""Aegis' task-relevant synthetic cache, built offline per client and never uploaded (paper 000,
"Task-Relevant Synthetic Cache").

Candidates are drawn from a conditional generator with labels from the client's own label distribution and
accepted by the in-distribution budget ``E||D_i - D_i'||^2 <= H`` (paper 000, Sec. "Key Designs" 1). The
paper states the constraint, not a filter; Appendix A.2's example (feature-space MSE in a frozen feature
extractor, matched private samples) is made concrete here, every choice a parameter:

- feature extractor: a frozen, seeded random convolutional network (:func:`frozen_features`), or any
  frozen ``nn.Module`` the caller passes;
- matching: a candidate's ``match_k`` nearest private samples *of its label* in feature space;
- distance: mean squared feature difference to those matches, features standardised by the private
  features' per-dimension spread;
- budget: ``H`` given, or calibrated as ``budget_scale`` x the ``budget_quantile`` of the private samples'
  own leave-one-out distances (same matching rule) on the client's split, pooled over its classes: with the
  default 0.9, a candidate is accepted when it lies as close to the client's images of its class as 90 % of
  the client's images lie to their nearest other image of their class, so H measures the client's own
  spread, not the generator's;
- ``normalize = "per_image"``: each image (private and candidate) is standardised per channel before the
  features, so a generator whose images differ from the client's by an affine intensity change (contrast,
  brightness, a stain's gain: another site's acquisition) is judged on structure alone. What that admits
  changes what the cache masks: its privacy effect is measured (docs/defenses.md), not assumed.

Candidates are drawn in rounds until ``M`` are accepted or ``max_candidates`` were tried; then
:class:`CacheError`. The rejection rate is logged and kept in :attr:`SyntheticCache.stats`.

**Fail fast.** The first ``pilot`` candidates are a pilot draw: when even the upper 95 % bound of their
acceptance rate (exact, Clopper-Pearson) cannot fill ``M`` within ``max_candidates_factor * M`` draws, the
build stops there, seconds in, with the measured rate, the budget H, the acceptance per class (the
generator's class fidelity as the filter sees it) and the levers, instead of after the whole candidate
budget. The progress bar shows accepted / tried, the rate and the time left.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from scipy.stats import beta
from torch import nn

from gradleak.data.base import ImageDataset
from gradleak.defenses.aegis.generators.base import ConditionalGenerator
from gradleak.options import repr_without_defaults
from gradleak.progress import bar
from gradleak.update_io import read_keyed, write_keyed

log = logging.getLogger(__name__)

CACHE_FORMAT = "gradleak-aegis-cache/2"  # raise the version when a change to the build changes its caches


class CacheError(RuntimeError):
    """The generator could not supply enough in-distribution candidates."""


NORMALIZE = ("none", "per_image")


@dataclass(frozen=True, repr=False)
class CacheConfig:
    size: int = 2048  # M
    budget: float | None = None  # H; None: calibrated from the private split
    budget_quantile: float = 0.9
    budget_scale: float = 1.0
    match_k: int = 1
    max_candidates_factor: float = 8.0  # give up after this many x M candidates
    chunk: int = 512
    feature_seed: int = 0
    pilot: int = 256  # candidates drawn first to decide whether the build can succeed (0: no pilot)
    normalize: str = "none"  # "per_image": each image standardised per channel before the features

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"cache size must be an int >= 1, got {self.size!r}")
        if self.budget is not None and not (math.isfinite(self.budget) and self.budget > 0):
            raise ValueError(f"budget H must be a positive finite number, got {self.budget}")
        if not 0 < self.budget_quantile <= 1:
            raise ValueError(f"budget_quantile must be in (0, 1], got {self.budget_quantile}")
        if not self.budget_scale > 0:
            raise ValueError(f"budget_scale must be > 0, got {self.budget_scale}")
        if self.match_k < 1 or self.chunk < 1:
            raise ValueError("match_k and chunk must be >= 1")
        if not self.max_candidates_factor >= 1:
            raise ValueError(f"max_candidates_factor must be >= 1, got {self.max_candidates_factor}")
        if isinstance(self.pilot, bool) or not isinstance(self.pilot, int) or self.pilot < 0:
            raise ValueError(f"pilot must be an int >= 0 (0: no pilot draw), got {self.pilot!r}")
        if self.normalize not in NORMALIZE:
            raise ValueError(f"normalize must be one of {NORMALIZE}, got {self.normalize!r}")

    def __repr__(self) -> str:
        return repr_without_defaults(self, "normalize")  # the repr keys stored caches


@dataclass(frozen=True)
class SyntheticCache:
    """The accepted synthetic images ``(M, C, H, W)`` in [0, 1] and their labels; client-local."""

    images: torch.Tensor
    labels: torch.Tensor
    stats: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.images.dim() != 4 or self.images.dtype != torch.float32:
            raise ValueError(f"cache images must be float32 (M, C, H, W), got {tuple(self.images.shape)}")
        if self.labels.shape != (len(self.images),) or self.labels.dtype != torch.int64:
            raise ValueError("cache labels must be int64 of shape (M,)")
        if len(self.images) == 0:
            raise ValueError("an empty cache masks nothing")

    def __len__(self) -> int:
        return len(self.labels)

    def save(self, path: Path, key: str) -> Path:
        """Write images, labels and stats with ``key`` (what the cache was built from) and the content's
        digest as metadata, atomically. The file holds a client's synthetic images: it stays where the
        client is, like the cache itself."""
        tensors = {"images": self.images, "labels": self.labels}
        return write_keyed(
            path, tensors, format=CACHE_FORMAT, key=key, meta={"stats": json.dumps(self.stats)}
        )

    @classmethod
    def load(cls, path: Path, key: str) -> SyntheticCache:
        """A cache written by :meth:`save` for the same ``key`` whose content matches its digest;
        ValueError for any other file."""
        tensors, meta = read_keyed(path, format=CACHE_FORMAT, key=key, what="Aegis cache")
        return cls(tensors["images"], tensors["labels"], {**json.loads(meta["stats"]), "reloaded": 1.0})


class _FrozenFeatures(nn.Module):
    """Downsampled image (7x7 per channel) beside a frozen random conv layer's max-pooled responses."""

    def __init__(self, channels: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.conv = nn.Conv2d(channels, 16, 3, padding=1)
        with torch.no_grad():
            w = torch.randn(self.conv.weight.shape, generator=g) / math.sqrt(9 * channels)
            self.conv.weight.copy_(
                w - w.mean(dim=(1, 2, 3), keepdim=True)
            )  # zero-mean: texture, not brightness
            assert self.conv.bias is not None
            self.conv.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        coarse = nn.functional.adaptive_avg_pool2d(x, 7).flatten(1)
        edges = nn.functional.adaptive_max_pool2d(self.conv(x).abs(), 4).flatten(1)
        return torch.cat([coarse, edges], dim=1)


def frozen_features(channels: int, seed: int = 0) -> nn.Module:
    """The default frozen feature extractor: a 7x7 average-pooled copy of the image (layout, brightness)
    and a seeded random 3x3 conv layer's absolute responses max-pooled to 4x4 (texture, noise)."""
    return _FrozenFeatures(channels, seed).requires_grad_(False).eval()


def standardise(images: torch.Tensor) -> torch.Tensor:
    """Each image's channels to mean 0 and standard deviation 1 (a flat channel to 0): an affine change of a
    channel's intensities (contrast, brightness, a stain's or white balance's gain) leaves the result as it
    was, where it does not clip."""
    mean = images.mean(dim=(2, 3), keepdim=True)
    std = images.std(dim=(2, 3), keepdim=True)
    return (images - mean) / std.clamp_min(1e-6)


class AcceptanceFilter:
    """Feature-space MSE to the matched private samples of the same label, within the budget H."""

    def __init__(self, private: ImageDataset, config: CacheConfig, extractor: nn.Module | None = None):
        self.config = config
        self.extractor = extractor or frozen_features(private.input_shape[0], config.feature_seed)
        feats = self._raw(private.images)
        self.center, self.spread = feats.mean(0), feats.std(0).clamp_min(1e-6)
        self.feats = (feats - self.center) / self.spread
        self.labels = private.labels
        self.budget = config.budget if config.budget is not None else self._calibrate()

    @torch.no_grad()
    def _raw(self, images: torch.Tensor) -> torch.Tensor:
        if self.config.normalize == "per_image":
            images = standardise(images)
        return torch.cat([self.extractor(x) for x in images.split(512)]).to(torch.float64)

    def _calibrate(self) -> float:
        d = []
        for y in self.labels.unique():
            f = self.feats[self.labels == y]
            if len(f) < 2:
                continue
            dist = torch.cdist(f, f).pow(2) / f.shape[1]
            dist.fill_diagonal_(float("inf"))
            k = min(self.config.match_k, len(f) - 1)
            d.append(dist.topk(k, largest=False).values.mean(1))
        if not d:
            raise CacheError("cannot calibrate H: no class has two private samples; pass budget explicitly")
        h = float(torch.quantile(torch.cat(d), self.config.budget_quantile)) * self.config.budget_scale
        log.info("aegis cache: calibrated budget H = %.4g", h)
        return h

    def distances(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each candidate's mean squared feature distance to its ``match_k`` nearest same-label private
        samples (``inf`` for a label the client does not hold)."""
        f = (self._raw(images) - self.center) / self.spread
        out = torch.full((len(images),), float("inf"), dtype=torch.float64)
        for y in labels.unique():
            mine = self.feats[self.labels == y]
            if len(mine) == 0:
                continue
            sel = labels == y
            dist = torch.cdist(f[sel], mine).pow(2) / f.shape[1]
            out[sel] = dist.topk(min(self.config.match_k, len(mine)), largest=False).values.mean(1)
        return out

    def accept(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.distances(images, labels) <= self.budget


LEVERS = (
    "the levers: a larger budget (budget_scale or budget), a smaller cache (size M), more generator training "
    "steps or a generator trained on data closer to the clients', a filter that ignores another site's "
    "intensities (cache.normalize = 'per_image'), or the PCA generator (docs/defenses.md)"
)


def check_pilot(
    accepted: int, tried: int, config: CacheConfig, budget: float, kept: torch.Tensor, drawn: torch.Tensor
) -> None:
    """Raise :class:`CacheError` when the pilot's acceptance rate, even at its upper 95 % bound, cannot
    accept ``config.size`` candidates within the candidate budget (module docstring)."""
    limit = int(config.max_candidates_factor * config.size)
    upper = 1.0 if accepted == tried else float(beta.ppf(0.95, accepted + 1, tried - accepted))
    if upper * limit >= config.size:
        return
    classes = torch.unique(drawn)
    fidelity = ", ".join(
        f"{int(c)}: {int((kept == c).sum())}/{int((drawn == c).sum())}" for c in classes[:10]
    ) + (" ..." if len(classes) > 10 else "")
    raise CacheError(
        f"Aegis cannot fill its cache: the pilot draw accepted {accepted} of {tried} candidates "
        f"({accepted / tried:.1%}; at most {upper:.1%} at 95 % confidence), but {config.size} of at most "
        f"{limit} draws must pass (>= {config.size / limit:.1%}); H = {budget:.4g}; accepted per class "
        f"(accepted/drawn): {fidelity}; {LEVERS}"
    )


def build_cache(
    source: ConditionalGenerator,
    private: ImageDataset,
    config: CacheConfig,
    *,
    generator: torch.Generator,
    extractor: nn.Module | None = None,
) -> SyntheticCache:
    """Draw labelled candidates (labels ~ the client's label frequencies) until ``config.size`` pass the
    acceptance filter; raise :class:`CacheError` after the pilot draw when it shows the build cannot
    succeed (:func:`check_pilot`), else after ``max_candidates_factor * size`` candidates."""
    if tuple(source.image_shape) != private.input_shape:
        raise CacheError(f"generator makes {source.image_shape} images, the task needs {private.input_shape}")
    start = time.perf_counter()
    filt = AcceptanceFilter(private, config, extractor)
    counts = torch.bincount(private.labels, minlength=private.num_classes).to(torch.float64)
    limit = int(config.max_candidates_factor * config.size)
    imgs, labs, drawn, tried = [], [], [], 0
    accepted = 0
    pilot = min(config.pilot, limit)
    with bar(desc="Aegis cache", total=config.size, unit="img") as progress:
        while accepted < config.size:
            if tried >= limit:
                raise CacheError(
                    f"only {accepted} of {config.size} candidates accepted after {tried} draws "
                    f"(rejection rate {1 - accepted / tried:.1%}, H = {filt.budget:.4g}); {LEVERS}"
                )
            n = min(config.chunk, limit - tried, pilot - tried if tried < pilot else limit)
            y = torch.multinomial(counts, n, replacement=True, generator=generator)
            x = source.sample(y, generator=generator)
            if x.shape != (n, *private.input_shape) or not torch.isfinite(x).all():
                raise CacheError(f"generator returned {tuple(x.shape)} or non-finite values for {n} labels")
            ok = filt.accept(x, y)
            imgs.append(x[ok])
            labs.append(y[ok])
            accepted += int(ok.sum())
            progress.update(min(int(ok.sum()), config.size - progress.n))
            tried += n
            rate = accepted / tried
            eta = (
                (config.size - accepted) / rate * (time.perf_counter() - start) / tried if rate else math.inf
            )
            progress.set_postfix(tried=tried, rate=f"{rate:.1%}", eta=f"{eta:.0f}s")
            drawn.append(y)
            if tried == pilot and accepted < config.size:
                check_pilot(accepted, tried, config, filt.budget, torch.cat(labs), torch.cat(drawn))
    images, labels = torch.cat(imgs)[: config.size], torch.cat(labs)[: config.size]
    rejection = 1 - accepted / tried
    log.info(
        "aegis cache: %d accepted of %d candidates (rejection rate %.1f%%)", accepted, tried, 100 * rejection
    )
    stats = {"candidates": float(tried), "accepted": float(accepted), "rejection_rate": rejection,
             "budget": filt.budget, "seconds": time.perf_counter() - start}  # fmt: skip
    return SyntheticCache(images.contiguous(), labels.contiguous(), stats)
