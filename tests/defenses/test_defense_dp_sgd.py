"""dp_sgd (Opacus): every sample's gradient clipped to C, the sum noised with N(0, (sigma C)^2), divided by
B; epsilon from Opacus' accountant for the steps taken; checked against a slow per-sample loop."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradleak.defenses import DefenseFailure
from gradleak.defenses.dp_sgd import DPSGD, DPSGDConfig, epsilon, epsilon_over_rounds
from gradleak.defenses.in_loop import defend
from gradleak.registry import DEFENSES

B, N = 8, 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, 1, 8, 8, generator=g) * 3, torch.randint(0, 3, (B,), generator=g)


def _sgd_loop(model: nn.Module, defense: DPSGD):
    gen = torch.Generator().manual_seed(0)
    return defend(model, lambda ps: torch.optim.SGD(ps, lr=0.1), [defense], generator=gen,
                  train_data=range(N), copy_model=True)  # fmt: skip


def _per_sample_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float) -> dict:
    """The slow obvious DP-SGD mean: one backward per sample, each clipped to ``clip``, averaged."""
    out = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    norms = []
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in g.values()))
        norms.append(norm)
        for n in out:
            out[n] += g[n] * min(1.0, clip / (norm + 1e-6)) / len(x)
    return {"grads": out, "norms": norms}


@pytest.mark.parametrize("clip", [0.05, 1e6])  # every sample clipped / none
def test_gradient_is_the_mean_of_per_sample_clipped_gradients(clip):
    model, (x, y) = _model(), _batch()
    ref = _per_sample_reference(model, x, y, clip)
    if clip < 1:
        assert min(ref["norms"]) > clip  # the case clips every sample
    loop = defend(model, None, [DPSGD(DPSGDConfig(clip=clip, noise_multiplier=0.0))],
                  generator=torch.Generator().manual_seed(0), train_data=range(N),
                  copy_model=True)  # fmt: skip
    nn.functional.cross_entropy(loop.model(x), y).backward()
    update = loop.gradient(B)
    for n, want in ref["grads"].items():
        torch.testing.assert_close(update.tensors[n], want, rtol=1e-4, atol=1e-8)
    total = math.sqrt(sum(float(t.double().pow(2).sum()) for t in update.tensors.values()))
    assert total <= clip + 1e-6  # the mean of vectors of norm <= C has norm <= C
    # Opacus' hooks and attributes are gone from the user's model copy after the update
    assert not any(hasattr(p, "grad_sample") for p in loop.model.parameters())
    assert not loop.model._forward_hooks and not loop.model._forward_pre_hooks


def test_noise_is_sigma_c_over_b_and_seeded():
    model, (x, y) = _model(), _batch()
    clip, sigma = 0.05, 2.0

    stated: list[object] = []

    def defended(seed: int) -> torch.Tensor:
        d = DPSGD(DPSGDConfig(clip=clip, noise_multiplier=sigma))
        loop = defend(model, None, [d], generator=torch.Generator().manual_seed(seed), train_data=range(N),
                      copy_model=True)  # fmt: skip
        nn.functional.cross_entropy(loop.model(x), y).backward()
        update = loop.gradient(B)
        stated.append(update.metadata.get("dp_sgd/noise_std"))
        return update.flat()

    clean = torch.cat([g.reshape(-1) for g in _per_sample_reference(model, x, y, clip)["grads"].values()])
    noise = defended(5) - clean
    # 451 draws of N(0, (sigma C / B)^2): the sample sd is within 10 % with probability > 0.99
    # (the sd of the sample sd is about 3.3 %)
    assert float(noise.std()) == pytest.approx(sigma * clip / B, rel=0.1)
    assert torch.equal(defended(5), defended(5)) and not torch.equal(defended(5), defended(6))
    # a one-step FedSGD gradient states its noise scale (what a noise-aware attack is told)
    assert stated[0] == pytest.approx(sigma * clip / B, rel=1e-12)


def test_epsilon_is_the_accountants_for_the_recorded_steps():
    from opacus.accountants import RDPAccountant

    model, (x, y) = _model(), _batch()
    d = DPSGD(DPSGDConfig(clip=1.0, noise_multiplier=1.1, delta=1e-5))
    loop = _sgd_loop(model, d)
    for _ in range(5):
        loop.optimizer.zero_grad()
        nn.functional.cross_entropy(loop.model(x), y).backward()
        loop.optimizer.step()
    meta = loop.update(N).metadata
    acc = RDPAccountant()
    for _ in range(5):
        acc.step(noise_multiplier=1.1, sample_rate=B / N)
    assert meta["dp_sgd/steps"] == 5 and meta["dp_sgd/sample_rate"] == B / N
    assert meta["dp_sgd/epsilon"] == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-9)
    assert 0 < meta["dp_sgd/epsilon"] < math.inf
    # two rounds of 5 steps compose to the accountant's 10 steps, more than one round
    from gradleak.types import Update

    u = Update({"w": torch.zeros(1)}, N, metadata=meta)
    assert epsilon_over_rounds([u, u]) == pytest.approx(epsilon(1.1, B / N, 10, 1e-5), rel=1e-9)
    assert epsilon_over_rounds([u, u]) > meta["dp_sgd/epsilon"]


def test_target_epsilon_is_spent_over_the_budget_and_a_step_past_it_fails_closed():
    model, (x, y) = _model(), _batch()
    d = DPSGD(DPSGDConfig(clip=1.0, target_epsilon=2.0, budget_steps=3, delta=1e-5))
    loop = _sgd_loop(model, d)
    for _ in range(3):
        loop.optimizer.zero_grad()
        nn.functional.cross_entropy(loop.model(x), y).backward()
        loop.optimizer.step()
    assert d.spent() == pytest.approx(2.0, rel=0.02)  # Opacus' search tolerance is 0.01 in epsilon
    loop.optimizer.zero_grad()
    nn.functional.cross_entropy(loop.model(x), y).backward()
    with pytest.raises(DefenseFailure, match="budget"):
        loop.optimizer.step()
    with pytest.raises(DefenseFailure):  # sticky: nothing leaves after the failure
        loop.update(N)


def test_sample_rate_is_from_the_data_training_draws_from_not_the_whole_share():
    model, (x, y) = _model(), _batch()
    d = DPSGD(DPSGDConfig(noise_multiplier=1.0))
    loop = defend(model, None, [d], generator=torch.Generator().manual_seed(0), data=range(1000),
                  train_data=range(16), copy_model=True)  # fmt: skip
    nn.functional.cross_entropy(loop.model(x), y).backward()
    assert loop.gradient(B).metadata["dp_sgd/sample_rate"] == B / 16


def test_batchnorm_and_unknown_data_size_are_refused_closed():
    bn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(72, 3))
    with pytest.raises(DefenseFailure, match="BatchNorm"):
        defend(bn, None, ["dp_sgd"], generator=torch.Generator(), train_data=range(N), copy_model=True)
    with pytest.raises(DefenseFailure, match="sample_rate"):
        defend(_model(), None, ["dp_sgd"], generator=torch.Generator(), copy_model=True)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"target_epsilon": 1.0}, "budget_steps"),
        ({"target_epsilon": 1.0, "budget_steps": 1, "noise_multiplier": 1.0}, "not both"),
        ({"clip": 0.0}, "clip"),
        ({"accountant": "moments"}, "accountant"),
        ({"delta": 1.0}, "delta"),
    ],
)
def test_bad_settings_are_refused_on_construction(options, match):
    with pytest.raises(ValueError, match=match):
        DEFENSES.create("dp_sgd", **options)


def test_the_old_name_dp_noise_says_what_it_was_renamed_to():
    with pytest.raises(KeyError, match="renamed 'batch_noise'.*not DP-SGD.*dp_sgd"):
        DEFENSES.create("dp_noise")
