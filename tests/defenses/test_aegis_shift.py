"""Aegis across sites (issue 56, item 2): the ``shifted`` data set applies its stated intensity transform,
and the acceptance filter's ``normalize = "per_image"`` judges a candidate on structure alone, so a generator
whose images are another site's (contrast, brightness, a stain's gain) fills the cache that the default
filter refuses in its pilot."""

from __future__ import annotations

import pytest
import torch

from gradleak.data import load_dataset
from gradleak.data.base import ImageDataset
from gradleak.data.shifted import ShiftedImages, shift
from gradleak.defenses.aegis.cache import AcceptanceFilter, CacheConfig, CacheError, build_cache
from gradleak.options import OptionError, build_dataclass
from gradleak.registry import DATASETS


def test_the_shifted_set_is_the_base_through_the_stated_transform() -> None:
    options = {"base": "organamnist", "contrast": 1.4, "gamma": 0.8, "brightness": -0.05}
    base = load_dataset("organamnist", "val", limit=20)
    moved = load_dataset("shifted", "val", limit=20, options=options)
    x = base.images.double()
    expected = (1.4 * (x.pow(0.8) - 0.5) + 0.5 - 0.05).clamp(0, 1)  # the docstring's formula, by hand
    torch.testing.assert_close(moved.images.double(), expected, rtol=0, atol=1e-6)
    assert torch.equal(moved.labels, base.labels) and moved.num_classes == base.num_classes
    rgb = load_dataset("shifted", None, limit=4, options={"base": "pathmnist", "gain": [1.2, 0.7, 1.0]})
    plain = load_dataset("pathmnist", None, limit=4)
    torch.testing.assert_close(rgb.images[:, 1], (0.7 * plain.images[:, 1]).clamp(0, 1), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "options, message",
    [({"base": "rotten_tomatoes"}, "not an image"), ({"base": "shifted"}, "base"), ({"base": "nope"}, "base"),
     ({"base": "organamnist", "contrast": 0}, "contrast"), ({"base": "organamnist", "gain": [1, -1]}, "gain"),
     ({"base": "organamnist", "gamma": float("nan")}, "gamma"), ({"base": "organamnist", "tint": 1}, "tint")],
)  # fmt: skip
def test_a_bad_shift_is_refused_by_name(options: dict, message: str) -> None:
    with pytest.raises((OptionError, ValueError), match=message):
        DATASETS.make_config("shifted", options)


def _site(seed: int) -> ImageDataset:
    """Two classes of smooth 12 x 12 images (a horizontal or a vertical ramp) with a little noise, in the
    mid-range of intensities, so a contrast change does not clip."""
    g = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(0.3, 0.7, 12)
    y = torch.arange(60) % 2
    base = torch.where(y[:, None, None] == 0, ramp.view(1, 1, 12), ramp.view(1, 12, 1)).unsqueeze(1)
    x = (base + 0.02 * torch.randn((60, 1, 12, 12), generator=g)).clamp(0, 1)
    return ImageDataset("site", x, y, 2)


class _OtherSite:
    """A perfect generator of another site: fresh images of the requested ramp, with the other site's
    contrast and brightness (a Fake ConditionalGenerator)."""

    image_shape, num_classes = (1, 12, 12), 2

    def __init__(self, contrast: float, brightness: float) -> None:
        self.config = ShiftedImages(base="organamnist", contrast=contrast, brightness=brightness)

    def sample(self, labels: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
        fresh = _site(int(torch.randint(0, 2**31, (1,), generator=generator)))
        picks = torch.stack([fresh.images[fresh.labels == y][0] for y in labels.tolist()])
        return shift(picks, self.config)


def test_per_image_features_ignore_an_affine_intensity_change() -> None:
    private, other = _site(0), _site(1)
    moved = shift(other.images, ShiftedImages(base="organamnist", contrast=1.5, brightness=0.05))
    for normalize, same in (("per_image", True), ("none", False)):
        filt = AcceptanceFilter(private, CacheConfig(normalize=normalize))
        a, b = filt.distances(other.images, other.labels), filt.distances(moved, other.labels)
        assert torch.allclose(a, b, rtol=1e-5) is same  # per-image: equal to float rounding
    with pytest.raises(OptionError, match="normalize"):
        build_dataclass(CacheConfig, {"normalize": "global"}, where="cache")


def test_another_sites_generator_fills_the_cache_only_with_the_per_image_filter() -> None:
    """The default filter's pilot measures the other site's images as out of distribution and refuses in
    seconds, naming the per-image lever; the per-image filter accepts them at the rate of the site's own."""
    private = _site(0)
    config = CacheConfig(size=64, pilot=64, chunk=32)
    with pytest.raises(CacheError, match=r"pilot draw accepted \d+ of 64") as err:
        build_cache(_OtherSite(1.6, 0.1), private, config, generator=torch.Generator().manual_seed(0))
    assert "normalize = 'per_image'" in str(err.value)
    per_image = CacheConfig(size=64, pilot=64, chunk=32, normalize="per_image")
    cache = build_cache(_OtherSite(1.6, 0.1), private, per_image, generator=torch.Generator().manual_seed(0))
    own = build_cache(_OtherSite(1.0, 0.0), private, per_image, generator=torch.Generator().manual_seed(0))
    assert len(cache) == 64 and cache.stats["rejection_rate"] <= own.stats["rejection_rate"] + 0.15
