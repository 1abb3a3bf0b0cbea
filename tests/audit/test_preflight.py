"""Checks before round 1 (:mod:`gradleak.audit.preflight`): an attack that cannot read the update it will
see, a recipe it needs and does not have, a text attack on an image model, images outside [0, 1] (a model
that normalises in the data pipeline) are errors before any work; a small budget is a warning; a check
that breaks is itself an error. The Flower wrapper runs them when it is built (before: the normalisation
mismatch stopped the ServerApp inside round 1's aggregation), ``gradleak check`` on a config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradleak.audit.preflight import CHECKS, NORMALISE, Preflight, PreflightError, register_check, run_checks
from gradleak.cli import main
from gradleak.models import build_model
from gradleak.spec import ComponentSpec

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "src" / "gradleak" / "experiments" / "demo.toml"
SHAPE, CLASSES = (1, 12, 12), 3


def model():
    return build_model("sme_cnn", SHAPE, CLASSES, seed=0)


def findings(attacks, kind="delta", known=True, images=None):
    specs = [ComponentSpec(a) if isinstance(a, str) else ComponentSpec(*a) for a in attacks]
    return run_checks(Preflight(specs, model(), kind, known, images))


def test_each_mismatch_is_an_error_before_work_and_a_small_budget_a_warning():
    assert findings(["ig", "pisme"]) == []
    (f,) = findings(["pisme"], kind="gradient")
    assert f.level == "error" and "pisme reads delta updates, but this audit sees a gradient" in f.message
    (f,) = findings(["sme"], known=False)
    assert f.level == "error" and "needs the clients' training recipe" in f.message
    (f,) = findings(["dager"])
    assert f.level == "error" and "dager is a text attack; the model is an image model" in f.message
    (f,) = findings([("ig", {"max_iterations": 20})])
    assert f.level == "warning" and "max_iterations = 20 is below a quarter of its default 2000" in f.message
    normalised = (torch.rand(8, *SHAPE) - 0.5) / 0.25  # (x - mean) / std in the data pipeline
    (f,) = findings(["ig"], images=normalised)
    assert f.level == "error" and f.check == "input range" and NORMALISE in f.message
    assert findings(["ig"], images=torch.rand(8, *SHAPE)) == []


def test_a_fedavg_delta_for_an_sgd_reading_needs_a_stated_plain_sgd_recipe():
    from gradleak.update import LocalTraining

    def fit(recipe, known=True):
        context = Preflight([ComponentSpec("lamp")], model(), "delta", known, None, recipe)
        return [f for f in run_checks(context) if f.check == "attack fit" and "plain SGD" in f.message]

    assert fit(LocalTraining(protocol="fedavg", lr=0.1)) == []
    for bad in (
        LocalTraining(protocol="fedavg", optimizer="adam"),
        LocalTraining(protocol="fedavg", momentum=0.9),
    ):
        (f,) = fit(bad)
        assert f.level == "error" and "lamp reads a FedAvg delta as plain SGD's mean gradient" in f.message
    assert len(fit(None, known=False)) == 1


def test_a_check_that_breaks_is_an_error_that_names_it():
    @register_check("broken")
    def broken(context):
        raise RuntimeError("oops")

    try:
        (f,) = findings(["ig"])
    finally:
        CHECKS.pop("broken")
    assert (f.level, f.check) == (
        "error",
        "broken",
    ) and "the check itself failed: RuntimeError: oops" in f.message


def test_the_flower_wrapper_refuses_before_round_1_what_cannot_work():
    pytest.importorskip("flwr")
    from flwr.serverapp.strategy import FedAvg

    from gradleak.integrations.flower import AuditStrategy

    normalised = (torch.rand(8, *SHAPE) - 0.5) / 0.25
    with pytest.raises(PreflightError, match=r"\[input range\] the task's images span"):
        AuditStrategy(FedAvg(), model=model(), attacks=["ig"], input_shape=SHAPE, num_classes=CLASSES,
                      malicious=("robbing_the_fed", {"num_bins": 8}), public_images=normalised)  # fmt: skip
    with pytest.raises(PreflightError, match="pisme needs the clients' training recipe"):
        AuditStrategy(FedAvg(), model=model(), attacks=["pisme"], input_shape=SHAPE, num_classes=CLASSES)


def test_gradleak_check_prints_what_a_run_would_build_and_refuses_what_a_run_would(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(DEMO), "data.train_limit=1000"]) == 0
    out = capsys.readouterr().out
    assert "config" in out and ": ok" in out and "1000 training samples over 100 clients" in out
    assert main(["check", str(DEMO), "data.train_limit=1000", "fl.rounds=1000000000"]) == 2
    assert "local trainings" in capsys.readouterr().err
    assert (
        main(["check", str(DEMO), "data.train_limit=1000", "audit.attacks=[{name='ig', max_iterations=10}]"])
        == 0
    )
    assert "warning: [budget] ig: max_iterations = 10" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_gradleak_check_dry_runs_the_defenses_and_aegis_refuses_in_its_pilot(tmp_path, capsys, monkeypatch):
    """A budget no candidate can meet: the dry run sets Aegis up on client 0 and stops after the pilot
    draw, exit 2 with the measured rate, in seconds; the config's cache at a budget it can meet passes."""
    monkeypatch.chdir(tmp_path)
    config = ROOT / "examples" / "organamnist_aegis.toml"
    small = ["data.train_limit=2000", "data.num_clients=10", "audit.clients=1"]
    impossible = "defenses=[{name='aegis', real_batch_size=64, cache={size=2048, budget=1e-12}}]"
    assert main(["check", str(config), *small, impossible, "--dry-run-defenses"]) == 2
    out = capsys.readouterr().out
    assert "client 0's setup failed" in out and "pilot draw accepted 0 of 256 candidates" in out
    seconds = float(out.split("failed after ")[1].split(" s")[0])
    assert seconds < 60
    feasible = "defenses=[{name='aegis', real_batch_size=64, cache={size=64, budget_scale=4.0}}]"
    assert main(["check", str(config), *small, feasible, "--dry-run-defenses"]) == 0
    assert "client 0's setup ok" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # nothing written
