"""Robbing the Fed and LOKI through the experiment runner (malicious-model hook) on real OrganAMNIST."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradleak.experiments import load_config, run_experiment

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = ["data.train_limit=600", "data.test_limit=300", "data.num_clients=6", "fl.rounds=1",
         "fl.fraction=0.5", "audit.public_limit=300"]  # fmt: skip


def test_robbing_the_fed_example_runs_and_recovers_most_images():
    cfg = load_config(EXAMPLES / "organamnist_robbing_the_fed.toml",
                      [*SMALL, "audit.clients=2", "audit.training.batch_size=16",
                       "audit.attacks.0.num_bins=256"])  # fmt: skip
    out = run_experiment(cfg)
    attacks = out.of_kind("attack")
    assert len(attacks) == 2
    for a in attacks:
        assert a["attack"] == "robbing_the_fed" and a["batch_size"] == 16 and not a["aggregated"]
        assert a["reconstruction_rate"] >= 0.75, a["psnr"]
        assert a["local_steps"] == 1.0 and a["bins"] == 256.0


@pytest.mark.parametrize("attack", ["robbing_the_fed", "loki"])
def test_secure_aggregation_sum_is_attacked_once(attack):
    cfg = load_config(EXAMPLES / "organamnist_loki_secagg.toml",
                      [*SMALL, "audit.clients=2", "audit.training.batch_size=8",
                       f'audit.attacks=[{{name="{attack}"}}]'])  # fmt: skip
    out = run_experiment(cfg)
    (a,) = out.of_kind("attack")
    assert a["aggregated"] and a["num_clients"] == 2 and a["batch_size"] == 16
    assert a["reconstruction_rate"] >= 0.5, a["psnr"]


def test_runner_customises_loki_per_client(monkeypatch):
    """Each audited client trains its own slot's model (ClientCustomizingAttack): the sum keeps them apart."""
    from gradleak.attacks.linear.loki import Loki

    slots: list[int] = []
    original = Loki.customize

    def spy(self, broadcast, slot):
        slots.append(slot)
        return original(self, broadcast, slot)

    monkeypatch.setattr(Loki, "customize", spy)
    cfg = load_config(EXAMPLES / "organamnist_loki_secagg.toml",
                      [*SMALL, "audit.clients=3", "audit.training.batch_size=8"])  # fmt: skip
    (a,) = run_experiment(cfg).of_kind("attack")
    assert slots == [0, 1, 2]
    assert a["aggregated"] and a["num_clients"] == 3 and a["batch_size"] == 24
    assert a["reconstruction_rate"] >= 0.9, a["psnr"]
