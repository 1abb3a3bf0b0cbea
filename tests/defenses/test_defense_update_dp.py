"""update_noise: the whole update clipped to L2 norm C (exactly), then N(0, (sigma C)^2) per entry."""

from __future__ import annotations

import math

import pytest
import torch

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
    d.setup(torch.nn.Module(), generator=torch.Generator())
    u = _update(scale)
    out = d.on_update(u)
    factor = min(1.0, 1.0 / _norm(u))  # the slow obvious way
    for n, t in u.tensors.items():
        torch.testing.assert_close(out.tensors[n], t * factor, rtol=1e-6, atol=1e-9)
    assert _norm(out) == pytest.approx(min(_norm(u), 1.0), rel=1e-6)


def test_noise_has_the_stated_scale_and_is_seeded():
    d = DEFENSES.create("update_noise", clip=0.5, sigma=2.0)
    zero = Update({"w": torch.zeros(200_000)}, 4)
    d.setup(torch.nn.Module(), generator=torch.Generator().manual_seed(3))
    noise = d.on_update(zero).tensors["w"]
    # sample sd of 200k N(0, 1) draws is within 1 % of 1 with overwhelming probability (sd of sd ~ 0.16 %)
    assert float(noise.std()) == pytest.approx(2.0 * 0.5, rel=0.01) and abs(float(noise.mean())) < 0.01
    d.setup(torch.nn.Module(), generator=torch.Generator().manual_seed(3))
    assert torch.equal(d.on_update(zero).tensors["w"], noise)  # same seed, same noise


def test_without_setup_it_fails_rather_than_sending_unnoised():
    d = DEFENSES.create("update_noise")
    with pytest.raises(RuntimeError, match="setup"):
        d.on_update(_update(1.0))
    with pytest.raises(ValueError, match="finite"):
        DEFENSES.create("update_noise", sigma=math.inf)
