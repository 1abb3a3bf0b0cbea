"""LegacyAuditStrategy driven directly (no Ray): each FitRes is attacked as the Message-API wrapper attacks
a reply, a bad one is rejected and left out of the wrapped strategy's aggregate, a SecAgg+ aggregate (one
``Parameters`` object in every FitRes) is attacked once, and an invalid aggregate is never applied."""

from __future__ import annotations

import math

import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.server.client_proxy import ClientProxy  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402

from gradleak.attacks import create_attack  # noqa: E402
from gradleak.experiments.store import ResultStore  # noqa: E402
from gradleak.fl.simulation import derive_seed  # noqa: E402
from gradleak.integrations.flower import LegacyAuditStrategy  # noqa: E402
from gradleak.integrations.flower.apps import named_arrays  # noqa: E402
from gradleak.models import build_model  # noqa: E402
from gradleak.types import Observation, Update  # noqa: E402
from gradleak.validation import InvalidUpdateError  # noqa: E402

SHAPE, CLASSES = (1, 12, 12), 3
IG = ("ig", {"max_iterations": 3})


def new_model() -> torch.nn.Module:
    return build_model("sme_cnn", SHAPE, CLASSES, seed=0)


class Proxy(ClientProxy):
    def __init__(self, node_id: int) -> None:
        super().__init__(str(node_id))
        self.node_id = node_id

    get_properties = get_parameters = fit = evaluate = reconnect = None  # type: ignore[assignment]


def weights(shift: float, nan: bool = False) -> list:
    out = []
    for t in new_model().state_dict().values():
        v = t.clone() + shift
        if nan:
            v.fill_(math.nan)
        out.append(v.numpy())
    return out


def fitres(arrays, n: int = 4) -> FitRes:
    params = arrays if not isinstance(arrays, list) else ndarrays_to_parameters(arrays)
    return FitRes(Status(Code.OK, ""), params, n, {})


def wrapper(tmp_path) -> tuple[LegacyAuditStrategy, ResultStore]:
    store = ResultStore(tmp_path / "legacy.sqlite")
    inner = FedAvg(fraction_evaluate=0.0)
    return LegacyAuditStrategy(inner, model=new_model(), attacks=[IG], input_shape=SHAPE, num_classes=CLASSES,
                               store=store, seed=3), store  # fmt: skip


def sent(strategy: LegacyAuditStrategy) -> None:
    strategy.configure_fit(1, ndarrays_to_parameters(weights(0.0)), client_manager=_NoClients())


class _NoClients:
    """configure_fit's client manager: FedAvg samples from it; none needed to record the broadcast."""

    def num_available(self) -> int:
        return 0

    def sample(self, num_clients, min_num_clients=None, criterion=None):  # noqa: ARG002
        return []


def test_each_fitres_is_attacked_and_a_bad_one_is_rejected_and_not_aggregated(tmp_path):
    strategy, store = wrapper(tmp_path)
    sent(strategy)
    results = [(Proxy(11), fitres(weights(0.01))), (Proxy(12), fitres(weights(0.0, nan=True))),
               (Proxy(13), fitres(weights(-0.02)))]  # fmt: skip
    params, _ = strategy.aggregate_fit(1, results, [RuntimeError("node 14 lost")])
    strategy.close()
    (run,) = store.runs()
    attacks = store.records(run.run_id, "attack")
    assert sorted(r["node_id"] for r in attacks) == [11, 13] and not any(r["aggregated"] for r in attacks)
    (rejected,) = store.records(run.run_id, "rejected")
    assert rejected["node_id"] == 12 and "non-finite" in rejected["error"]
    (lost,) = store.records(run.run_id, "client_error")
    assert lost["node_id"] is None and "node 14 lost" in lost["error"]
    # the aggregate is the mean of nodes 11 and 13 only: w0 + (0.01 - 0.02) / 2
    w0 = new_model().state_dict()
    got = named_arrays(new_model(), params, "aggregate")
    assert all(torch.allclose(got[n], w0[n] - 0.005, atol=1e-6) for n in w0)
    # node 11's record is the attack on its update w_T - w_0, the in-process seed
    model = new_model().eval()
    wt = named_arrays(new_model(), ndarrays_to_parameters(weights(0.01)), "node 11")
    update = Update({n: wt[n] - w0[n] for n, _ in model.named_parameters()}, 4, "delta", {})
    gen = torch.Generator().manual_seed(derive_seed(3, 1, 11, 0))
    rec = create_attack(IG[0], **IG[1]).reconstruct(Observation(model, update, SHAPE, CLASSES), generator=gen)
    node11 = next(r for r in attacks if r["node_id"] == 11)
    assert node11["matching_loss"] == pytest.approx(rec.stats["matching_loss"], rel=1e-6)


def test_a_secagg_aggregate_is_attacked_once_and_an_invalid_one_is_never_applied(tmp_path):
    strategy, store = wrapper(tmp_path)
    sent(strategy)
    shared = ndarrays_to_parameters([a.astype("float64") for a in weights(0.01)])  # SecAgg+: float64
    results = [(Proxy(n), fitres(shared, n=3)) for n in (11, 12, 13)]
    params, _ = strategy.aggregate_fit(1, results, [])
    (record,) = store.records(strategy.run_id, "attack")
    assert record["node_id"] is None and record["aggregated"] and record["num_clients"] == 3
    assert record["num_samples"] == 9
    assert params is not None and len(parameters_to_ndarrays(params)) == len(new_model().state_dict())
    sent(strategy)  # round 1 again, now with a NaN aggregate: recorded, the model is left unchanged
    bad = ndarrays_to_parameters(weights(0.0, nan=True))
    params, metrics = strategy.aggregate_fit(1, [(Proxy(n), fitres(bad)) for n in (11, 12)], [])
    assert params is None and metrics == {}
    (rejected,) = store.records(strategy.run_id, "rejected")
    assert rejected["node_id"] is None and rejected["num_clients"] == 2 and "non-finite" in rejected["error"]


def test_arrays_that_do_not_fit_the_model_are_named_in_the_error():
    arrays = weights(0.0)
    with pytest.raises(InvalidUpdateError, match="arrays, but the model's state_dict has"):
        named_arrays(new_model(), ndarrays_to_parameters(arrays[:-1]), "node 5")
    arrays[0] = arrays[0].reshape(-1)
    with pytest.raises(InvalidUpdateError, match="node 5: array 'features.0.weight' has shape"):
        named_arrays(new_model(), ndarrays_to_parameters(arrays), "node 5")


def test_aggregating_without_configure_fit_is_refused(tmp_path):
    strategy, _ = wrapper(tmp_path)
    with pytest.raises(RuntimeError, match="no parameters went through configure_fit"):
        strategy.aggregate_fit(1, [(Proxy(1), fitres(weights(0.0)))], [])
