"""BatchNorm statistics in FedAvg replies (attacks/image/bn_prior.py, the engine's buffers): the read-off
gives a batch's exact per-layer mean and unbiased variance after one local step, the momentum-weighted
average of the steps' after k, and the server's global statistics are the clients' sample-weighted mean."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradleak.attacks import create_attack
from gradleak.attacks.image.bn_prior import batchnorm_layers, read_batch_statistics
from gradleak.federation.simulation import FederatedSimulation, FLConfig
from gradleak.models import build_model
from gradleak.tasks.client import train_client
from gradleak.types import AttackInputError, LocalTraining, Observation
from synthetic import synthetic_dataset

SHAPE, CLASSES = (3, 16, 16), 4


def model() -> nn.Module:
    return build_model("resnet18", SHAPE, CLASSES, seed=0, width=4)


class StepRecorder:
    """The slow reference: every BatchNorm layer's input statistics at every local step, recorded by hooks
    that travel with the model into the client's copy."""

    def __init__(self, net: nn.Module) -> None:
        self.steps: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        self.first = next(iter(batchnorm_layers(net)))
        for name, layer in batchnorm_layers(net).items():
            layer.register_forward_hook(self.hook(name))

    def hook(self, name):
        def record(module, args, out):
            if module.training:
                x = args[0].detach().double()
                if name == self.first:  # the first BatchNorm of a forward pass opens a step
                    self.steps.append({})
                self.steps[-1][name] = (x.mean(dim=(0, 2, 3)), x.var(dim=(0, 2, 3), unbiased=True))

        return record


def train(net: nn.Module, batch, epochs: int):
    training = LocalTraining("fedavg", epochs=epochs, batch_size=len(batch), lr=0.05, shuffle=False)
    return train_client(0, net, batch, training, [], torch.Generator().manual_seed(0)).update


