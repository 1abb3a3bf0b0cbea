"""FL engine: FedSGD equals the model gradient, FedAvg equals a hand-written loop, aggregation is the
hand-computed weighted mean, secure aggregation shows only the sum, defenses fail closed."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gradleak.defenses.base import Defense
from gradleak.federation import (
    FederatedSimulation,
    FLConfig,
    apply_update,
    sample_clients,
    secure_sum,
    server_view,
    train_client,
    weighted_mean,
)
from gradleak.models import build_model
from gradleak.types import LocalTraining, Update
from synthetic import synthetic_dataset


def small_model(seed: int = 0) -> nn.Module:
    return build_model("lenet", (1, 12, 12), 3, seed=seed)


def test_fedsgd_update_equals_model_gradient(tiny_data):
    model = small_model()
    training = LocalTraining(protocol="fedsgd", batch_size=5)
    res = train_client(7, model, tiny_data, training, [], torch.Generator().manual_seed(3))
    assert res.update is not None and res.update.kind == "gradient" and res.update.num_samples == 5
    batch = res.truth
    assert batch is not None and len(batch) == 5
    # slow, obvious reference: per-sample gradients averaged by hand
    ref = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(5):
        loss = F.cross_entropy(model(batch.images[i : i + 1]), batch.labels[i : i + 1])
        for (n, _), g in zip(
            model.named_parameters(), torch.autograd.grad(loss, list(model.parameters())), strict=True
        ):
            ref[n] += g / 5
    for n, t in res.update.tensors.items():
        torch.testing.assert_close(t, ref[n], atol=1e-6, rtol=1e-5)
    # the truth batch is a subset of the client's data, and the broadcast model is untouched
    assert all(any(torch.equal(x, y) for y in tiny_data.images) for x in batch.images)
    assert res.update.metadata["client_id"] == 7


@pytest.mark.parametrize(("optimizer", "momentum"), [("sgd", 0.0), ("adam", 0.0), ("sgd", 0.9)])
def test_fedavg_delta_matches_handwritten_loop(tiny_data, optimizer, momentum):
    model = small_model()
    w0 = copy.deepcopy(model.state_dict())
    training = LocalTraining(
        protocol="fedavg", epochs=2, batch_size=8, lr=0.05, optimizer=optimizer, momentum=momentum
    )
    res = train_client(0, model, tiny_data, training, [], torch.Generator().manual_seed(11))
    # the broadcast model must not move
    for k, v in model.state_dict().items():
        assert torch.equal(v, w0[k])
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=0.05) if optimizer == "adam" else None
    velocity = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}  # heavy ball: v = mu v + g
    gen = torch.Generator().manual_seed(11)
    for _ in range(2):
        for idx in torch.randperm(len(tiny_data), generator=gen).split(8):
            ref.zero_grad()
            F.cross_entropy(ref(tiny_data.images[idx]), tiny_data.labels[idx]).backward()
            if opt is not None:
                opt.step()
                continue
            with torch.no_grad():
                for n, p in ref.named_parameters():
                    velocity[n] = momentum * velocity[n] + p.grad
                    p -= 0.05 * velocity[n]
    assert res.update is not None and res.update.metadata["local_steps"] == 6
    for n, p in ref.named_parameters():
        torch.testing.assert_close(res.update.tensors[n], p.detach() - w0[n], atol=1e-6, rtol=1e-5)


def _upd(values: list[float], n: int, kind: str = "delta") -> Update:
    return Update({"a": torch.tensor(values), "b": torch.tensor([[values[0]]])}, n, kind=kind)  # type: ignore[arg-type]


def test_weighted_mean_matches_hand_computation():
    u1, u2, u3 = _upd([1.0, 2.0], 10), _upd([3.0, -1.0], 30), _upd([0.0, 4.0], 60)
    agg = weighted_mean([u1, u2, u3])
    # by hand: (10*[1,2] + 30*[3,-1] + 60*[0,4]) / 100 = [1.0, 2.3]
    torch.testing.assert_close(agg.tensors["a"], torch.tensor([1.0, 2.3]))
    torch.testing.assert_close(agg.tensors["b"], torch.tensor([[1.0]]))
    assert agg.num_samples == 100
    s = secure_sum([u1, u2, u3])
    torch.testing.assert_close(s.tensors["a"], torch.tensor([4.0, 5.0]))


def test_aggregation_rejects_mixed_or_empty():
    with pytest.raises(ValueError, match="empty"):
        weighted_mean([])
    with pytest.raises(ValueError, match="mixed kinds"):
        weighted_mean([_upd([1.0, 1.0], 1), _upd([1.0, 1.0], 1, kind="gradient")])
    with pytest.raises(ValueError, match="zero"):
        weighted_mean([_upd([1.0, 1.0], 0)])


def test_apply_update_sign():
    lin = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    apply_update(lin, Update({"weight": torch.tensor([[0.5]])}, 1, kind="delta"))
    assert float(lin.weight.detach()) == pytest.approx(1.5)
    apply_update(lin, Update({"weight": torch.tensor([[0.5]])}, 1, kind="gradient"), server_lr=2.0)
    assert float(lin.weight.detach()) == pytest.approx(0.5)


def test_client_sampling_fraction_and_determinism():
    a = sample_clients(100, 0.1, np.random.default_rng(5))
    b = sample_clients(100, 0.1, np.random.default_rng(5))
    assert a == b and len(a) == 10 and len(set(a)) == 10 and all(0 <= i < 100 for i in a)
    assert sample_clients(100, 0.001, np.random.default_rng(0)).__len__() == 1
    with pytest.raises(ValueError, match="fraction"):
        sample_clients(10, 0.0, np.random.default_rng(0))


def _federation(seed: int = 0, defenses=tuple, secagg: bool = False) -> FederatedSimulation:
    clients = [synthetic_dataset(12, seed=s) for s in range(6)]
    cfg = FLConfig(rounds=2, fraction=0.5, training=LocalTraining(epochs=1, batch_size=4, lr=0.1),
                   secure_aggregation=secagg)  # fmt: skip
    return FederatedSimulation(small_model(), clients, cfg, seed=seed, test=synthetic_dataset(30, seed=99),
                               defenses=defenses)  # fmt: skip


def test_round_applies_weighted_mean_of_client_deltas():
    sim = _federation()
    before = copy.deepcopy(sim.model.state_dict())
    rr = sim.run_round(0)
    assert len(rr.client_ids) == 3 and rr.accuracy is not None and 0.0 <= rr.accuracy <= 1.0
    deltas = [r.update for r in rr.results]
    n = sum(d.num_samples for d in deltas)  # type: ignore[union-attr]
    for name, p in sim.model.named_parameters():
        expect = before[name] + sum(d.num_samples / n * d.tensors[name] for d in deltas)  # type: ignore[union-attr]
        torch.testing.assert_close(p.detach(), expect, atol=1e-6, rtol=1e-5)


def test_simulation_is_seed_deterministic():
    a, b, c = _federation(1), _federation(1), _federation(2)
    for s in (a, b, c):
        s.run()
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert [r.client_ids for r in a.history] == [r.client_ids for r in b.history]
    assert any(not torch.equal(p, q) for p, q in zip(a.model.parameters(), c.model.parameters(), strict=True))


class Exploding(Defense):
    name = "exploding"

    def on_update(self, update: Update) -> Update:
        raise RuntimeError("boom")


class NaNMaker(Defense):
    name = "nan"

    def on_update(self, update: Update) -> Update:
        return update.replace({k: v * float("nan") for k, v in update.tensors.items()})


@pytest.mark.parametrize("defense", [Exploding, NaNMaker])
def test_failing_defense_fails_closed(defense):
    sim = _federation(defenses=lambda: [defense()])
    before = copy.deepcopy(sim.model.state_dict())
    rr = sim.run_round(0)
    assert all(r.update is None and r.truth is None for r in rr.results)  # nothing left any client
    assert rr.dropped == rr.client_ids and rr.aggregate is None
    for k, v in sim.model.state_dict().items():  # the server had nothing to apply
        assert torch.equal(v, before[k])
    assert "boom" in (rr.results[0].error or "") or "non-finite" in (rr.results[0].error or "")


def test_secure_aggregation_view_sees_only_the_sum():
    sim = _federation(secagg=True)
    results = sim.collect([0, 1, 2], LocalTraining(protocol="fedsgd", batch_size=3))
    views = server_view(sim.model, results, input_shape=(1, 12, 12), num_classes=3, secure_aggregation=True,
                        training=None, grant_labels=True)  # fmt: skip
    assert len(views) == 1 and views[0].aggregated and views[0].num_clients == 3
    assert views[0].labels is None  # labels are never granted on a sum
    total = sum(r.update.tensors["classifier.1.weight"] for r in results)  # type: ignore[union-attr]
    torch.testing.assert_close(views[0].update.tensors["classifier.1.weight"], total)
    individual = server_view(sim.model, results, input_shape=(1, 12, 12), num_classes=3,
                             secure_aggregation=False, training=None, grant_labels=True)  # fmt: skip
    assert len(individual) == 3 and torch.equal(individual[1].labels, results[1].truth.labels)  # type: ignore


def test_flconfig_validation():
    with pytest.raises(ValueError, match="fraction"):
        FLConfig(fraction=1.5)
    with pytest.raises(ValueError, match="rounds"):
        FLConfig(rounds=-1)
    with pytest.raises(ValueError, match="optimizer"):
        LocalTraining(optimizer="rmsprop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="momentum"):
        LocalTraining(momentum=1.0)
    with pytest.raises(ValueError, match="'adam' takes no momentum"):
        LocalTraining(optimizer="adam", momentum=0.9)
