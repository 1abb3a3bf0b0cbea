"""The malicious-model threat model in the runner: the server's modified broadcast reaches the clients, its
secrets reach the attack only through the Observation, and public data is not client data."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gradleak.cli.demo import demo_config_path
from gradleak.experiments import load_config, run_experiment
from gradleak.registry import ATTACKS
from gradleak.types import ModelModifyingAttack, Observation, Reconstruction

SEEN: dict[str, object] = {}


@dataclass(frozen=True)
class ToyConfig:
    marker: float = 7.0


class ToyMalicious:
    """Sets the output bias to a marker value; 'reconstructs' the public images it was given."""

    def __init__(self, config: ToyConfig) -> None:
        self.config = config

    def prepare(self, model: nn.Module, public_images, *, generator):
        with torch.no_grad():
            model.classifier[-1].bias.fill_(self.config.marker)
        SEEN["public"] = public_images
        return model, {"marker": self.config.marker, "public_n": len(public_images)}

    def reconstruct(self, obs: Observation, *, generator) -> Reconstruction:
        SEEN["obs"] = obs
        n = obs.update.num_samples
        return Reconstruction(images=torch.zeros((n, *obs.input_shape)), labels=None, stats={})


ATTACKS.register("test-toy-malicious", ToyMalicious, config_cls=ToyConfig, summary="test only")


def test_model_modifying_attack_flow():
    assert isinstance(ToyMalicious(ToyConfig()), ModelModifyingAttack)
    cfg = load_config(
        demo_config_path(),
        ["data.train_limit=400", "data.test_limit=150", "data.num_clients=4", "fl.rounds=1",
         "fl.fraction=0.5", "audit.clients=2", "audit.max_samples=3", "audit.training.protocol='fedavg'",
         "audit.training.batch_size=3", "audit.public_limit=100",
         'audit.attacks=[{name="test-toy-malicious"}]'],
    )  # fmt: skip
    out = run_experiment(cfg)
    obs: Observation = SEEN["obs"]  # type: ignore[assignment]
    assert obs.secrets == {"marker": 7.0, "public_n": 100}
    assert torch.all(obs.model.classifier[-1].bias == 7.0)  # the attack sees the broadcast it planted
    attacks = out.of_kind("attack")
    assert len(attacks) == 2 and all(a["batch_size"] == 3 for a in attacks)  # max_samples honoured
    assert obs.update.num_samples == 3 and obs.update.kind == "delta"
    public = SEEN["public"]
    assert public.shape == (100, 1, 28, 28)  # the held-out test images, not the clients' training data
