"""LegacyAuditStrategy driven directly (no Ray): each FitRes is attacked as the Message-API wrapper attacks
a reply, a bad one is rejected and left out of the wrapped strategy's aggregate, a SecAgg+ aggregate (one
``Parameters`` object in every FitRes) is attacked once and scored on the union of the clients' data, an
invalid aggregate is never applied, and a round SecAgg+ halted is recorded. And the SecAgg+ paths that need
no Ray: a client outside the clipping range withholds its reply (gradleak's client_app and the engine's
node), and the engine reports a halted protocol for every client."""

from __future__ import annotations

import math

import pytest
import torch

flwr = pytest.importorskip("flwr")

import flwr.compat.common.recorddict_compat as compat  # noqa: E402
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict  # noqa: E402
from flwr.common import Code, FitIns, FitRes, Status, ndarrays_to_parameters  # noqa: E402
from flwr.server.client_proxy import ClientProxy  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402

from flowergrid import server_identity as flower_server_identity  # noqa: E402
from gradleak.attacks import create_attack  # noqa: E402
from gradleak.audit import audit_generators, score_reconstruction  # noqa: E402
from gradleak.data.base import ImageDataset  # noqa: E402
from gradleak.experiments.store import ResultStore  # noqa: E402
from gradleak.federation.simulation import ClientTask  # noqa: E402
from gradleak.integrations.flower import LegacyAuditStrategy  # noqa: E402
from gradleak.integrations.flower.apps import (  # noqa: E402
    SECAGG_STATE,
    check_secagg_range,
    named_arrays,
)
from gradleak.integrations.flower.config import SecAggPlusConfig  # noqa: E402
from gradleak.integrations.flower.engine import (  # noqa: E402
    SecureGridEngine,
    _SecureTasks,
    secure_reply,
    task_config,
)
from gradleak.models import build_model  # noqa: E402
from gradleak.models.architecture import describe  # noqa: E402
from gradleak.types import LocalTraining, Observation, Update  # noqa: E402
from gradleak.validation import InvalidUpdateError  # noqa: E402
from synthetic import synthetic_dataset  # noqa: E402

SHAPE, CLASSES = (1, 12, 12), 3
IG = ("ig", {"max_iterations": 3})
FEDSGD = LocalTraining("fedsgd", batch_size=3)


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


def fitres(arrays, n: int = 4, partition: int | None = None) -> FitRes:
    params = arrays if not isinstance(arrays, list) else ndarrays_to_parameters(arrays)
    return FitRes(Status(Code.OK, ""), params, n, {} if partition is None else {"partition-id": partition})


def wrapper(tmp_path) -> tuple[LegacyAuditStrategy, ResultStore]:
    store = ResultStore(tmp_path / "legacy.sqlite")
    inner = FedAvg(fraction_evaluate=0.0)
    return LegacyAuditStrategy(inner, model=new_model(), attacks=[IG], input_shape=SHAPE, num_classes=CLASSES,
                               store=store, seed=3), store  # fmt: skip


def sent(strategy: LegacyAuditStrategy, server_round: int = 1) -> None:
    strategy.configure_fit(server_round, ndarrays_to_parameters(weights(0.0)), client_manager=_NoClients())


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
    got = named_arrays(w0, params, "aggregate")
    assert all(torch.allclose(got[n], w0[n] - 0.005, atol=1e-6) for n in w0)
    # node 11's record is the attack on its update w_T - w_0, the in-process seed
    model = new_model().eval()
    wt = named_arrays(w0, ndarrays_to_parameters(weights(0.01)), "node 11")
    update = Update({n: wt[n] - w0[n] for n, _ in model.named_parameters()}, 4, "delta", {})
    node11 = next(r for r in attacks if r["node_id"] == 11)
    gen, _ = audit_generators(3, 0, node11["audit_index"])  # the audit's seed rule (gradleak.audit)
    rec = create_attack(IG[0], **IG[1]).reconstruct(Observation(model, update, SHAPE, CLASSES), generator=gen)
    assert node11["matching_loss"] == pytest.approx(rec.stats["matching_loss"], rel=1e-6)


def test_a_secagg_aggregate_is_attacked_once_and_an_invalid_one_is_never_applied(tmp_path):
    store = ResultStore(tmp_path / "legacy.sqlite")
    data = {p: synthetic_dataset(n=3, shape=SHAPE, classes=CLASSES, seed=p) for p in (0, 1, 2)}
    strategy = LegacyAuditStrategy(FedAvg(fraction_evaluate=0.0), model=new_model(), attacks=[IG],
                                   input_shape=SHAPE, num_classes=CLASSES, store=store, seed=3,
                                   truth=data.get)  # fmt: skip
    sent(strategy)
    shared = ndarrays_to_parameters([a.astype("float64") for a in weights(0.01)])  # SecAgg+: float64
    results = [(Proxy(n), fitres(shared, n=3, partition=n - 11)) for n in (11, 12, 13)]
    params, _ = strategy.aggregate_fit(1, results, [])
    (record,) = store.records(strategy.run_id, "attack")
    assert record["node_id"] is None and record["aggregated"] and record["num_clients"] == 3
    assert record["num_samples"] == 9 and record["aggregate"] == "weighted mean"
    # the attacked update is the aggregate minus the round's model (float32), scored on the 3 clients' data
    w0, model = new_model().state_dict(), new_model().eval()
    agg = named_arrays(w0, shared, "aggregate")
    update = Update({n: agg[n] - w0[n] for n, _ in model.named_parameters()}, 9, "delta", {})
    obs = Observation(model, update, SHAPE, CLASSES, aggregated=True, num_clients=3)
    rec = create_attack(IG[0], **IG[1]).reconstruct(
        obs, generator=audit_generators(3, 0, record["audit_index"])[0]
    )
    assert record["matching_loss"] == pytest.approx(rec.stats["matching_loss"], rel=1e-6)
    union = ImageDataset.concat([data[0], data[1], data[2]])
    assert record["psnr"] == pytest.approx(score_reconstruction(rec, union)["psnr"], rel=1e-5)
    # the wrapped FedAvg's mean of identical arrays is the aggregate itself
    got = named_arrays(w0, params, "new model")
    assert all(torch.allclose(got[n], agg[n]) for n in w0)
    sent(strategy)  # round 1 again, now with a NaN aggregate: recorded, the model is left unchanged
    bad = ndarrays_to_parameters(weights(0.0, nan=True))
    params, metrics = strategy.aggregate_fit(1, [(Proxy(n), fitres(bad)) for n in (11, 12)], [])
    assert params is None and metrics == {}
    (rejected,) = store.records(strategy.run_id, "rejected")
    assert rejected["node_id"] is None and rejected["num_clients"] == 2 and "non-finite" in rejected["error"]


