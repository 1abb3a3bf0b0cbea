"""AuditStrategy around Flower's own FedAvg, driven by Flower's own round loop (``Strategy.start``) over an
in-process grid of ClientApp train functions that train with gradleak's ``defend``: the records equal the
in-process attack on the same update, a bad reply is rejected and left out of the aggregate, and under
secure aggregation only the sum is attacked."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

flwr = pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from flowergrid import AppGrid  # noqa: E402
from flowergrid import server_identity as flower_server_identity  # noqa: E402
from gradleak.attacks import create_attack  # noqa: E402
from gradleak.audit import audit_generators, score_reconstruction  # noqa: E402
from gradleak.defenses.in_loop import defend  # noqa: E402
from gradleak.experiments.store import ResultStore  # noqa: E402
from gradleak.federation.simulation import derive_seed  # noqa: E402
from gradleak.integrations.flower import AuditStrategy  # noqa: E402
from gradleak.models import build_model  # noqa: E402
from gradleak.types import Observation, Update  # noqa: E402
from synthetic import synthetic_dataset  # noqa: E402

SHAPE, CLASSES = (1, 12, 12), 3
DATA = {node: synthetic_dataset(n=4, shape=SHAPE, classes=CLASSES, seed=node) for node in (11, 12, 13)}
IG = ("ig", {"max_iterations": 5, "lr": 0.1, "tv_weight": 1e-4})


def new_model() -> torch.nn.Module:
    return build_model("sme_cnn", SHAPE, CLASSES, seed=0)


def client_train(node: int, arrays: ArrayRecord, server_round: int, poison: bool = False) -> RecordDict:
    """A ClientApp's @app.train(): one local epoch with gradleak's in-loop API, weights back."""
    model = new_model()
    model.load_state_dict(arrays.to_torch_state_dict())
    gen = torch.Generator().manual_seed(derive_seed(node, server_round))
    loop = defend(model, lambda ps: torch.optim.SGD(ps, lr=0.1), [], generator=gen)
    data = DATA[node]
    for idx in torch.randperm(len(data), generator=gen).split(2):
        loop.optimizer.zero_grad()
        F.cross_entropy(model(data.images[idx]), data.labels[idx]).backward()
        loop.optimizer.step()
    state = model.state_dict()
    if poison:
        state = {k: v.clone().fill_(math.nan) if v.is_floating_point() else v for k, v in state.items()}
    return RecordDict(
        {"arrays": ArrayRecord(torch_state_dict=state), "metrics": MetricRecord({"num-examples": 4})}
    )


def InProcessGrid(poison: set[tuple[int, int]] = frozenset()) -> AppGrid:  # noqa: N802 - reads as a grid
    """Flower's Grid over the in-process train functions of ``client_train`` (no SuperLink, no Ray)."""

    def app(msg: Message, ctx) -> Message:
        node, rnd = msg.metadata.dst_node_id, int(msg.content["config"]["server-round"])
        return Message(
            client_train(node, msg.content["arrays"], rnd, poison=(rnd, node) in poison), reply_to=msg
        )

    return AppGrid(dict.fromkeys(DATA, app), tuple(sorted(DATA)))


@pytest.fixture(autouse=True)
def server_identity():
    with flower_server_identity(0):
        yield


def audited(tmp_path, **options):
    store = ResultStore(tmp_path / "audit.sqlite")
    strategy = AuditStrategy(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3),
        model=new_model(), attacks=[IG], input_shape=SHAPE, num_classes=CLASSES, store=store,
        truth=DATA.get, **options,
    )  # fmt: skip
    return strategy, store


def test_the_wrapper_records_what_the_in_process_attack_gives_on_the_same_update(tmp_path):
    strategy, store = audited(tmp_path)
    initial = ArrayRecord(torch_state_dict=new_model().state_dict())
    result = strategy.start(InProcessGrid(), initial, num_rounds=2, timeout=60)
    (run,) = store.runs()
    records = store.records(run.run_id, "attack")
    assert sorted((r["round"], r["node_id"]) for r in records) == [
        (r, n) for r in (1, 2) for n in (11, 12, 13)
    ]
    assert run.config["strategy"] == "FedAvg" and store.records(run.run_id)[-1]["kind"] == "summary"
    # round 1, node 12, recomputed in process from the same broadcast: the same update, the same attack
    w0 = new_model().state_dict()
    wt = client_train(12, ArrayRecord(torch_state_dict=w0), 1)["arrays"].to_torch_state_dict()
    model = new_model().eval()
    update = Update({n: wt[n] - w0[n] for n, _ in model.named_parameters()}, 4, "delta", {"client_id": 12})
    rec = create_attack(IG[0], **IG[1]).reconstruct(
        Observation(model, update, SHAPE, CLASSES),
        generator=audit_generators(
            0, 0, next(r for r in records if (r["round"], r["node_id"]) == (1, 12))["audit_index"]
        )[0],
    )
    got = next(r for r in records if (r["round"], r["node_id"]) == (1, 12))
    expected = score_reconstruction(rec, DATA[12])
    assert got["matching_loss"] == pytest.approx(rec.stats["matching_loss"], rel=1e-6)
    assert got["psnr"] == pytest.approx(expected["psnr"], rel=1e-5) and got["reconstructed"] == 4
    assert result.arrays is not None  # the wrapped strategy still aggregated


