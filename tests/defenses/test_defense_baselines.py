"""Baseline defenses for the timing table: compression (top-k + error feedback), DP noise, Soteria."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from gradleak.defenses.base import SetupContext
from gradleak.defenses.baselines import (
    BatchNoise,
    BatchNoiseConfig,
    Compression,
    CompressionConfig,
    Soteria,
    SoteriaConfig,
)
from gradleak.models import build_model
from gradleak.registry import DEFENSES
from gradleak.tasks.client import train_client
from gradleak.types import LocalTraining, Update
from synthetic import synthetic_dataset

SHAPE = (1, 12, 12)


def model_with_grads(seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    model = build_model("aegis_cnn", SHAPE, 3, seed=seed)
    data = synthetic_dataset(n=8, shape=SHAPE, classes=3, seed=1)
    model.zero_grad()
    F.cross_entropy(model(data.images), data.labels).backward()
    return model, {n: p.grad.clone() for n, p in model.named_parameters()}, data.images  # type: ignore[union-attr]


def test_compression_keeps_top_k_and_feeds_back_the_rest() -> None:
    model, grads, _ = model_with_grads()
    comp = Compression(CompressionConfig(ratio=0.1))
    comp.setup(model, SetupContext(torch.Generator()))
    comp.on_gradients(model, 0)
    for n, p in model.named_parameters():
        kept = int((p.grad != 0).sum())  # type: ignore[union-attr]
        assert kept <= max(1, -(-grads[n].numel() // 10))
        torch.testing.assert_close(p.grad + comp.residual[n], grads[n])  # type: ignore[operator]


def test_batch_noise_clips_and_adds_seeded_noise() -> None:
    model, _, _ = model_with_grads()
    dp = BatchNoise(BatchNoiseConfig(clip=1e-3, sigma=0.0))
    dp.setup(model, SetupContext(torch.Generator()))
    dp.on_gradients(model, 0)
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))  # type: ignore[union-attr]
    assert float(norm) == pytest.approx(1e-3, rel=1e-4)
    outs = []
    for seed in (0, 0, 1):
        model, _, _ = model_with_grads()
        dp = BatchNoise(BatchNoiseConfig(sigma=1.0))
        dp.setup(model, SetupContext(torch.Generator().manual_seed(seed)))
        dp.on_gradients(model, 0)
        outs.append(torch.cat([p.grad.flatten() for p in model.parameters()]))  # type: ignore[union-attr]
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    # the sent update states the noise scale sigma C / B only for a gradient of one noised step
    grads = {n: p.grad for n, p in model.named_parameters()}
    noise = BatchNoise(BatchNoiseConfig(clip=2.0, sigma=0.5, batch_size=4))
    noise.setup(model, SetupContext(torch.Generator()))
    noise.on_gradients(model, 0)
    assert noise.on_update(Update(grads, 4, kind="gradient")).metadata["batch_noise/noise_std"] == 0.25
    assert "batch_noise/noise_std" not in noise.on_update(Update(grads, 4, kind="delta")).metadata
    noise.on_gradients(model, 1)
    assert "batch_noise/noise_std" not in noise.on_update(Update(grads, 4, kind="gradient")).metadata


def test_soteria_prunes_representation_columns_and_estimates_ratios() -> None:
    model, grads, images = model_with_grads()
    sot = Soteria(SoteriaConfig(percent=50.0, probes=100))
    sot.setup(model, SetupContext(torch.Generator().manual_seed(0)))
    model(images)  # the forward the client did
    sot.on_gradients(model, 0)
    w = model.classifier[3].weight.grad
    assert int((w.abs().sum(0) == 0).sum()) >= 256
    for n, p in model.named_parameters():  # only the consumer layer is touched
        if n != "classifier.3.weight":
            torch.testing.assert_close(p.grad, grads[n])
    x = images.clone().requires_grad_(True)
    r = model.classifier[:3](model.features(x))
    feats = range(0, 512, 8)  # exact norms for every 8th feature: one backward pass each
    jac = torch.stack([torch.autograd.grad(r[:, i].sum(), x, retain_graph=True)[0].norm() for i in feats])
    live = jac > 0
    exact = r.detach()[:, list(feats)].norm(dim=0)[live] / jac[live]
    est = sot.ratios(model, images)[list(feats)][live]
    assert float(((est - exact).abs() / exact).median()) < 0.15


def test_baselines_run_in_the_client_and_fail_closed() -> None:
    data = synthetic_dataset(n=16, shape=SHAPE, classes=3, seed=1)
    model = build_model("aegis_cnn", SHAPE, 3, seed=0)
    training = LocalTraining("fedavg", epochs=1, batch_size=8, optimizer="adam")
    for name in ("compression", "batch_noise", "soteria"):
        res = train_client(
            0, model, data, training, [DEFENSES.create(name)], torch.Generator().manual_seed(0)
        )
        assert res.update is not None, (name, res.error)
    bad = DEFENSES.create("soteria", consumer="features.0")
    res = train_client(0, model, data, training, [bad], torch.Generator())
    assert res.update is None and "not a Linear layer" in (res.error or "")


def test_pruning_zeroes_exactly_the_smallest_entries_against_a_sort() -> None:
    from gradleak.defenses.pruning import Pruning, PruningConfig
    from gradleak.types import Update

    gen = torch.Generator().manual_seed(0)
    t = torch.randn(1000, generator=gen)
    t[:50] = 0.0  # ties at the threshold
    for ratio in (0.02, 0.5, 0.9, 0.99):
        out = Pruning(PruningConfig(ratio)).on_update(Update({"w": t.reshape(10, 100)}, 1)).tensors["w"]
        k = int(ratio * 1000)
        ref = t.clone()
        ref[t.abs().sort(stable=True).indices[:k]] = 0.0  # the slow obvious reference
        assert int((out.reshape(-1) == 0).sum()) == max(k, 50)
        assert torch.equal(out.reshape(-1), ref)
