"""Scale-MIA: the imprint recovers latent codes exactly; the server's decoder turns them into images."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from gradleak.attacks import create_attack
from gradleak.attacks.linear.scale_mia import ScaleMIA, ScaleMIAConfig
from gradleak.data.base import ImageDataset
from gradleak.federation import server_view
from gradleak.metrics import psnr, score_images
from gradleak.models import build_model
from gradleak.tasks.client import train_client
from gradleak.types import AttackInputError, LocalTraining
from synthetic import synthetic_dataset

SHAPE = (1, 12, 12)
CLASSES = 3
FEDSGD = LocalTraining(protocol="fedsgd", batch_size=64)


@functools.cache
def _setup(latent_dim: int, opts: tuple[tuple[str, object], ...]):
    return _build(latent_dim, **dict(opts))


def setup(latent_dim: int, **opts):
    return _setup(latent_dim, tuple(sorted(opts.items())))


def _build(latent_dim: int, **opts):
    pool = synthetic_dataset(n=400, shape=SHAPE, classes=CLASSES, seed=21)
    public = synthetic_dataset(n=300, shape=SHAPE, classes=CLASSES, seed=22).images
    attack = create_attack("scale_mia", num_bins=128, latent_dim=latent_dim, **opts)
    assert isinstance(attack, ScaleMIA)
    honest = build_model("aegis_cnn", SHAPE, CLASSES, seed=0)
    model, secrets = attack.prepare(honest, public, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        bins = (model.imprint.bins(pool.images) > 0).sum(dim=1) - 1
    chosen, used = [], set()
    for i, b in enumerate(bins.tolist()):
        if b >= 0 and b not in used:
            chosen.append(i)
            used.add(b)
        if len(chosen) == 8:
            break
    data: ImageDataset = pool.subset(torch.tensor(chosen))
    result = train_client(0, model, data, FEDSGD, [], torch.Generator().manual_seed(1))
    (obs,) = server_view(model, [result], input_shape=SHAPE, num_classes=CLASSES, secure_aggregation=False,
                         training=None, secrets=secrets)  # fmt: skip
    return attack, model, dict(secrets), data, obs


def test_full_rank_pca_autoencoder_recovers_isolated_images_exactly():
    attack, _, _, data, obs = setup(latent_dim=144)  # d = C*H*W: the linear autoencoder is lossless
    rec = attack.reconstruct(obs, generator=torch.Generator())
    scores = score_images(rec.images, data.images)
    assert min(scores.psnr) > 50.0 and scores.reconstruction_rate == 1.0


def test_recovered_latents_are_exact_so_images_match_the_autoencoders_own_output():
    attack, model, secrets, data, obs = setup(latent_dim=16)
    rec = attack.reconstruct(obs, generator=torch.Generator())
    with torch.no_grad():  # truth side: the autoencoder applied to the true images
        ceiling = secrets["decoder"](model.imprint.front(data.images))
    matched = score_images(rec.images, ceiling)
    assert min(matched.psnr) > 60.0
    assert float(psnr(ceiling, data.images).mean()) < 30.0  # a lossy code: the decoder is the limit


def test_scale_mia_without_its_decoder_or_imprint_is_a_clear_error():
    attack, _, secrets, _, obs = setup(latent_dim=16)
    no_decoder = {k: v for k, v in secrets.items() if k != "decoder"}
    with pytest.raises(AttackInputError, match="decoder"):
        attack.reconstruct(dataclasses.replace(obs, secrets=no_decoder), generator=torch.Generator())
    with pytest.raises(AttackInputError, match="bins do not match"):
        attack.reconstruct(dataclasses.replace(obs, secrets={**secrets, "num_bins": 64}),
                           generator=torch.Generator())  # fmt: skip
    for bad in ({"autoencoder": "conv"}, {"latent_dim": 0}, {"num_bins": 1}, {"tuned_for": "x"}):
        with pytest.raises(ValueError):
            ScaleMIAConfig(**bad)


def test_mlp_autoencoder_option_trains_on_public_data():
    attack, _, secrets, _, obs = setup(latent_dim=16, autoencoder="mlp", ae_epochs=2, hidden=32)
    assert secrets["autoencoder_public_mse"] < 0.2
    rec = attack.reconstruct(obs, generator=torch.Generator())
    assert rec.images is not None and rec.images.shape[1:] == SHAPE
