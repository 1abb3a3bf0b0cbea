"""Built-in class-conditional generator and the in-distribution acceptance filter (paper 000, cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from gradleak.data import load_dataset
from gradleak.defenses.aegis.cache import AcceptanceFilter, CacheConfig, CacheError, build_cache
from gradleak.defenses.aegis.generators import ClassGaussianGenerator, ConditionalGenerator, align_images


@pytest.fixture(scope="module")
def organ() -> tuple:
    d = load_dataset("organamnist", "train", limit=6000)
    return d.subset(np.arange(3000)), d.subset(np.arange(3000, 6000))


def test_generated_images_are_labelled_as_requested(organ: tuple) -> None:
    train, held = organ
    torch.manual_seed(0)
    clf = torch.nn.Linear(28 * 28, 11)  # a softmax classifier trained on real images only
    opt = torch.optim.Adam(clf.parameters(), lr=0.01)
    for _ in range(300):
        opt.zero_grad()
        F.cross_entropy(clf(train.images.flatten(1)), train.labels).backward()
        opt.step()
    real_acc = float((clf(held.images.flatten(1)).argmax(1) == held.labels).float().mean())
    gen = ClassGaussianGenerator.fit(train)
    assert isinstance(gen, ConditionalGenerator)
    labels = torch.tensor(gen.classes).repeat_interleave(40)
    x = gen.sample(labels, generator=torch.Generator().manual_seed(0))
    assert x.shape == (len(labels), 1, 28, 28) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
    acc = float((clf(x.flatten(1)).argmax(1) == labels).float().mean())
    assert real_acc > 0.5 and acc > 0.5, (real_acc, acc)  # chance is 1/11


def test_generator_refuses_unknown_classes(organ: tuple) -> None:
    train, _ = organ
    gen = ClassGaussianGenerator.fit(train.subset(np.flatnonzero(train.labels.numpy() < 3)))
    with pytest.raises(ValueError, match="not fit on classes"):
        gen.sample(torch.tensor([5]), generator=torch.Generator())


def test_acceptance_rejects_noise_and_keeps_real_images(organ: tuple) -> None:
    train, held = organ
    private = train.subset(np.arange(400))
    filt = AcceptanceFilter(private, CacheConfig())
    labels = private.labels[torch.arange(500) % 400]
    assert float(filt.accept(torch.rand(500, 1, 28, 28), labels).float().mean()) < 0.05
    keep = held.subset(np.flatnonzero(np.isin(held.labels.numpy(), private.labels.unique().numpy()))[:500])
    assert float(filt.accept(keep.images, keep.labels).float().mean()) > 0.7


class NoiseGenerator:
    image_shape = (1, 28, 28)
    num_classes = 11

    def sample(self, labels: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
        return torch.rand(len(labels), *self.image_shape, generator=generator)


def test_build_cache_logs_rejection_and_fails_clearly(organ: tuple) -> None:
    private = organ[0].subset(np.arange(400))
    cache = build_cache(ClassGaussianGenerator.fit(private), private, CacheConfig(size=256),
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert len(cache) == 256 and 0 <= cache.stats["rejection_rate"] < 0.5
    assert set(cache.labels.unique().tolist()) <= set(private.labels.unique().tolist())
    with pytest.raises(CacheError, match="accepted after 128 draws"):  # without a pilot: the whole budget
        build_cache(NoiseGenerator(), private, CacheConfig(size=64, max_candidates_factor=2, pilot=0),
                    generator=torch.Generator())  # fmt: skip


def test_align_images_matches_task_layout() -> None:
    rgb = torch.rand(2, 3, 64, 64)
    out = align_images(rgb * 1.5, (1, 28, 28))
    assert out.shape == (2, 1, 28, 28) and out.max() <= 1
    assert align_images(torch.rand(2, 1, 28, 28), (3, 28, 28)).shape == (2, 3, 28, 28)