def test_a_bad_reply_is_rejected_recorded_and_left_out_of_the_aggregate(tmp_path):
    strategy, store = audited(tmp_path, rounds=[2])
    initial = ArrayRecord(torch_state_dict=new_model().state_dict())
    result = strategy.start(InProcessGrid(poison={(1, 13)}), initial, num_rounds=2, timeout=60)
    (run,) = store.runs()
    (rejected,) = store.records(run.run_id, "rejected")
    assert (rejected["round"], rejected["node_id"]) == (1, 13) and "non-finite" in rejected["error"]
    attacks = store.records(run.run_id, "attack")
    assert sorted(r["node_id"] for r in attacks) == [11, 12, 13] and {r["round"] for r in attacks} == {2}
    final = result.arrays.to_torch_state_dict()
    assert all(bool(torch.isfinite(t).all()) for t in final.values())  # the NaN never reached the model


def test_under_secure_aggregation_only_the_sum_is_attacked(tmp_path):
    strategy, store = audited(tmp_path, secure_aggregation=True)
    strategy.start(InProcessGrid(), ArrayRecord(torch_state_dict=new_model().state_dict()), num_rounds=1)
    (run,) = store.runs()
    (record,) = store.records(run.run_id, "attack")
    assert record["node_id"] is None and record["aggregated"] and record["num_clients"] == 3
    assert record["num_samples"] == 12 and "psnr" not in record  # no per-client truth for a sum


def test_unknown_attacks_fail_when_the_wrapper_is_built(tmp_path):
    with pytest.raises(KeyError, match="unknown attack"):
        AuditStrategy(FedAvg(), model=new_model(), attacks=["nope"], input_shape=SHAPE, num_classes=CLASSES)


class BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3)
        self.bn = torch.nn.BatchNorm2d(2)
        self.fc = torch.nn.Linear(2 * 10 * 10, CLASSES)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).flatten(1))


class Capture(FedAvg):
    """FedAvg that keeps what it was asked to aggregate."""

    def aggregate_train(self, server_round, replies):
        self.got = list(replies)
        return super().aggregate_train(server_round, self.got)


def test_every_array_is_checked_and_bad_replies_are_dropped_by_reply(tmp_path):
    torch.manual_seed(0)
    model = BNNet()
    inner = Capture(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1)
    strategy = AuditStrategy(inner, model=model, attacks=[], input_shape=SHAPE, num_classes=CLASSES,
                             store=ResultStore(tmp_path / "a.sqlite"))  # fmt: skip
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    sent = list(
        strategy.configure_train(1, ArrayRecord(torch_state_dict=w0), ConfigRecord(), InProcessGrid())
    )

    def reply(to, change):
        state = {k: v.clone() for k, v in w0.items()}
        change(state)
        content = RecordDict(
            {"arrays": ArrayRecord(torch_state_dict=state), "metrics": MetricRecord({"num-examples": 4})}
        )
        return Message(content, reply_to=to)

    def nan_buffer(s):
        s["bn.running_var"].fill_(math.nan)

    def step(s):
        s["fc.bias"] += 0.1

    def extra(s):
        s["backdoor"] = torch.zeros(2)

    to = {m.metadata.dst_node_id: m for m in sent}
    replies = [reply(to[11], nan_buffer), reply(to[12], step), reply(to[13], extra)]
    strategy.aggregate_train(1, replies)
    assert inner.got == [replies[1]]  # the valid reply only
    reasons = [r["error"] for r in strategy.records if r["kind"] == "rejected"]
    assert len(reasons) == 2 and "bn.running_var" in reasons[0] and "non-finite" in reasons[0]
    assert "backdoor" in reasons[1]
