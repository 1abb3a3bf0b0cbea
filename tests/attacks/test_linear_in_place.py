"""The malicious models that keep the client's architecture (attacks/linear/in_place.py): same names and
shapes as the honest model, and each recovers what its paper says from a real FedSGD gradient."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from gradleak.attacks import create_attack
from gradleak.metrics.image import pairwise_psnr
from gradleak.models import build_model
from gradleak.types import AttackInputError, Observation, Update
from synthetic import synthetic_dataset

SHAPE = (1, 12, 12)
CLASSES = 4


def data(n: int, seed: int):
    return synthetic_dataset(n=n, shape=SHAPE, classes=CLASSES, seed=seed)


def gradient(model, images, labels) -> Update:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(images), labels).backward()
    return Update({n: p.grad.detach().clone() for n, p in model.named_parameters()}, len(images), "gradient")


def observe(model, update, secrets) -> Observation:
    return Observation(model=model, update=update, input_shape=SHAPE, num_classes=CLASSES, secrets=secrets)


def prepared(name, model, seed=0, **options):
    public = data(200, seed=99).images
    attack = create_attack(name, **options)
    malicious, secrets = attack.prepare(model, public, generator=torch.Generator().manual_seed(seed))
    return attack, malicious, secrets


@pytest.mark.parametrize("name", ["rtf_in_place", "loki_in_place", "trap_weights", "class_fishing"])
@pytest.mark.parametrize("arch", ["mlp", "sme_cnn"])
def test_architecture_is_kept(name, arch):
    honest = build_model(arch, SHAPE, CLASSES, seed=0)
    _, malicious, _ = prepared(name, honest)
    ours = honest.state_dict()
    theirs = malicious.state_dict()
    assert list(theirs) == list(ours)
    assert all(theirs[n].shape == t.shape and theirs[n].dtype == t.dtype for n, t in ours.items())
    assert any(not torch.equal(theirs[n], t) for n, t in ours.items())  # the weights carry the attack


def test_rtf_in_place_recovers_a_batch_exactly():
    model = build_model("mlp", SHAPE, CLASSES, seed=0)
    attack, malicious, secrets = prepared("rtf_in_place", model)
    batch = data(8, seed=1)
    rec = attack.reconstruct(observe(malicious, gradient(malicious, batch.images, batch.labels), secrets),
                             generator=torch.Generator())  # fmt: skip
    best = pairwise_psnr(rec.images, batch.images).max(dim=0).values  # per client image
    # 256 bins over 8 samples: a sample alone in its bin comes back exactly (float32 ratio: > 60 dB)
    assert int((best > 60).sum()) >= 7


def test_loki_in_place_keeps_clients_apart_in_the_secure_sum():
    model = build_model("mlp", SHAPE, CLASSES, seed=0)
    attack, broadcast, secrets = prepared("loki_in_place", model, slots=2, bins_per_slot=64)
    batches = [data(4, seed=10 + j) for j in range(2)]
    updates = [gradient(attack.customize(broadcast, j), b.images, b.labels) for j, b in enumerate(batches)]
    total = Update(
        {n: updates[0].tensors[n] + updates[1].tensors[n] for n in updates[0].tensors}, 8, "gradient"
    )
    rec = attack.reconstruct(observe(broadcast, total, secrets), generator=torch.Generator())
    truth = torch.cat([b.images for b in batches])
    best = pairwise_psnr(rec.images, truth).max(dim=0).values
    assert int((best[:4] > 60).sum()) >= 3 and int((best[4:] > 60).sum()) >= 3  # both clients, from the sum


def test_loki_in_place_closes_the_other_slots():
    model = build_model("mlp", SHAPE, CLASSES, seed=0)
    attack, broadcast, _ = prepared("loki_in_place", model, slots=3, bins_per_slot=16)
    custom = attack.customize(broadcast, 1)
    bias = custom.state_dict()["layers.1.bias"]
    assert bool((bias[:16] == -1e4).all()) and bool((bias[32:48] == -1e4).all())
    assert bool((bias[16:32] > -1e4).all())
    batch = data(6, seed=3)
    g = gradient(custom, batch.images, batch.labels).tensors["layers.1.weight"]
    assert float(g[:16].abs().max()) == 0.0 and float(g[32:48].abs().max()) == 0.0  # closed rows stay silent
    assert float(g[16:32].abs().max()) > 0


def test_trap_weights_rows_follow_the_paper():
    model = build_model("mlp", SHAPE, CLASSES, seed=0)
    _, malicious, _ = prepared("trap_weights", model, negative_scale=1.2)
    w = malicious.state_dict()["layers.1.weight"]
    d = w.shape[1]
    assert bool(((w < 0).sum(dim=1) == d // 2).all())  # exactly half of each row negated
    ratio = w.clamp(max=0).abs().sum(dim=1) / w.clamp(min=0).sum(dim=1)
    assert abs(float(ratio.mean()) - 1.2) < 0.05  # the negative half scaled by s (mean over 256 rows)
    assert float(malicious.state_dict()["layers.1.bias"].abs().max()) == 0.0


def test_trap_weights_recover_a_sample_from_a_single_firing_row():
    model = build_model("mlp", SHAPE, CLASSES, seed=0)
    attack, malicious, secrets = prepared("trap_weights", model)
    batch = data(8, seed=4)
    rec = attack.reconstruct(observe(malicious, gradient(malicious, batch.images, batch.labels), secrets),
                             generator=torch.Generator())  # fmt: skip
    assert float(pairwise_psnr(rec.images, batch.images).max()) > 60  # at least one row fired for one sample


def test_class_fishing_magnifies_the_target_class():
    """Only the fished class sends gradient into the body: the batch's body gradient equals that of the
    target-class samples alone, scaled by their share of the batch (the slow reference)."""
    model = build_model("mlp", SHAPE, CLASSES, seed=0)
    batch = data(12, seed=5)
    target = int(batch.labels[0])
    _, malicious, _ = prepared("class_fishing", model, target_class=target)
    malicious = malicious.double()  # float64: the other classes' share is exp(-1000)-small, not rounding
    images = batch.images.double()
    full = gradient(malicious, images, batch.labels).tensors
    mask = batch.labels == target
    alone = gradient(malicious, images[mask], batch.labels[mask]).tensors
    share = float(mask.double().mean())
    for name in ("layers.1.weight", "layers.3.weight"):
        torch.testing.assert_close(full[name], share * alone[name], rtol=1e-10, atol=1e-14)
    assert float(full["layers.1.weight"].abs().max()) > 0


def test_in_place_bins_need_a_hidden_linear_layer():
    lenet = build_model("lenet", SHAPE, CLASSES, seed=0)  # one linear layer: no back-connection
    with pytest.raises(AttackInputError, match="no linear layer reads"):
        prepared("rtf_in_place", lenet)


def test_features_are_not_scored_as_images():
    cnn = build_model("sme_cnn", SHAPE, CLASSES, seed=0)
    attack, malicious, secrets = prepared("rtf_in_place", cnn)
    assert secrets["reads_input"] is False
    batch = data(4, seed=6)
    with pytest.raises(AttackInputError, match="reads features, not the input"):
        attack.reconstruct(observe(malicious, gradient(malicious, batch.images, batch.labels), secrets),
                           generator=torch.Generator())  # fmt: skip


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("rtf_in_place", {"num_bins": 1}, "num_bins"),
        ("rtf_in_place", {"noise": -1.0}, "noise"),
        ("loki_in_place", {"slots": 0}, "slots"),
        ("trap_weights", {"negative_scale": 1.0}, "negative_scale"),
        ("class_fishing", {"bias_multiplier": 0.0}, "bias_multiplier"),
    ],
)
def test_bad_options_are_refused(name, options, message):
    with pytest.raises(ValueError, match=message):
        create_attack(name, **options)