def test_arrays_that_do_not_fit_the_model_are_named_in_the_error():
    arrays = weights(0.0)
    reference = new_model().state_dict()
    with pytest.raises(InvalidUpdateError, match="arrays, but the model has 8 entries to fill"):
        named_arrays(reference, ndarrays_to_parameters(arrays[:-1]), "node 5")
    arrays[0] = arrays[0].reshape(-1)
    with pytest.raises(InvalidUpdateError, match="node 5: array 'features.0.weight' has shape"):
        named_arrays(reference, ndarrays_to_parameters(arrays), "node 5")


def test_a_round_that_never_reaches_aggregate_fit_is_recorded(tmp_path):
    strategy, store = wrapper(tmp_path)

    def workflow(grid, context) -> None:  # two rounds go out; SecAgg+ halts in both: no aggregate_fit
        sent(strategy, 1)
        sent(strategy, 2)  # round 1 is still open when round 2 starts: recorded then

    strategy.run(workflow, None, None)  # round 2: recorded when the workflow returns
    (run,) = store.runs()
    halted = store.records(run.run_id, "no_aggregate")
    assert [h["round"] for h in halted] == [1, 2] and "SecAgg+ halted" in halted[0]["error"]
    assert run.status == "complete"


def test_the_reply_of_a_legacy_client_under_secagg_is_withheld_outside_the_clipping_range():
    ctx = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    ctx.state.config_records[SECAGG_STATE] = ConfigRecord({"clipping_range": 8.0})
    fine = {"w": torch.full((3,), 7.5), "count": torch.tensor(3)}
    check_secagg_range(fine, ctx, "partition 0")
    for bad in ({"w": torch.tensor([1.0, 9.0])}, {"w": torch.tensor([math.nan])}, {"n": torch.tensor(12)}):
        with pytest.raises(ValueError, match="beyond SecAgg\\+'s clipping_range 8.0: the reply is withheld"):
            check_secagg_range(bad, ctx, "partition 0")
    check_secagg_range({"w": torch.tensor([100.0])}, Context(1, 5, {}, RecordDict(), {}), "no SecAgg+")


def test_the_engine_reports_a_halted_secagg_run_for_every_client():
    engine = SecureGridEngine(None, {0: 10, 1: 11}, tuple, 5.0, None, SecAggPlusConfig(enabled=True))
    tasks = [
        ClientTask(k, synthetic_dataset(n=4, shape=SHAPE, classes=CLASSES, seed=k), FEDSGD, k) for k in (0, 1)
    ]
    secure = engine.secure_round(new_model(), tasks, _SecureTasks([]), weighted=False)  # never unmasked
    assert secure.aggregate is None and secure.contributors == []
    assert all("halted before unmasking" in r.error for r in secure.results)


@pytest.fixture
def server_identity():
    with flower_server_identity(0):
        yield


def test_a_secagg_node_withholds_an_update_outside_the_clipping_range(server_identity):
    data = [synthetic_dataset(n=4, shape=SHAPE, classes=CLASSES, seed=0)]
    task = ClientTask(0, data[0], FEDSGD, seed=1)
    config = {
        **task_config(task),
        "spec": describe(new_model()),
        "weighted": False,
        "clipping-range": 1e-6,
    }
    weights = ndarrays_to_parameters([t.numpy() for t in new_model().state_dict().values()])
    content = compat.fitins_to_recorddict(FitIns(weights, config), keep_input=True)
    msg = Message(content, dst_node_id=1, message_type=MessageType.TRAIN)
    with pytest.raises(
        ValueError, match=r"client 0: an update entry reaches .* beyond SecAgg\+'s clipping_range 1e-06"
    ):
        secure_reply(msg, data, tuple)
    config["clipping-range"] = 8.0
    content = compat.fitins_to_recorddict(FitIns(weights, config), keep_input=True)
    reply = secure_reply(Message(content, dst_node_id=1, message_type=MessageType.TRAIN), data, tuple)
    res = compat.recorddict_to_fitres(reply.content, keep_input=True)
    assert res.num_examples == 1 and res.metrics["samples"] == 3  # unweighted: every client weighs 1


def test_aggregating_without_configure_fit_is_refused(tmp_path):
    strategy, _ = wrapper(tmp_path)
    with pytest.raises(RuntimeError, match="no parameters went through configure_fit"):
        strategy.aggregate_fit(1, [(Proxy(1), fitres(weights(0.0)))], [])
