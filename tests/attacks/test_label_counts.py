"""label_counts (attacks/image/label_counts.py): a batch's labels, repeats included, from the output bias.

The identity n_c = N (p_bar_c - g_b[c]) is exact (checked with the batch's true mean prediction as the slow
reference); with the model prior's estimate of p_bar, a seeded ResNet-18's batch of 8 CIFAR-10 images with
three repeated classes comes back exactly, from a FedSGD gradient and from a one-step FedAvg delta."""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks import create_attack
from gradleak.attacks.image.label_counts import count_labels
from gradleak.attacks.image.labels import output_layer_gradient
from gradleak.data import load_dataset
from gradleak.data.base import ImageDataset
from gradleak.models import build_model
from gradleak.tasks.client import train_client
from gradleak.types import AttackInputError, LocalTraining, Observation, Update

LABELS = [0, 0, 0, 1, 1, 2, 5, 5]


@pytest.fixture(scope="module")
def batch() -> ImageDataset:
    cifar = load_dataset("cifar10", "test", limit=200)
    idx: list[int] = []
    for label in LABELS:  # the first unused image of each wanted class
        idx.append(next(i for i in range(len(cifar)) if int(cifar.labels[i]) == label and i not in idx))
    return ImageDataset("batch", cifar.images[idx], cifar.labels[idx], 10)


def _observation(batch: ImageDataset, seed: int, training: LocalTraining) -> Observation:
    net = build_model("resnet18", (3, 32, 32), 10, seed=seed, width=4)
    result = train_client(0, net, batch, training, [], torch.Generator().manual_seed(0))
    assert result.update is not None
    return Observation(net, result.update, (3, 32, 32), 10, training=training)


FEDSGD = LocalTraining("fedsgd", batch_size=8)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_count_identity_is_exact_with_the_batch_s_own_mean_prediction(batch, seed):
    obs = _observation(batch, seed, FEDSGD)
    with torch.no_grad():
        p_bar = torch.softmax(obs.client_model()(batch.images).double(), dim=-1).mean(dim=0)
    _, g_bias = output_layer_gradient(obs)
    assert g_bias is not None
    est = 8 * (p_bar - g_bias.double())  # the counts before rounding: integers up to float32 rounding
    torch.testing.assert_close(est, torch.bincount(batch.labels, minlength=10).double(), rtol=0, atol=1e-5)
    assert count_labels(g_bias, p_bar, 8).tolist() == LABELS


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("training", [FEDSGD, LocalTraining("fedavg", epochs=1, batch_size=8, lr=0.05)],
                         ids=["fedsgd", "fedavg_one_step"])  # fmt: skip
def test_the_model_prior_recovers_repeated_labels_of_a_resnet_batch(batch, seed, training):
    obs = _observation(batch, seed, training)
    rec = create_attack("label_counts", prior="model").reconstruct(
        obs, generator=torch.Generator().manual_seed(0)
    )
    assert rec.labels is not None and rec.labels.tolist() == LABELS
    assert rec.images is None and rec.stats["classes_present"] == 4


def test_a_hidden_recipe_and_a_bias_free_output_are_refused(batch):
    obs = _observation(batch, 0, LocalTraining("fedavg", epochs=1, batch_size=8, lr=0.05))
    hidden = Observation(obs.model, obs.update, obs.input_shape, 10)
    with pytest.raises(AttackInputError, match="recipe"):
        create_attack("label_counts").reconstruct(hidden, generator=torch.Generator())
    net = build_model("resnet18", (3, 32, 32), 10, seed=0, width=4)
    net.fc.bias = None
    tensors = {k: v for k, v in obs.update.tensors.items() if k != "fc.bias"}
    no_bias = Observation(net, Update(tensors, 8, "gradient"), (3, 32, 32), 10)
    with pytest.raises(AttackInputError, match="no bias"):
        create_attack("label_counts").reconstruct(no_bias, generator=torch.Generator())


@pytest.mark.parametrize(("key", "value"), [("prior", "llg"), ("probes", 1), ("num_samples", 0)])
def test_bad_options_are_refused(key, value):
    with pytest.raises(ValueError, match=key):
        create_attack("label_counts", **{key: value})
