"""Outpost (defenses/outpost.py) against a slow, written-out reference of its step, its decay against the
stated probability, and its edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from gradleak.defenses.base import SetupContext
from gradleak.defenses.outpost import Outpost, OutpostConfig


def model_with_grads(seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Linear(10, 6), nn.ReLU(), nn.Linear(6, 3))
    for p in net.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.7
        p.grad = torch.randn(p.shape, generator=g)
    return net


def reference(net: nn.Module, config: OutpostConfig, generator: torch.Generator) -> list[torch.Tensor]:
    """The step written out with numpy percentiles (lower interpolation), the same draws in the same order."""
    if float(torch.rand((), generator=generator)) >= 1.0:  # step 0: always perturbed (p = 1)
        raise AssertionError
    grads = [p.grad.clone().double().numpy() for p in net.parameters()]
    fisher = np.concatenate([g.reshape(-1) ** 2 for g in grads])
    threshold = np.percentile(fisher, 100 - config.phi, method="lower")
    out = []
    for p, g in zip(net.parameters(), grads, strict=True):
        risk = min(float(np.var(p.detach().double().numpy(), ddof=1)), 1.0)
        informative = g**2 >= threshold
        cut = np.percentile(np.abs(g), config.prune, method="lower")
        pruned = np.where(np.abs(g) < cut, 0.0, g)
        noise = torch.randn(g.shape, generator=generator).double().numpy() * risk * config.noise
        out.append(torch.from_numpy(pruned + np.where(informative, noise, 0.0)))
    return out


def test_a_perturbed_step_matches_the_reference():
    config = OutpostConfig(phi=40, prune=80, noise=0.8)
    net = model_with_grads()
    want = reference(model_with_grads(), config, torch.Generator().manual_seed(3))
    defense = Outpost(config)
    defense.setup(net, SetupContext(torch.Generator().manual_seed(3)))
    defense.on_gradients(net, 0)
    for p, w in zip(net.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad.double(), w, rtol=1e-6, atol=1e-6)
    assert defense.perturbed == 1


def test_steps_are_perturbed_with_the_decaying_probability():
    """Over 4,000 seeded runs, step t is perturbed in 1 / (1 + beta t) of them (4 standard errors)."""
    config = OutpostConfig(beta=0.5, noise=0.0, prune=0.0)
    for t, p in ((1, 1 / 1.5), (6, 1 / 4.0)):
        hits = 0
        for seed in range(4000):
            d = Outpost(config)
            d.setup(nn.Module(), SetupContext(torch.Generator().manual_seed(seed)))
            d.on_gradients(model_with_grads(), t)
            hits += d.perturbed
        assert abs(hits / 4000 - p) < 4 * math.sqrt(p * (1 - p) / 4000)


def test_no_noise_and_no_pruning_leave_the_gradient_alone():
    net, before = model_with_grads(), model_with_grads()
    d = Outpost(OutpostConfig(noise=0.0, prune=0.0))
    d.setup(net, SetupContext(torch.Generator().manual_seed(0)))
    d.on_gradients(net, 0)
    for p, q in zip(net.parameters(), before.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_the_risk_is_capped_at_one():
    net = model_with_grads()
    for p in net.parameters():
        p.data.mul_(100)  # variance far above 1
    d = Outpost(OutpostConfig(phi=100, prune=0.0, noise=1.0))
    d.setup(net, SetupContext(torch.Generator().manual_seed(1)))
    before = [p.grad.clone() for p in net.parameters()]
    d.on_gradients(net, 0)
    added = torch.cat([(p.grad - b).reshape(-1) for p, b in zip(net.parameters(), before, strict=True)])
    assert abs(float(added.std()) - 1.0) < 0.15  # noise std = min(var, 1) * 1.0 over 87 coordinates


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"beta": -1.0}, "beta"),
        ({"phi": 0.0}, "phi"),
        ({"prune": 100.0}, "prune"),
        ({"noise": math.nan}, "noise"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        OutpostConfig(**options)
