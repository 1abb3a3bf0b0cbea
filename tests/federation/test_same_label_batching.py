"""Same-label batching with an MSE loss (Eloul et al., arXiv 2204.12495; paper 000, Appendix E), issue 54
item 3: a training option (``LocalTraining(loss="mse", batching="same_label")``) that changes the sampler
and the loss, which defense hooks cannot; the attacks that differentiate the client's loss use the recipe's.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from gradleak.attacks import create_attack
from gradleak.attacks.image.ig import Matching
from gradleak.models import build_model
from gradleak.registry import LOSSES, SAMPLERS
from gradleak.tasks.client import train_client
from gradleak.tasks.losses import criterion
from gradleak.types import LocalTraining
from synthetic import synthetic_dataset

SAME_MSE = {"loss": "mse", "batching": "same_label"}


def small_model(classes: int = 3) -> torch.nn.Module:
    return build_model("lenet", (1, 12, 12), classes, seed=0)


def reference_mse(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Slow and obvious: sum over samples and classes of (softmax - one-hot)^2, divided by B K."""
    b, k = logits.shape
    total = logits.new_zeros(())
    for i in range(b):
        probs = torch.exp(logits[i]) / torch.exp(logits[i]).sum()
        for c in range(k):
            total = total + (probs[c] - (1.0 if int(labels[i]) == c else 0.0)) ** 2
    return total / (b * k)


