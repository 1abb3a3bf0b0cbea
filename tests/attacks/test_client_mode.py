"""Attacks differentiate the model in the mode the client trained in (issue 18, item 7).

On a model with BatchNorm a training client's gradient uses the batch's statistics; the same images'
gradient in eval mode (running statistics) is another function. The Observation carries the mode (from the
update's metadata, which gradleak's clients set), ``client_model()`` gives the attack that mode, and every
gradient-matching attack runs its forward passes in it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gradleak.attacks import create_attack
from gradleak.federation import train_client
from gradleak.types import MODE, AttackInputError, LocalTraining, Observation
from synthetic import synthetic_dataset

SHAPE, CLASSES = (1, 8, 8), 3
FEDSGD = LocalTraining("fedsgd", batch_size=4)
FEDAVG = LocalTraining("fedavg", epochs=1, batch_size=2, lr=0.1, optimizer="sgd")  # SME inverts deltas


class BNNet(nn.Module):
    """A small ConvNet with BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 8 * 8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def client_update(training: LocalTraining = FEDSGD):
    torch.manual_seed(0)
    model = BNNet()
    model.bn.running_mean.uniform_(-0.5, 0.5)  # a trained model's statistics, not the batch's
    model.bn.running_var.uniform_(0.5, 2.0)
    data = synthetic_dataset(n=4, shape=SHAPE, classes=CLASSES, seed=1)
    result = train_client(0, model, data, training, [], torch.Generator().manual_seed(2))
    assert result.update is not None and result.truth is not None
    return model, result


def gradient(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(images), labels).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_the_client_model_is_in_the_clients_mode_and_reproduces_its_gradient():
    model, result = client_update()
    assert result.update.metadata[MODE] == "train"
    sent = torch.cat([result.update.tensors[n].flatten() for n, _ in model.named_parameters()])
    obs = Observation(model.eval(), result.update, SHAPE, CLASSES)
    assert obs.mode == "train"
    train_grad = gradient(obs.client_model(), result.truth.images, result.truth.labels)
    torch.testing.assert_close(train_grad, sent, atol=1e-6, rtol=1e-5)  # the client's own gradient
    eval_obs = Observation(model, result.update, SHAPE, CLASSES, mode="eval")
    eval_grad = gradient(eval_obs.client_model(), result.truth.images, result.truth.labels)
    cosine = float(F.cosine_similarity(eval_grad, sent, dim=0))
    assert cosine < 0.95, cosine  # another function: the reason the mode must be the client's
    assert not obs.model.training  # the observation's own model is untouched


def test_gradient_matching_attacks_run_their_forward_passes_in_the_clients_mode(monkeypatch):
    updates = {"ig": client_update(), "dlg": client_update(), "sme": client_update(FEDAVG)}
    seen: list[bool] = []
    original = BNNet.forward

    def spy(self, x):
        if len(x) > 1:  # not the one-image shape check
            seen.append(self.training)
        return original(self, x)

    monkeypatch.setattr(BNNet, "forward", spy)
    for mode in ("train", "eval"):
        for name, (model, result) in updates.items():
            seen.clear()
            training = FEDAVG if name == "sme" else FEDSGD
            obs = Observation(model, result.update, SHAPE, CLASSES, training=training, mode=mode)
            create_attack(name, max_iterations=2).reconstruct(obs, generator=torch.Generator().manual_seed(0))
            assert seen and set(seen) == {mode == "train"}, (name, mode, seen[:5])


def test_an_unknown_mode_is_refused():
    model, result = client_update()
    with pytest.raises(AttackInputError, match=r"mode must be one of \('train', 'eval'\), got 'test'"):
        Observation(model, result.update, SHAPE, CLASSES, mode="test")