def test_one_step_gives_the_batch_statistics_exactly():
    net = model()
    recorder = StepRecorder(net)
    batch = synthetic_dataset(n=6, shape=SHAPE, classes=CLASSES, seed=1)
    update = train(net, batch, epochs=1)
    assert len(recorder.steps) == 1
    stats = read_batch_statistics(net, update.buffers)
    assert stats.steps == 1 and set(stats.mean) == set(recorder.steps[0])
    for name, (mean, var) in recorder.steps[0].items():
        # float32 running statistics, divided by the momentum 0.1: rounding grows tenfold
        torch.testing.assert_close(stats.mean[name], mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(stats.var[name], var, rtol=1e-4, atol=1e-5)


def test_k_steps_give_the_momentum_weighted_average_of_the_steps():
    net = model()
    recorder = StepRecorder(net)
    batch = synthetic_dataset(n=6, shape=SHAPE, classes=CLASSES, seed=2)
    update = train(net, batch, epochs=3)
    stats = read_batch_statistics(net, update.buffers)
    assert stats.steps == 3 and len(recorder.steps) == 3
    m, k = 0.1, 3
    weights = [m * (1 - m) ** (k - t) for t in range(1, k + 1)]
    for name in stats.mean:
        mean = sum(w * s[name][0] for w, s in zip(weights, recorder.steps, strict=True)) / (1 - (1 - m) ** k)
        var = sum(w * s[name][1] for w, s in zip(weights, recorder.steps, strict=True)) / (1 - (1 - m) ** k)
        torch.testing.assert_close(stats.mean[name], mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(stats.var[name], var, rtol=1e-4, atol=1e-5)


def test_withheld_statistics_cannot_be_read():
    net = model()
    update = train(net, synthetic_dataset(n=4, shape=SHAPE, classes=CLASSES, seed=3), epochs=1)
    with pytest.raises(AttackInputError, match="no running statistics"):
        read_batch_statistics(net, {})
    obs = Observation(net, update.replace(update.tensors), SHAPE, CLASSES)
    assert obs.update.buffers  # replace keeps the buffers
    fedbn = type(update)(update.tensors, update.num_samples, update.kind, update.metadata)
    with pytest.raises(AttackInputError, match="withheld"):
        create_attack("ig_bn", max_iterations=1).reconstruct(
            Observation(net, fedbn, SHAPE, CLASSES, labels=torch.zeros(4, dtype=torch.long)),
            generator=torch.Generator(),
        )


def test_the_server_averages_the_clients_statistics_by_sample_count():
    """One FedAvg round of two clients of 4 and 12 images: the global running statistics are
    (4 r_1 + 12 r_2) / 16 of the clients' own, trained separately (the reference)."""
    net = model()
    clients = [synthetic_dataset(n=n, shape=SHAPE, classes=CLASSES, seed=10 + n) for n in (4, 12)]
    training = LocalTraining("fedavg", epochs=1, batch_size=4, lr=0.05)
    sim = FederatedSimulation(net, clients, FLConfig(rounds=1, fraction=1.0, training=training), seed=5)
    start = {n: b.clone() for n, b in net.named_buffers()}
    tasks = sim.tasks(0, [0, 1], training)
    alone = [
        train_client(t.client_id, net, t.data, t.training, [], torch.Generator().manual_seed(t.seed)).update
        for t in tasks
    ]
    sim.run_round(0)
    after = dict(net.named_buffers())
    for name, b in after.items():
        want = (4 * alone[0].buffers[name].double() + 12 * alone[1].buffers[name].double()) / 16
        if b.is_floating_point():
            torch.testing.assert_close(b.double(), want, rtol=1e-5, atol=1e-6)
        else:
            assert int(b) == round(float(want)) == int(start[name]) + 2  # 1 and 3 steps: 2.5 rounds to 2


def test_the_server_rejects_statistics_that_do_not_fit_the_model():
    from gradleak.federation.server import screen
    from gradleak.tasks.client import ClientResult

    net = model()
    update = train(net, synthetic_dataset(n=4, shape=SHAPE, classes=CLASSES, seed=4), epochs=1)
    name = next(n for n in update.buffers if n.endswith("running_mean"))
    for bad in ({**update.buffers, "x": torch.zeros(1)}, {**update.buffers, name: torch.zeros(())}):
        forged = type(update)(update.tensors, update.num_samples, update.kind, update.metadata, bad)
        (result,) = screen([ClientResult(0, forged, None)], net, round_idx=0, kind="delta")
        assert result.update is None and "buffer" in (result.error or "")


def test_a_flower_audit_reads_the_statistics_off_a_reply(tmp_path):
    """AuditStrategy around Flower's FedAvg, gradleak's ClientApp training a BatchNorm ResNet for one step:
    the reply's running statistics reach the attack's observation, and ig_bn reads them off (not refused)."""
    pytest.importorskip("flwr")
    import functools

    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy import FedAvg

    from flowergrid import AppGrid, server_identity
    from gradleak.experiments.store import ResultStore
    from gradleak.integrations.flower import AuditStrategy
    from gradleak.integrations.flower.apps import client_app

    build = functools.partial(build_model, "resnet18", SHAPE, CLASSES, seed=0, width=4)
    data = [synthetic_dataset(n=4, shape=SHAPE, classes=CLASSES, seed=30 + k) for k in range(2)]
    training = LocalTraining("fedavg", epochs=1, batch_size=4, lr=0.05)
    store = ResultStore(tmp_path / "a.sqlite")
    strategy = AuditStrategy(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2), model=build(),
        attacks=[("ig_bn", {"max_iterations": 2})], input_shape=SHAPE, num_classes=CLASSES, store=store,
        training=training, seed=1,
    )  # fmt: skip
    app = client_app(data, build, training, seed=1)
    with server_identity(1):
        strategy.start(AppGrid(dict.fromkeys((41, 42), app), (41, 42)),
                       ArrayRecord(torch_state_dict=build().state_dict()), num_rounds=1)  # fmt: skip
    (run,) = store.runs()
    records = store.records(run.run_id, "attack")
    assert len(records) == 2 and all(r["refused"] is None and r["bn_steps"] == 1.0 for r in records), records


def _fedavg_observation(seed: int = 4):
    net = model()
    batch = synthetic_dataset(n=2, shape=SHAPE, classes=CLASSES, seed=seed)
    update = train(net, batch, epochs=1)
    return Observation(net, update, SHAPE, CLASSES, labels=batch.labels)


def test_gradinversion_of_one_guess_is_the_bn_prior_ig():
    """With one guess the consensus is the guess itself: the group term is zero and GradInversion's
    iterates are ig_bn's (the slow reference), bit for bit."""
    obs = _fedavg_observation()
    opts = {"max_iterations": 6, "source": "readoff", "bn_weight": 0.1}
    ref = create_attack("ig_bn", **opts).reconstruct(obs, generator=torch.Generator().manual_seed(3))
    got = create_attack("gradinversion", group=1, group_weight=5.0, **opts).reconstruct(
        obs, generator=torch.Generator().manual_seed(3)
    )
    torch.testing.assert_close(got.images, ref.images, rtol=0, atol=0)
    assert got.stats["matching_loss"] == ref.stats["matching_loss"] and got.stats["group_spread"] == 0.0


def test_the_group_term_pulls_the_guesses_together():
    """Four guesses from different seeds: the consistency term (unsigned gradients, so its weight is felt
    in proportion) leaves them closer to their consensus than without it."""
    obs = _fedavg_observation()
    spread = {}
    for weight in (0.0, 50.0):
        attack = create_attack("gradinversion", max_iterations=20, group=4, group_weight=weight,
                               signed_gradients=False, lr=0.05)  # fmt: skip
        spread[weight] = attack.reconstruct(obs, generator=torch.Generator().manual_seed(3)).stats[
            "group_spread"
        ]
    assert spread[50.0] < 0.5 * spread[0.0], spread


@pytest.mark.parametrize(("key", "value"), [("group", 0), ("group", 1.5), ("group_weight", -1.0),
                                            ("group_weight", float("inf"))])  # fmt: skip
def test_gradinversion_refuses_a_bad_group(key, value):
    with pytest.raises(ValueError, match=key):
        create_attack("gradinversion", **{key: value})


def test_the_batchnorm_prior_beats_ig_on_one_image_of_a_train_mode_resnet():
    """The case built for the prior: a pre-activation WRN-10-1 in train mode, one 8x8 CIFAR-10 image (the
    32x32 image average-pooled 4x4), one local step. The reply's buffers then hold the exact per-channel
    mean and variance of this image's features at every BatchNorm layer (the read-off tests above), the
    stem's included: its image's intensity and contrast, which IG, starting from grey, has to find through
    the gradient alone. Over 2 seeds at 400 iterations both BatchNorm-prior attacks beat IG by more than
    1.5 dB (measured: 8.97 / 9.69 dB IG, 11.13 / 11.78 ig_bn, 11.29 / 11.77 GradInversion with 2 guesses),
    and ig_bn's mean intensity is the image's within 0.05 (0.61 / 0.55 as the images'; IG 0.52 / 0.50)."""
    from gradleak.data import load_dataset
    from gradleak.data.base import ImageDataset
    from gradleak.metrics.image import psnr

    cifar = load_dataset("cifar10", "test", limit=2)
    images = torch.nn.functional.avg_pool2d(cifar.images, 4)
    training = LocalTraining("fedavg", epochs=1, batch_size=1, lr=0.01, shuffle=False)
    gradinversion = {"source": "readoff", "bn_weight": 1.0, "group": 2}
    for seed in (0, 1):
        batch = ImageDataset("one", images[seed : seed + 1].contiguous(), cifar.labels[seed : seed + 1], 10)
        net = build_model("wide_resnet", (3, 8, 8), 10, seed=seed, depth=10, widen=1)
        update = train_client(0, net, batch, training, [], torch.Generator().manual_seed(0)).update
        assert update is not None
        obs = Observation(net, update, (3, 8, 8), 10, labels=batch.labels, training=training)
        score, mean = {}, {}
        for attack, opts in (("ig", {}), ("ig_bn", {"bn_weight": 1.0}), ("gradinversion", gradinversion)):
            rec = create_attack(attack, max_iterations=400, **opts).reconstruct(
                obs, generator=torch.Generator().manual_seed(1)
            )
            score[attack] = float(psnr(rec.images, batch.images).mean())
            mean[attack] = float(rec.images.mean())
        assert score["ig_bn"] > score["ig"] + 1.5 and score["gradinversion"] > score["ig"] + 1.5, score
        assert abs(mean["ig_bn"] - float(batch.images.mean())) < 0.05, (mean, float(batch.images.mean()))


def test_a_train_mode_resnet18_gradient_cannot_see_the_images_scale():
    """Why IG's images of train-mode ResNets sit below the floor in the image map (docs/image-audits.md):
    every convolution of ResNet-18 feeds BatchNorm, which in train mode divides by the batch's own
    deviation, so with eps -> 0 the loss and every parameter gradient are the same for x and a x (a > 0):
    the update holds nothing of the images' intensity scale. (With PyTorch's eps 1e-5 nearly so.)"""
    net = build_model("resnet18", SHAPE, CLASSES, seed=0, width=4).train()
    for layer in batchnorm_layers(net).values():
        layer.eps = 1e-12
    batch = synthetic_dataset(n=2, shape=SHAPE, classes=CLASSES, seed=5)

    def gradient(x):
        net.zero_grad()
        torch.nn.functional.cross_entropy(net(x), batch.labels).backward()
        return {n: p.grad.clone() for n, p in net.named_parameters()}

    g, g_scaled = gradient(batch.images), gradient(0.3 * batch.images)
    for name, t in g.items():  # float32 rounding: relative to each tensor's norm
        assert float((g_scaled[name] - t).norm()) <= 1e-4 * float(t.norm()), name
