"""A quality gate for Aegis' generators that a user can read: is the synthetic cache in distribution, of the
right class, and not a copy of the private images?

Per class, for any :class:`~gradleak.defenses.aegis.generators.ConditionalGenerator`:

- **class fidelity**: the share of the generated images of class ``y`` that a classifier trained on real
  images labels ``y`` (chance is ``1 / K``); the classifier's accuracy on held-out real images is the
  ceiling;
- **Frechet distance** (the FID formula of Heusel et al. 2017, eq. 6:
  ``||mu_r - mu_g||^2 + Tr(S_r + S_g - 2 (S_r S_g)^(1/2))``) between the generated and held-out real images
  in that classifier's penultimate feature space (no Inception weights offline, and 28 x 28 medical images
  are not ImageNet's), projected on the ``feature_dims`` principal directions of the held-out features so
  that a few hundred samples per class estimate the covariances (the value still grows as samples shrink:
  compare generators at the same ``samples_per_class``);
- **memorisation**: each generated image's distance to its nearest training image (pixel RMS) against the
  same distance for held-out real images. An image closer to the training set than the ``copy_quantile``
  of the held-out images' distances counts as a copy; a generator whose copy rate exceeds ``max_copy_rate``
  is flagged: copying private images into the cache would defeat the defense (paper 000, Limitations).
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch
from scipy import linalg
from torch import nn
from torch.nn import functional as F

from gradleak.data.base import ImageDataset
from gradleak.defenses.aegis.generators.base import ConditionalGenerator
from gradleak.progress import bar

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QualityConfig:
    """``samples_per_class`` generated images per class; the reference classifier: the registered model
    ``classifier`` trained ``classifier_epochs`` epochs (Adam, ``lr``, batch 64) on the training images;
    memorisation: ``copy_quantile`` of the held-out images' nearest-training distances, flag above
    ``max_copy_rate``; ``seed`` for the classifier and the samples."""

    samples_per_class: int = 200
    classifier: str = "aegis_cnn"
    classifier_epochs: int = 5
    lr: float = 1e-3
    copy_quantile: float = 0.01
    max_copy_rate: float = 0.05
    feature_dims: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("samples_per_class", "classifier_epochs", "feature_dims"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} must be an int >= 1, got {v!r}")
        if not 0 < self.copy_quantile < 1 or not 0 <= self.max_copy_rate <= 1:
            raise ValueError("copy_quantile must be in (0, 1) and max_copy_rate in [0, 1]")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass(frozen=True)
class ClassQuality:
    label: int
    samples: int
    accuracy: float  # share classified as the requested class
    frechet: float  # to held-out real images of the class, classifier features
    nn_distance: float  # median distance to the nearest training image (pixel RMS)
    copy_rate: float  # share closer to the training set than the copy threshold


@dataclass(frozen=True)
class QualityReport:
    """One generator's gate: per class and overall (means over classes, weighted equally)."""

    name: str
    classes: tuple[ClassQuality, ...]
    accuracy: float
    frechet: float
    nn_distance: float
    copy_rate: float
    copy_threshold: float
    memorised: bool  # copy_rate > max_copy_rate

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class Reference:
    """What every generator is scored against: a classifier trained on real images (``classifier_data``)
    and the held-out real images' features per class. Memorisation is checked against the images each
    generator was fit on (``private`` in :meth:`score`)."""

    def __init__(self, classifier_data: ImageDataset, heldout: ImageDataset, config: QualityConfig) -> None:
        if (
            classifier_data.input_shape != heldout.input_shape
            or classifier_data.num_classes != heldout.num_classes
        ):
            raise ValueError(
                "the classifier's training images and the held-out images must share shape and classes"
            )
        self.config, self.heldout = config, heldout
        self.classifier = train_classifier(classifier_data, config)
        hits = self.predict(heldout.images) == heldout.labels
        self.real_accuracy = float(hits.float().mean())
        self.class_accuracy = {
            int(y): float(hits[heldout.labels == y].float().mean()) for y in heldout.labels.unique()
        }
        self._penultimate = _Penultimate(self.classifier)
        raw = self._penultimate(heldout.images)
        self._center = raw.mean(0)
        self._basis = torch.linalg.svd(raw - self._center, full_matrices=False)[2][: config.feature_dims].T
        feats = self.features(heldout.images)
        self.real = {int(y): feats[heldout.labels == y] for y in heldout.labels.unique()}
        log.info("quality reference: classifier accuracy %.3f on held-out real images", self.real_accuracy)

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.classifier(x).argmax(1) for x in images.split(512)])

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Penultimate features on the held-out images' top ``feature_dims`` principal directions."""
        return (self._penultimate(images) - self._center) @ self._basis

    def copy_threshold(self, private: ImageDataset) -> float:
        """The ``copy_quantile`` of the held-out real images' distances to their nearest ``private`` image."""
        return float(
            torch.quantile(nearest_distance(self.heldout.images, private.images), self.config.copy_quantile)
        )

    def score(
        self,
        name: str,
        source: ConditionalGenerator,
        private: ImageDataset,
        *,
        classes: list[int] | None = None,
    ) -> QualityReport:
        """Generate ``samples_per_class`` images of each class (default: the classes of ``private``, the
        images the generator was fit on) and score them; copies are judged against ``private``."""
        cfg = self.config
        threshold = self.copy_threshold(private)
        g = torch.Generator().manual_seed(cfg.seed)
        rows = []
        chosen = classes if classes is not None else sorted(int(v) for v in private.labels.unique())
        for y in bar(chosen, desc=f"quality {name}"):
            labels = torch.full((cfg.samples_per_class,), y, dtype=torch.int64)
            rows.append(self._class_row(y, source.sample(labels, generator=g), private, threshold))
        mean = lambda key: float(np.nanmean([getattr(r, key) for r in rows]))  # noqa: E731
        copy_rate = mean("copy_rate")
        return QualityReport(
            name,
            tuple(rows),
            mean("accuracy"),
            mean("frechet"),
            mean("nn_distance"),
            copy_rate,
            threshold,
            copy_rate > cfg.max_copy_rate,
        )

    def _class_row(
        self, y: int, images: torch.Tensor, private: ImageDataset, threshold: float
    ) -> ClassQuality:
        n = len(images)  # rates as exact counts over n (a float32 mean put 5 copies of 100 above 5 %)
        accuracy = int((self.predict(images) == y).sum()) / n
        real = self.real.get(y)
        frechet = (
            frechet_distance(self.features(images), real) if real is not None and len(real) > 1 else math.nan
        )
        nn_dist = nearest_distance(images, private.images)
        return ClassQuality(
            y,
            len(images),
            accuracy,
            frechet,
            float(nn_dist.median()),
            int((nn_dist < threshold).sum()) / n,
        )