@pytest.mark.parametrize("seed", range(4))
def test_same_label_batches_hold_one_label_each_and_cover_every_sample_once(seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 5, (37,), generator=g)
    for shuffle in (True, False):
        batches = SAMPLERS.create("same_label")(
            37, labels, 4, shuffle=shuffle, generator=torch.Generator().manual_seed(seed)
        )
        assert all(len(torch.unique(labels[b])) == 1 and 1 <= len(b) <= 4 for b in batches)
        assert sorted(torch.cat(batches).tolist()) == list(range(37))
        # each class fills batches of 4 but its last: the fewest batches one label a batch allows
        counts = torch.bincount(labels, minlength=5).tolist()
        assert len(batches) == sum(-(-n // 4) for n in counts)
    with pytest.raises(ValueError, match="one class label per sample"):
        SAMPLERS.create("same_label")(5, None, 2, shuffle=True, generator=torch.Generator())


def test_the_mse_loss_equals_a_hand_written_reference_and_takes_soft_targets():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.tensor([0, 3, 3, 1, 2, 0])
    mse = LOSSES.create("mse")
    torch.testing.assert_close(mse(logits, labels), reference_mse(logits, labels), rtol=1e-12, atol=0)
    onehot = torch.nn.functional.one_hot(labels, 4).double()
    torch.testing.assert_close(mse(logits, onehot), mse(logits, labels), rtol=1e-12, atol=0)
    assert criterion(None) is LOSSES.create("cross_entropy")  # a hidden recipe: cross-entropy
    with pytest.raises(ValueError, match="loss must be one of"):
        LocalTraining(loss="hinge")
    with pytest.raises(ValueError, match="batching must be one of"):
        LocalTraining(batching="by_writer")


def test_fedavg_with_same_label_batches_and_mse_equals_a_hand_written_loop():
    data = synthetic_dataset(n=14, shape=(1, 12, 12), classes=3, seed=3)
    model = small_model()
    training = LocalTraining("fedavg", epochs=2, batch_size=3, lr=0.1, **SAME_MSE)
    res = train_client(0, model, data, training, [], torch.Generator().manual_seed(5))
    assert res.update is not None
    # the client's batches, drawn as it draws them (the sampler is checked above)
    gen = torch.Generator().manual_seed(5)
    sampler = SAMPLERS.create("same_label")
    epochs = [sampler(14, data.labels, 3, shuffle=True, generator=gen) for _ in range(2)]
    assert res.update.metadata["local_steps"] == sum(len(e) for e in epochs)
    ref = copy.deepcopy(model).train()
    w0 = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for idx in itertools.chain(*epochs):
        assert len(torch.unique(data.labels[idx])) == 1
        ref.zero_grad()
        reference_mse(ref(data.images[idx]), data.labels[idx]).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.1 * p.grad
    for n, p in ref.named_parameters():
        torch.testing.assert_close(res.update.tensors[n], p.detach() - w0[n], atol=1e-6, rtol=1e-5)


def test_a_fedsgd_batch_holds_one_label_and_its_gradient_is_the_mse_gradient():
    data = synthetic_dataset(n=20, shape=(1, 12, 12), classes=4, seed=1)
    model = small_model(4)
    training = LocalTraining("fedsgd", batch_size=8, **SAME_MSE)
    res = train_client(0, model, data, training, [], torch.Generator().manual_seed(2))
    assert res.update is not None and res.truth is not None
    assert len(torch.unique(res.truth.labels)) == 1 and 1 <= len(res.truth) <= 8
    ref = copy.deepcopy(model).train()
    reference_mse(ref(res.truth.images), res.truth.labels).backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(res.update.tensors[n], p.grad, atol=1e-6, rtol=1e-5)


def test_the_random_batching_draws_what_fedsgd_always_drew():
    """The default sampler's FedSGD batch is the first ``batch_size`` of one permutation, sorted: the draw
    gradleak made before samplers were a registry (committed results keep reproducing)."""
    data = synthetic_dataset(n=20, shape=(1, 12, 12), classes=4, seed=1)
    res = train_client(0, small_model(4), data, LocalTraining("fedsgd", batch_size=8), [],
                       torch.Generator().manual_seed(2))  # fmt: skip
    before = torch.randperm(20, generator=torch.Generator().manual_seed(2))[:8].sort().values
    assert res.sample_index == tuple(before.tolist())


def test_inverting_gradients_matches_the_gradient_of_the_loss_the_recipe_states():
    from gradleak.attacks.image.ig import InvertingGradients

    data = synthetic_dataset(n=3, shape=(1, 12, 12), classes=3, seed=4)
    model = small_model().eval()
    params = list(model.parameters())
    mse = criterion(LocalTraining("fedsgd", batch_size=3, **SAME_MSE))
    match = Matching(model, params, [torch.zeros_like(p) for p in params], data.labels, mse)
    grads = InvertingGradients().gradients(match, data.images, create_graph=False)
    expected = torch.autograd.grad(reference_mse(model(data.images), data.labels), params)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_label_recovery_refuses_a_recipe_that_is_not_cross_entropy():
    """iDLG/LLG read the output layer as cross-entropy's p - y; under MSE every class would look present,
    so an attack with hidden labels refuses instead of inverting with wrong labels."""
    from gradleak.attacks.image.labels import recover_label_counts, recover_labels
    from gradleak.types import AttackInputError, Observation

    data = synthetic_dataset(n=4, shape=(1, 12, 12), classes=3, seed=2)
    model = small_model()
    training = LocalTraining("fedsgd", batch_size=4, **SAME_MSE)
    res = train_client(0, model, data, training, [], torch.Generator().manual_seed(0))
    obs = Observation(model, res.update, (1, 12, 12), 3, training)
    for call in (lambda: recover_labels(obs, 4), lambda: recover_label_counts(obs, 4, lr=0.1, steps=1)):
        with pytest.raises(AttackInputError, match="grant the labels"):
            call()
    with pytest.raises(AttackInputError, match="grant the labels"):
        create_attack("ig", max_iterations=2).reconstruct(obs, generator=torch.Generator())
    granted = Observation(model, res.update, (1, 12, 12), 3, training, labels=res.truth.labels)
    rec = create_attack("ig", max_iterations=2).reconstruct(granted, generator=torch.Generator())
    assert torch.equal(rec.labels, res.truth.labels)


def test_a_task_without_a_criterion_refuses_another_loss_before_training():
    from gradleak.tasks import TextClassification

    with pytest.raises(ValueError, match="'text_classification' trains with its own loss only"):
        train_client(0, small_model(), synthetic_dataset(n=4), LocalTraining(loss="mse"), [],
                     torch.Generator(), task=TextClassification())  # fmt: skip


def test_views_of_same_label_batches_and_unmodelled_recipes_are_named_before_work():
    from gradleak.audit.preflight import Preflight, run_checks
    from gradleak.experiments.config import ConfigError, load_config
    from gradleak.spec import ComponentSpec

    with pytest.raises(ConfigError, match="batching = 'same_label' draws each view"):
        fedsgd = {"protocol": "fedsgd", "batch_size": 4, "batching": "same_label"}
        load_config({"audit": {"views": 2, "max_samples": 4, "training": fedsgd}})
    recipe = LocalTraining("fedavg", batch_size=4, momentum=0.9, batching="same_label")
    found = run_checks(Preflight([ComponentSpec("pisme"), ComponentSpec("ig")], small_model(), "delta",
                                 recipe=recipe))  # fmt: skip
    (warning,) = [f for f in found if f.check == "recipe model"]
    assert warning.level == "warning" and warning.message.startswith("pisme models the local steps")
    assert "momentum 0.9 and batching 'same_label'" in warning.message
