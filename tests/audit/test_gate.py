"""The client's leakage gate (audit/gate.py): it measures the update's leakage above the floor as the report
does, defends above the threshold exactly as the configured defense does, withholds only when asked, and
fails closed when its attack gives no score."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from gradleak.audit.gate import LEAKAGE, GateConfig, LeakageGate
from gradleak.defenses.in_loop import build_defenses
from gradleak.metrics.floors import FLOORS
from gradleak.models import build_model
from gradleak.types import Update
from synthetic import synthetic_dataset

SHAPE, CLASSES = (1, 12, 12), 3
FAST = ("ig", {"max_iterations": 150})


def setup(batch: int = 1):
    """An MLP's FedSGD gradient on one image: its first layer holds delta x^T, which IG inverts."""
    model = build_model("mlp", SHAPE, CLASSES, seed=0, hidden=(32,))
    truth = synthetic_dataset(n=batch, shape=SHAPE, classes=CLASSES, seed=1)
    reference = synthetic_dataset(n=64, shape=SHAPE, classes=CLASSES, seed=2)
    model.zero_grad()
    F.cross_entropy(model(truth.images), truth.labels).backward()
    update = Update({n: p.grad.detach().clone() for n, p in model.named_parameters()}, batch, "gradient")
    return model, update, truth, reference


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_a_leaky_update_is_defended_exactly_as_the_defense_would():
    model, update, truth, reference = setup()
    gate = LeakageGate(
        GateConfig(FAST, threshold_db=3.0, defenses=[("pruning", {"ratio": 0.9})]), reference=reference
    )
    out, decision = gate.check(model, update, truth, generator=gen())
    assert decision.triggered and not decision.withheld
    assert decision.leakage_db is not None and decision.leakage_db > 3.0  # an MLP on one image leaks
    (pruning,) = build_defenses([("pruning", {"ratio": 0.9})])
    expected = pruning.on_update(update)
    for name, t in expected.tensors.items():
        torch.testing.assert_close(out.tensors[name], t, rtol=0, atol=0)
    assert gate.decisions == [decision]


def test_the_leakage_is_the_reports_psnr_above_the_higher_floor():
    model, update, truth, reference = setup()
    gate = LeakageGate(GateConfig(FAST), reference=reference)
    _, decision = gate.check(model, update, truth, generator=gen())
    record = decision.record
    floor = max(record[f"floor_{name}_psnr_mean"] for name in FLOORS)
    assert decision.leakage_db == pytest.approx(record["psnr_mean"] - floor, abs=1e-9)
    assert record[LEAKAGE] == decision.leakage_db


def test_below_the_threshold_the_update_leaves_unchanged():
    model, update, truth, reference = setup()
    gate = LeakageGate(GateConfig(FAST, threshold_db=1000.0), reference=reference)
    out, decision = gate.check(model, update, truth, generator=gen())
    assert not decision.triggered and out is update


def test_withholding_only_when_asked():
    model, update, truth, reference = setup()
    gate = LeakageGate(GateConfig(FAST, threshold_db=3.0, withhold=True), reference=reference)
    out, decision = gate.check(model, update, truth, generator=gen())
    assert out is None and decision.withheld


def test_an_attack_that_gives_no_score_fails_closed():
    model, _, truth, reference = setup()
    foreign = Update({"not.a.parameter": torch.ones(3)}, 1, "gradient")  # IG can read none of it
    gate = LeakageGate(
        GateConfig(FAST, threshold_db=3.0, defenses=[("pruning", {"ratio": 0.5})]), reference=reference
    )
    out, decision = gate.check(model, foreign, truth, generator=gen())
    assert decision.leakage_db is None and decision.triggered and out is not None
    assert float(out.tensors["not.a.parameter"].abs().sum()) == 2.0  # pruned: floor(0.5 * 3) = 1 entry zeroed


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"attack": ("robbing_the_fed", {})}, "malicious server"),
        ({"attack": ("dager", {})}, "image attack"),
        ({"defenses": [("soteria", {})]}, "inside training"),
        ({"defenses": []}, "must withhold"),
        ({"threshold_db": math.nan}, "threshold_db"),
    ],
)
def test_bad_config_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        GateConfig(**options)