def train_classifier(data: ImageDataset, config: QualityConfig) -> nn.Module:
    """The reference classifier: the registered model trained on real images (seeded, shuffled batches)."""
    from gradleak.models import build_model

    model = build_model(config.classifier, data.input_shape, data.num_classes, seed=config.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    g = torch.Generator().manual_seed(config.seed)
    model.train()
    for _ in bar(range(config.classifier_epochs), desc="quality classifier"):
        for idx in torch.randperm(len(data), generator=g).split(64):
            loss = F.cross_entropy(model(data.images[idx]), data.labels[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return model.eval().requires_grad_(False)


class _Penultimate:
    """The input of the model's last linear layer (its penultimate features)."""

    def __init__(self, model: nn.Module) -> None:
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise ValueError("the reference classifier has no linear layer to read features before")
        self.model, self.last = model, linears[-1]

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        out: list[torch.Tensor] = []
        handle = self.last.register_forward_pre_hook(lambda _m, args: out.append(args[0].flatten(1)))
        try:
            for x in images.split(512):
                self.model(x)
        finally:
            handle.remove()
        return torch.cat(out).to(torch.float64)


def frechet_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2))`` of two feature sets ``(N, D)``."""
    a64, b64 = a.to(torch.float64).numpy(), b.to(torch.float64).numpy()
    mu_a, mu_b = a64.mean(0), b64.mean(0)
    s_a, s_b = np.atleast_2d(np.cov(a64, rowvar=False)), np.atleast_2d(np.cov(b64, rowvar=False))
    with warnings.catch_warnings():  # a singular covariance (few samples) is expected and still defined
        warnings.simplefilter("ignore", linalg.LinAlgWarning)
        root = np.real(linalg.sqrtm(s_a @ s_b))  # imaginary parts are rounding (a product of PSD matrices)
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(s_a + s_b - 2 * root))


def nearest_distance(images: torch.Tensor, train: torch.Tensor) -> torch.Tensor:
    """Each image's distance to its nearest training image, pixel RMS (``||x - t|| / sqrt(C H W)``)."""
    t = train.flatten(1).to(torch.float64)
    dims = t.shape[1]
    out = [torch.cdist(x.flatten(1).to(torch.float64), t).min(1).values for x in images.split(256)]
    return torch.cat(out) / math.sqrt(dims)


@dataclass(frozen=True)
class TrainingGate:
    """When a generator's training may stop (issue 56): its length chosen by the quality of its samples, not
    by a step count tuned on one data set. The training images are split (per class, seeded) into
    ``1 - heldout`` that the generator trains on and ``heldout`` that it never sees; a :class:`Reference`
    classifier is trained on the first, and its accuracy on the held-out images bounds the fidelity.
    At every step that is a multiple of ``every`` and at least ``min_steps``, and at the cap, the EMA weights
    sample ``samples_per_class`` images of each held-out class and are scored: training stops at the first
    check whose mean class fidelity is at least ``fidelity`` x the ceiling (the classifier's mean per-class
    accuracy on the held-out images of the same classes, weighted as the fidelity is) and, when ``frechet``
    is set, whose mean Frechet distance to the held-out images is at most ``frechet`` (compare only at the
    same ``samples_per_class``). Each check also records the copy rate (memorisation, not enforced: the
    quality report's ``memorised`` flag is the gate for that). The training config's ``steps`` is then the
    cap, and its cosine learning-rate decay runs over the cap. A generator that reaches the cap without
    passing is kept and says so (``info["gate"]``); Aegis' pilot draw then measures whether its samples fill
    the cache."""

    every: int = 500
    min_steps: int = 0
    fidelity: float = 0.9
    frechet: float | None = None
    heldout: float = 0.1
    samples_per_class: int = 16
    classifier_epochs: int = 5

    def __post_init__(self) -> None:
        for key in ("every", "samples_per_class", "classifier_epochs"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"gate {key} must be an int >= 1, got {v!r}")
        if isinstance(self.min_steps, bool) or not isinstance(self.min_steps, int) or self.min_steps < 0:
            raise ValueError(f"gate min_steps must be an int >= 0, got {self.min_steps!r}")
        if isinstance(self.fidelity, bool) or not isinstance(self.fidelity, int | float):
            raise ValueError(f"gate fidelity must be a number in (0, 1], got {self.fidelity!r}")
        if not 0 < self.fidelity <= 1:
            raise ValueError(f"gate fidelity must be in (0, 1] (a share of the ceiling), got {self.fidelity}")
        number = isinstance(self.frechet, int | float) and not isinstance(self.frechet, bool)
        if self.frechet is not None and (not number or not self.frechet > 0):
            raise ValueError(f"gate frechet must be a number > 0 or None, got {self.frechet!r}")
        if isinstance(self.heldout, bool) or not isinstance(self.heldout, float) or not 0 < self.heldout < 1:
            raise ValueError(f"gate heldout must be a share in (0, 1), got {self.heldout!r}")
        object.__setattr__(self, "fidelity", float(self.fidelity))  # 1 and 1.0: one config, one stored name
        if self.frechet is not None:
            object.__setattr__(self, "frechet", float(self.frechet))

    def quality(self, seed: int) -> QualityConfig:
        return QualityConfig(
            samples_per_class=self.samples_per_class, classifier_epochs=self.classifier_epochs, seed=seed
        )

    def due(self, step: int, cap: int) -> bool:
        """Whether training checks the gate after ``step`` of ``cap`` steps."""
        return step == cap or (step >= self.min_steps and step % self.every == 0)

    def passed(self, report: QualityReport, ceiling: float) -> bool:
        """Whether ``report`` passes: fidelity against ``fidelity x ceiling`` and the optional Frechet bound
        (a NaN score never passes)."""
        if not report.accuracy >= self.fidelity * ceiling:
            return False
        return self.frechet is None or report.frechet <= self.frechet


def split_heldout(
    data: ImageDataset, share: float, generator: torch.Generator
) -> tuple[ImageDataset, ImageDataset]:
    """``data`` split per class into (train, held out): ``round(share x n)`` of a class's n images, at least
    one and at most n - 1, held out of every class with two or more (every class keeps an image in
    training, so the generator can still sample it); refused when nothing would be held out."""
    train: list[int] = []
    held: list[int] = []
    for y in sorted(int(v) for v in data.labels.unique()):
        idx = torch.nonzero(data.labels == y).flatten()
        idx = idx[torch.randperm(len(idx), generator=generator)]
        k = min(max(1, round(share * len(idx))), len(idx) - 1) if len(idx) >= 2 else 0  # one stays
        held += idx[:k].tolist()
        train += idx[k:].tolist()
    if not held:
        raise ValueError("the quality gate needs a class with two or more images to hold one out")
    return data.subset(sorted(train)), data.subset(sorted(held))
