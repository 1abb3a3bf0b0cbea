"""The truth-free indicator (audit/indicator.py): the fit margin over a norm-matched null update separates
an update that carries an image from one that carries noise, and the pipeline records it without truth."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gradleak.attacks import create_attack
from gradleak.attacks.text.baseline import null_observation
from gradleak.audit.indicator import fit_margin
from gradleak.audit.pipeline import attack_update
from gradleak.experiments.indicator_trials import auc
from gradleak.models import build_model
from gradleak.spec import ComponentSpec
from gradleak.types import Observation, Reconstruction, Update
from synthetic import synthetic_dataset

SHAPE = (1, 12, 12)
IG = ("ig", {"max_iterations": 150})


def observation() -> Observation:
    """An MLP's gradient on one image: IG fits it almost exactly (cosine distance near 0)."""
    model = build_model("mlp", SHAPE, 3, seed=0, hidden=(32,))
    truth = synthetic_dataset(n=1, shape=SHAPE, classes=3, seed=1)
    model.zero_grad()
    F.cross_entropy(model(truth.images), truth.labels).backward()
    update = Update({n: p.grad.detach().clone() for n, p in model.named_parameters()}, 1, "gradient")
    return Observation(model, update, SHAPE, 3, labels=truth.labels)


def test_the_margin_separates_a_real_update_from_noise():
    """Real: the attack's loss is near 0 and noise's near 0.9, margin > 0.5 on every seed; an update that is
    itself noise: |margin| < 0.2 (measured 0.88-0.96 and 0.02-0.07 over three seeds)."""
    attack = create_attack(*IG[:1], **IG[1])
    obs = observation()

    def margin(o: Observation, seed: int, null_seed: int) -> dict:
        rec = attack.reconstruct(o, generator=torch.Generator().manual_seed(seed))
        return fit_margin(attack, o, rec, torch.Generator().manual_seed(null_seed))

    for seed in range(3):
        real = margin(obs, seed, 10 + seed)
        null = margin(null_observation(obs, torch.Generator().manual_seed(99 + seed)), seed, 20 + seed)
        assert real["fit_margin"] > 0.5 and abs(null["fit_margin"]) < 0.2, (real, null)


def test_the_pipeline_records_it_without_truth_and_not_for_an_attack_without_a_fit():
    obs = observation()
    record = attack_update(create_attack(*IG[:1], **IG[1]), ComponentSpec(*IG), obs,
                           generator=torch.Generator().manual_seed(0),
                           null_generator=torch.Generator().manual_seed(1)).record  # fmt: skip
    assert record["fit_margin"] == record["null_matching_loss"] - record["matching_loss"]
    assert (
        fit_margin(create_attack("ig"), obs, Reconstruction(images=obs.model and None), torch.Generator())
        == {}
    )


def test_auc_is_the_mann_whitney_probability():
    assert auc([3.0, 2.0], [1.0, 2.0]) == (1 + 1 + 1 + 0.5) / 4
    assert auc([], [1.0]) is None
