"""Robbing the Fed: exact analytic recovery, averaging collisions, optimisers, bad inputs, no ground truth."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from gradleak.attacks import create_attack
from gradleak.attacks.linear.robbing_the_fed import RobbingTheFed, RobbingTheFedConfig
from gradleak.data.base import ImageDataset
from gradleak.federation import server_view
from gradleak.metrics import psnr, score_images
from gradleak.models import build_model
from gradleak.models.malicious import MaliciousModel
from gradleak.tasks.client import ClientResult, train_client
from gradleak.types import AttackInputError, LocalTraining, ModelModifyingAttack, Observation, Update
from synthetic import synthetic_dataset

SHAPE = (1, 12, 12)
CLASSES = 3
FEDSGD = LocalTraining(protocol="fedsgd", batch_size=64)


@pytest.fixture(scope="module")
def pool() -> ImageDataset:
    return synthetic_dataset(n=400, shape=SHAPE, classes=CLASSES, seed=1)


@pytest.fixture(scope="module")
def public() -> torch.Tensor:
    return synthetic_dataset(n=300, shape=SHAPE, classes=CLASSES, seed=2).images


def honest() -> nn.Module:
    return build_model("aegis_cnn", SHAPE, CLASSES, seed=0)


def prepared(public: torch.Tensor, **opts) -> tuple[RobbingTheFed, MaliciousModel, dict]:
    attack = create_attack("robbing_the_fed", **opts)
    assert isinstance(attack, RobbingTheFed) and isinstance(attack, ModelModifyingAttack)
    model, secrets = attack.prepare(honest(), public, generator=torch.Generator().manual_seed(0))
    assert isinstance(model, MaliciousModel)
    return attack, model, dict(secrets)


def bin_of(model: MaliciousModel, images: torch.Tensor) -> torch.Tensor:
    """Index of the highest bin each sample fires (-1: none); test-side knowledge of the truth."""
    with torch.no_grad():
        return (model.imprint.bins(images) > 0).sum(dim=1) - 1


def pick(model: MaliciousModel, pool: ImageDataset, n: int, collide: bool = False) -> ImageDataset:
    """``n`` samples in distinct bins (with ``collide``: the first two share a bin, the rest distinct)."""
    bins = bin_of(model, pool.images).tolist()
    chosen: list[int] = []
    used: set[int] = set()
    if collide:
        first = next(i for i, b in enumerate(bins) if b >= 0 and bins.count(b) >= 2)
        second = next(i for i, b in enumerate(bins) if b == bins[first] and i != first)
        chosen, used = [first, second], {bins[first]}
    for i, b in enumerate(bins):
        if len(chosen) == n:
            break
        if b >= 0 and b not in used and i not in chosen:
            chosen.append(i)
            used.add(b)
    assert len(chosen) == n
    return pool.subset(torch.tensor(chosen))


def observe(model: nn.Module, data: ImageDataset, training: LocalTraining, secrets: dict) -> tuple:
    result = train_client(7, model, data, training, [], torch.Generator().manual_seed(3))
    (obs,) = server_view(model, [result], input_shape=SHAPE, num_classes=CLASSES, secure_aggregation=False,
                         training=None, secrets=secrets)  # fmt: skip
    return obs, result


def test_one_sample_per_bin_is_recovered_exactly(pool, public):
    attack, model, secrets = prepared(public, num_bins=128)
    data = pick(model, pool, 10)
    obs, _ = observe(model, data, FEDSGD, secrets)
    rec = attack.reconstruct(obs, generator=torch.Generator())
    assert rec.images is not None and rec.images.shape == (10, *SHAPE)
    scores = score_images(rec.images, data.images)
    assert min(scores.psnr) > 60.0  # every image, exactly (float32 rounding only)
    assert scores.reconstruction_rate == 1.0


def test_two_samples_in_one_bin_give_their_gradient_weighted_average(pool, public):
    attack, model, secrets = prepared(public, num_bins=64)
    data = pick(model, pool, 6, collide=True)
    obs, _ = observe(model, data, FEDSGD, secrets)
    rec = attack.reconstruct(obs, generator=torch.Generator())
    # The per-sample weight g_n = dL/dh_{n,i} (the same for every bin n fires), read on the truth side.
    work = copy.deepcopy(model)
    h = work.imprint.bins(data.images)
    h.retain_grad()
    shift = work.imprint.back_weight * h.mean(dim=1)
    out = work.body(data.images + shift.view(-1, 1, 1, 1))
    torch.nn.functional.cross_entropy(out, data.labels).backward()
    g = h.grad.sum(dim=1) / (h > 0).sum(dim=1)  # equal entries per row; take their mean
    x = data.images.reshape(len(data), -1).double()
    average = ((g[0] * x[0] + g[1] * x[1]) / (g[0] + g[1])).reshape(1, *SHAPE).float()
    plain = data.images[:2].mean(dim=0, keepdim=True)
    assert rec.images is not None and len(rec.images) == 5  # 6 samples, 5 non-empty bins
    best = max(float(psnr(rec.images[j : j + 1], average.clamp(0, 1))) for j in range(5))
    assert best > 60.0
    assert g[0] * g[1] > 0  # same sign: the mixture is a convex combination of the two images
    if abs(float(g[0] - g[1])) < 0.05 * abs(float(g[0])):  # nearly equal weights: the plain average
        assert max(float(psnr(rec.images[j : j + 1], plain)) for j in range(5)) > 40.0
    matched = score_images(rec.images, data.images)
    assert matched.reconstruction_rate == pytest.approx(4 / 6)  # the colliding pair is not recovered alone


def test_fedavg_sgd_steps_recover_and_degrade_gracefully(pool, public):
    attack, model, secrets = prepared(public, num_bins=128, back_weight=10.0)
    data = pick(model, pool, 10)
    for epochs, floor in ((1, 40.0), (3, 18.0)):
        training = LocalTraining("fedavg", epochs=epochs, batch_size=64, lr=1e-3, optimizer="sgd")
        obs, _ = observe(model, data, training, secrets)
        assert obs.update.kind == "delta"
        rec = attack.reconstruct(obs, generator=torch.Generator())
        scores = score_images(rec.images, data.images)
        assert rec.stats["local_steps"] == float(epochs)
        assert scores.psnr_mean > floor, (epochs, scores.psnr)


def test_the_adam_tuned_imprint_recovers_through_an_adam_step(pool, public):
    adam = LocalTraining("fedavg", epochs=1, batch_size=64, lr=1e-3, optimizer="adam")
    attack, model, secrets = prepared(public, num_bins=128, tuned_for="adam", adam_margin=1e-4, scale=1e-2)
    data = pick(model, pool, 10)
    obs, _ = observe(model, data, adam, secrets)
    scores = score_images(attack.reconstruct(obs, generator=torch.Generator()).images, data.images)
    assert scores.reconstruction_rate >= 0.9, scores.psnr


def test_an_update_without_the_imprint_parameters_is_a_clear_error(pool, public):
    attack, model, secrets = prepared(public, num_bins=32)
    data = pick(model, pool, 4)
    plain = honest()
    result = train_client(0, plain, data, FEDSGD, [], torch.Generator().manual_seed(0))
    (obs,) = server_view(plain, [result], input_shape=SHAPE, num_classes=CLASSES, secure_aggregation=False,
                         training=None, secrets=secrets)  # fmt: skip
    with pytest.raises(AttackInputError, match="lacks the imprint parameters"):
        attack.reconstruct(obs, generator=torch.Generator())
    (obs,) = server_view(plain, [result], input_shape=SHAPE, num_classes=CLASSES, secure_aggregation=False,
                         training=None)  # fmt: skip
    with pytest.raises(AttackInputError, match="no imprint layer"):
        attack.reconstruct(obs, generator=torch.Generator())


def test_bins_that_do_not_match_the_broadcast_model_are_a_clear_error(pool, public):
    attack, model, secrets = prepared(public, num_bins=32)
    obs, _ = observe(model, pick(model, pool, 4), FEDSGD, secrets)
    wrong_count = {**secrets, "num_bins": 64}
    with pytest.raises(AttackInputError, match="bins do not match"):
        attack.reconstruct(dataclasses.replace(obs, secrets=wrong_count), generator=torch.Generator())
    _, _, other = prepared(public, num_bins=32, measurement="mean")  # same shape, other cuts
    with pytest.raises(AttackInputError, match="bins do not match"):
        attack.reconstruct(dataclasses.replace(obs, secrets=other), generator=torch.Generator())
    _, _, bigger = prepared(public, num_bins=48)
    with pytest.raises(AttackInputError, match="bins do not match"):
        attack.reconstruct(dataclasses.replace(obs, secrets=bigger), generator=torch.Generator())
    with pytest.raises(AttackInputError, match="malformed"):
        attack.reconstruct(
            dataclasses.replace(obs, secrets={"imprint_weight": "x"}), generator=torch.Generator()
        )


def test_secrets_are_optional_the_attack_finds_its_block_in_the_broadcast(pool, public):
    attack, model, _ = prepared(public, num_bins=128)
    data = pick(model, pool, 6)
    obs, _ = observe(model, data, FEDSGD, {})
    scores = score_images(attack.reconstruct(obs, generator=torch.Generator()).images, data.images)
    assert scores.reconstruction_rate == 1.0


def _reachable(root: object) -> list[object]:
    """Every object reachable from ``root`` through dataclass fields, mappings, sequences, module state."""
    seen: dict[int, object] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, str | int | float | bool | torch.dtype):
            continue
        seen[id(obj)] = obj
        if isinstance(obj, nn.Module):
            stack.extend(obj.state_dict(keep_vars=True).values())
            stack.extend(v for v in vars(obj).values() if not isinstance(v, dict))
            stack.extend(obj._modules.values())
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set):
            stack.extend(obj)
    return list(seen.values())


def test_ground_truth_is_unreachable_from_the_observation(pool, public):
    _, model, secrets = prepared(public, num_bins=32)
    data = pick(model, pool, 4)
    obs, result = observe(model, data, FEDSGD, secrets)
    assert isinstance(result, ClientResult) and result.truth is not None
    assert {f.name for f in dataclasses.fields(Observation)}.isdisjoint({"truth", "images", "data"})
    objects = _reachable(obs)
    assert not any(isinstance(o, ImageDataset | ClientResult) for o in objects)
    truth_storage = {
        result.truth.images.untyped_storage().data_ptr(),
        data.images.untyped_storage().data_ptr(),
    }
    tensors = [o for o in objects if isinstance(o, torch.Tensor)]
    assert tensors and all(t.untyped_storage().data_ptr() not in truth_storage for t in tensors)
    flat = result.truth.images.reshape(len(data), -1)
    for t in tensors:  # nor does any tensor hold a client image verbatim
        if t.dim() >= 1 and t.shape[-1] == flat.shape[1]:
            rows = t.reshape(-1, flat.shape[1]).to(flat.dtype)
            assert not any(torch.equal(r, f) for r in rows for f in flat)
    assert obs.labels is None


def test_config_is_validated():
    for bad in ({"num_bins": 1}, {"measurement": "fourier"}, {"tuned_for": "rmsprop"}, {"scale": 0.0},
                {"max_images": 0}, {"rel_tol": 1.0}):  # fmt: skip
        with pytest.raises(ValueError):
            RobbingTheFedConfig(**bad)
    with pytest.raises(ValueError, match="public auxiliary images"):
        RobbingTheFed().prepare(honest(), None, generator=torch.Generator())


def test_the_aegis_aware_variant_sizes_its_bins_and_keeps_the_imprint_options():
    """rtf_aegis: k = ceil((n + M) / ln(1 / isolation)); every bin returned; nested imprint options kept."""
    aware = create_attack("rtf_aegis", cache_size=2048, real_samples=512, imprint={"tuned_for": "adam"})
    assert aware.config.num_bins == 8899  # 2560 / ln(4 / 3) = 8898.6
    assert create_attack("rtf_aegis", isolation=0.5, cache_size=100, real_samples=10).config.num_bins == 159
    inner = aware._rtf.config
    assert (inner.num_bins, inner.max_images, inner.tuned_for) == (8899, 8899, "adam")
    for bad, match in (
        ({"isolation": 0.995}, "isolation must be in"),
        ({"isolation": 0.0}, "isolation must be in"),
        ({"cache_size": 0}, "cache_size must be an int"),
        ({"real_samples": 2.5}, "real_samples"),
        ({"imprint": {"num_bins": 64}}, "sets imprint.num_bins itself"),
        ({"imprint": {"max_images": 3}}, "sets imprint.max_images itself"),
        ({"imprint": "adam"}, "imprint must be a table"),
    ):
        with pytest.raises(ValueError, match=match):
            create_attack("rtf_aegis", **bad)


def test_update_type_is_unchanged_for_the_client(pool, public):
    """The client trains the broadcast as an ordinary model: its update names every malicious parameter."""
    _, model, _ = prepared(public, num_bins=32)
    result = train_client(0, model, pick(model, pool, 4), FEDSGD, [], torch.Generator().manual_seed(0))
    assert isinstance(result.update, Update)
    assert set(result.update.tensors) == {n for n, _ in model.named_parameters()}
    assert "imprint.linear.weight" in result.update.tensors


def test_prepare_leaves_the_honest_model_untouched_and_barely_changes_its_outputs(pool, public):
    model = honest()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    attack = RobbingTheFed(RobbingTheFedConfig(num_bins=64))
    malicious, _ = attack.prepare(model, public, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert malicious.body is not model
    with torch.no_grad():
        shift = (malicious(pool.images[:32]) - model(pool.images[:32])).abs().max()
    assert float(shift) < 0.05  # the back-connection adds a small, bounded shift: training stays stable
