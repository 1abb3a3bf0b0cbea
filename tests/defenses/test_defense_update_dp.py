"""update_noise: the whole update clipped to L2 norm C (exactly), then N(0, (sigma C)^2) per entry."""

from __future__ import annotations

import math

import pytest
import torch

from gradleak.defenses.base import SetupContext
from gradleak.registry import DEFENSES
from gradleak.types import Update


def _update(scale: float) -> Update:
    g = torch.Generator().manual_seed(0)
    return Update(
        {"a": torch.randn(300, generator=g) * scale, "b": torch.randn(20, 5, generator=g) * scale}, 8
    )


def _norm(u: Update) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in u.tensors.values()))


@pytest.mark.parametrize("scale", [0.01, 10.0])
def test_clipping_is_exact_and_leaves_small_updates_alone(scale):
    d = DEFENSES.create("update_noise", clip=1.0, sigma=0.0)
    d.setup(torch.nn.Module(), SetupContext(torch.Generator()))
    u = _update(scale)
    out = d.on_update(u)
    factor = min(1.0, 1.0 / _norm(u))  # the slow obvious way
    for n, t in u.tensors.items():
        torch.testing.assert_close(out.tensors[n], t * factor, rtol=1e-6, atol=1e-9)
    assert _norm(out) == pytest.approx(min(_norm(u), 1.0), rel=1e-6)


def test_noise_has_the_stated_scale_and_is_seeded():
    d = DEFENSES.create("update_noise", clip=0.5, sigma=2.0)
    zero = Update({"w": torch.zeros(200_000)}, 4)
    d.setup(torch.nn.Module(), SetupContext(torch.Generator().manual_seed(3)))
    noise = d.on_update(zero).tensors["w"]
    # sample sd of 200k N(0, 1) draws is within 1 % of 1 with overwhelming probability (sd of sd ~ 0.16 %)
    assert float(noise.std()) == pytest.approx(2.0 * 0.5, rel=0.01) and abs(float(noise.mean())) < 0.01
    d.setup(torch.nn.Module(), SetupContext(torch.Generator().manual_seed(3)))
    assert torch.equal(d.on_update(zero).tensors["w"], noise)  # same seed, same noise


def test_without_setup_it_fails_rather_than_sending_unnoised():
    d = DEFENSES.create("update_noise")
    with pytest.raises(RuntimeError, match="setup"):
        d.on_update(_update(1.0))
    with pytest.raises(ValueError, match="finite"):
        DEFENSES.create("update_noise", sigma=math.inf)


def test_epsilon_delta_give_flowers_local_dp_noise_and_are_recorded():
    # Flower's LocalDpMod: s = sensitivity * sqrt(2 ln(1.25 / delta)) / epsilon; sensitivity 2C by default
    d = DEFENSES.create("update_noise", clip=0.5, epsilon=0.5, delta=1e-5)
    expected = 2 * 0.5 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 0.5
    assert d.config.std == pytest.approx(expected, rel=1e-12)
    d.setup(torch.nn.Module(), SetupContext(torch.Generator().manual_seed(1)))
    out = d.on_update(Update({"w": torch.zeros(200_000)}, 4))
    assert float(out.tensors["w"].std()) == pytest.approx(expected, rel=0.01)
    meta = out.metadata
    assert meta["update_noise/epsilon"] == 0.5 and meta["update_noise/delta"] == 1e-5
    assert meta["update_noise/sensitivity"] == 1.0 and meta["update_noise/noise_std"] == pytest.approx(
        expected
    )
    own = DEFENSES.create("update_noise", clip=0.5, epsilon=0.5, delta=1e-5, sensitivity=0.5)
    assert own.config.std == pytest.approx(expected / 2, rel=1e-12)  # the user's stated sensitivity


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"epsilon": 2.0, "delta": 1e-5}, "classic Gaussian"),  # the bound holds for epsilon < 1 only
        ({"epsilon": 0.5}, "delta"),
        ({"epsilon": 0.5, "delta": 1e-5, "sigma": 1.0}, "not both"),
        ({"delta": 1e-5}, "give epsilon"),
        ({"epsilon": 0.5, "delta": 1e-5, "sensitivity": 0.0}, "sensitivity"),
    ],
)
def test_bad_epsilon_settings_are_refused_before_any_work(options, match):
    with pytest.raises(ValueError, match=match):
        DEFENSES.create("update_noise", **options)
