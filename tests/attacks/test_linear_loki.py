"""LOKI: per-client slots keep every client's imprint rows apart inside a secure-aggregation sum."""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks import create_attack
from gradleak.attacks.linear.loki import Loki, LokiConfig
from gradleak.data.base import ImageDataset
from gradleak.federation import secure_sum, server_view
from gradleak.metrics import score_images
from gradleak.models import build_model
from gradleak.models.malicious import CLOSED_BIAS, ImprintBlock
from gradleak.tasks.client import train_client
from gradleak.types import AttackInputError, LocalTraining, Observation
from synthetic import synthetic_dataset

SHAPE = (1, 12, 12)
CLASSES = 3
FEDSGD = LocalTraining(protocol="fedsgd", batch_size=64)


@pytest.fixture(scope="module")
def setup():
    pool = synthetic_dataset(n=600, shape=SHAPE, classes=CLASSES, seed=11)
    public = synthetic_dataset(n=300, shape=SHAPE, classes=CLASSES, seed=12).images
    attack = create_attack("loki", slots=3, bins_per_slot=64)
    assert isinstance(attack, Loki)
    honest = build_model("aegis_cnn", SHAPE, CLASSES, seed=0)
    broadcast, secrets = attack.prepare(honest, public, generator=torch.Generator().manual_seed(0))
    return attack, broadcast, dict(secrets), pool


def bins_of(block: ImprintBlock, images: torch.Tensor, k: int) -> torch.Tensor:
    with torch.no_grad():
        return (block.bins(images)[:, :k] > 0).sum(dim=1) - 1  # slot 0 open in the broadcast


def three_clients(broadcast, pool: ImageDataset, k: int) -> list[ImageDataset]:
    """Three clients of 5 samples, each in distinct bins of its own slot; the clients share bins."""
    b = bins_of(broadcast.imprint, pool.images, k).tolist()
    clients, start = [], 0
    for _ in range(3):
        chosen, used = [], set()
        for i in range(start, len(b)):
            if b[i] >= 0 and b[i] not in used:
                chosen.append(i)
                used.add(b[i])
            if len(chosen) == 5:
                start = i + 1
                break
        clients.append(pool.subset(torch.tensor(chosen)))
    return clients


def aggregate_observation(attack, broadcast, secrets, clients, training, customise=True) -> Observation:
    results = []
    for slot, data in enumerate(clients):
        model = attack.customize(broadcast, slot) if customise else broadcast
        results.append(train_client(slot, model, data, training, [], torch.Generator().manual_seed(slot)))
    agg = secure_sum([r.update for r in results])
    return Observation(broadcast, agg, SHAPE, CLASSES, secrets=secrets, aggregated=True, num_clients=3)


def test_loki_recovers_each_clients_isolated_samples_from_the_aggregate(setup):
    attack, broadcast, secrets, pool = setup
    clients = three_clients(broadcast, pool, 64)
    obs = aggregate_observation(attack, broadcast, secrets, clients, FEDSGD)
    rec = attack.reconstruct(obs, generator=torch.Generator())
    assert rec.stats["slots_with_data"] == 3.0
    truth = torch.cat([c.images for c in clients])
    scores = score_images(rec.images, truth)
    assert min(scores.psnr) > 60.0  # all 15 images, exactly, from the sum alone
    # per client too: every client's own images are among the reconstructions
    for c in clients:
        assert score_images(rec.images, c.images).reconstruction_rate == 1.0


def test_without_per_client_slots_the_aggregate_mixes_clients(setup):
    attack, broadcast, secrets, pool = setup
    clients = three_clients(broadcast, pool, 64)
    b = [set(bins_of(broadcast.imprint, c.images, 64).tolist()) for c in clients]
    assert b[0] & b[1] or b[0] & b[2] or b[1] & b[2]  # the clients collide in a shared slot
    obs = aggregate_observation(attack, broadcast, secrets, clients, FEDSGD, customise=False)
    rec = attack.reconstruct(obs, generator=torch.Generator())
    scores = score_images(rec.images, torch.cat([c.images for c in clients]))
    assert scores.reconstruction_rate < 1.0


def test_loki_on_fedavg_sgd_deltas(setup):
    attack, broadcast, secrets, pool = setup
    clients = three_clients(broadcast, pool, 64)
    training = LocalTraining("fedavg", epochs=1, batch_size=64, lr=1e-3, optimizer="sgd")
    obs = aggregate_observation(attack, broadcast, secrets, clients, training)
    scores = score_images(attack.reconstruct(obs, generator=torch.Generator()).images,
                          torch.cat([c.images for c in clients]))  # fmt: skip
    assert scores.reconstruction_rate == 1.0 and scores.psnr_mean > 40.0


def test_customised_models_share_names_and_shapes_and_differ_only_in_the_slot_kernels(setup):
    attack, broadcast, _, _ = setup
    a, b = attack.customize(broadcast, 0), attack.customize(broadcast, 2)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert {n: p.shape for n, p in pa.items()} == {n: p.shape for n, p in pb.items()}
    differ = [n for n in pa if not torch.equal(pa[n], pb[n])]
    assert differ == ["imprint.front.conv.weight", "imprint.linear.bias"]
    closed = torch.cat([pa["imprint.linear.bias"][64:], pb["imprint.linear.bias"][:128]])
    assert torch.all(closed == CLOSED_BIAS)  # the other slots' bins cannot fire
    with pytest.raises(ValueError, match="slot 3 outside"):
        attack.customize(broadcast, 3)


def test_loki_bad_inputs(setup):
    attack, broadcast, secrets, pool = setup
    clients = three_clients(broadcast, pool, 64)
    obs = aggregate_observation(attack, broadcast, secrets, clients, FEDSGD)
    import dataclasses

    with pytest.raises(AttackInputError, match="bins do not match"):
        attack.reconstruct(
            dataclasses.replace(obs, secrets={**secrets, "slots": 2}), generator=torch.Generator()
        )
    honest = build_model("aegis_cnn", SHAPE, CLASSES, seed=0)
    plain = train_client(0, honest, clients[0], FEDSGD, [], torch.Generator().manual_seed(0))
    (bad,) = server_view(honest, [plain], input_shape=SHAPE, num_classes=CLASSES, secure_aggregation=False,
                         training=None, secrets=secrets)  # fmt: skip
    with pytest.raises(AttackInputError, match="lacks the imprint parameters"):
        attack.reconstruct(bad, generator=torch.Generator())
    with pytest.raises(ValueError):
        LokiConfig(slots=0)
