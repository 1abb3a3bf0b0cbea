"""A client cannot steer or stop the federation through the audit wrappers: each hostile reply that moved,
reversed or stopped Flower's FedAvg behind ``AuditStrategy`` / ``LegacyAuditStrategy`` before (a sample
count of 1e18, -7, 3.9, inf or -8; an extra metric key; an int64 buffer of another shape) is rejected or
sanitised and recorded, the aggregate is the honest nodes' alone, and nothing raises. And honest BatchNorm
clients aggregate every round (the int64 counter Flower's FedAvg turns into float64 no longer rejects them
from round 2 on), through ``defend()`` and through ``DefenseMod``."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

flwr = pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.server.client_proxy import ClientProxy  # noqa: E402
from flwr.server.strategy import FedAvg as LegacyFedAvg  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from flowergrid import AppGrid  # noqa: E402
from flowergrid import server_identity as flower_server_identity  # noqa: E402
from gradleak.defenses.in_loop import defend  # noqa: E402
from gradleak.experiments.store import ResultStore  # noqa: E402
from gradleak.integrations.flower import AuditStrategy, DefenseMod, LegacyAuditStrategy  # noqa: E402
from gradleak.integrations.flower.replies import ReplyPolicy  # noqa: E402
from synthetic import synthetic_dataset  # noqa: E402

SHAPE, CLASSES = (1, 8, 8), 3
NODES = (11, 12, 13)
DATA = {node: synthetic_dataset(n=6, shape=SHAPE, classes=CLASSES, seed=node) for node in NODES}


class BNNet(torch.nn.Module):
    """A CNN with two BatchNorm layers (the shape of Flower's quickstart with BatchNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.conv2, self.bn2 = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 8 * 8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        return self.fc(F.relu(self.bn2(self.conv2(x))).flatten(1))


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return BNNet()


@pytest.fixture(autouse=True)
def server_identity():
    with flower_server_identity(0):
        yield


def wrapped(tmp_path, **options) -> tuple[AuditStrategy, FedAvg]:
    inner = FedAvg(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3)
    strategy = AuditStrategy(inner, model=new_model(), attacks=[], input_shape=SHAPE, num_classes=CLASSES,
                             store=ResultStore(tmp_path / "a.sqlite"), **options)  # fmt: skip
    return strategy, inner


def shifted(msg: Message, shift: float, metrics: dict) -> RecordDict:
    """A reply: every floating array of the sent ones moved by ``shift`` (the counter by one step)."""
    state = {}
    for k, v in msg.content["arrays"].to_torch_state_dict().items():
        ref = new_model().state_dict()[k]
        v = v.to(ref.dtype)
        state[k] = v + shift if v.is_floating_point() else v + 1
    return RecordDict({"arrays": ArrayRecord(torch_state_dict=state), "metrics": MetricRecord(metrics)})


def one_round(strategy: AuditStrategy, hostile: RecordDict | None = None, count=None, extra=None):
    """Round 1 with the honest nodes 11 and 12 (shift +0.01, 4 samples each) and node 13 sending
    ``hostile`` (or weights +100 claiming ``count`` samples, with ``extra`` metrics)."""
    w0 = new_model().state_dict()
    grid = AppGrid({}, NODES)
    sent = list(strategy.configure_train(1, ArrayRecord(torch_state_dict=w0), ConfigRecord(), grid))
    replies = []
    for msg in sent:
        node = msg.metadata.dst_node_id
        if node == 13:
            content = hostile or shifted(msg, 100.0, {"num-examples": count, **(extra or {})})
        else:
            content = shifted(msg, 0.01, {"num-examples": 4})
        replies.append(Message(content, reply_to=msg))
    arrays, _ = strategy.aggregate_train(1, replies)
    return w0, arrays


@pytest.mark.parametrize("count", [10**18, -7, 3.9, math.inf, -8, 0, 10**6 + 1, [4], math.nan])
def test_a_forged_sample_count_is_rejected_and_the_aggregate_is_the_honest_nodes(tmp_path, count):
    strategy, _ = wrapped(tmp_path)
    w0, arrays = one_round(strategy, count=count)  # before: 1e18 moved the model by 100, -7 by -6.99
    got = arrays.to_torch_state_dict()
    torch.testing.assert_close(got["fc.weight"], w0["fc.weight"] + 0.01, atol=1e-6, rtol=0)
    (rejected,) = [r for r in strategy.records if r["kind"] == "rejected"]
    assert (
        rejected["node_id"] == 13
        and "num-examples must be a whole number in [1, 1000000]" in rejected["error"]
    )


def test_the_operator_sets_the_bound_on_sample_counts(tmp_path):
    strategy, _ = wrapped(tmp_path, policy=ReplyPolicy(max_examples=3))
    one_round(strategy, count=2)
    assert sorted(r["node_id"] for r in strategy.records if r["kind"] == "rejected") == [11, 12]  # 4 > 3


def test_an_extra_metric_key_is_dropped_and_recorded_instead_of_stopping_fedavg(tmp_path):
    strategy, _ = wrapped(tmp_path)
    w0, arrays = one_round(strategy, hostile=None, count=4, extra={"backdoor": 1.0, "train_loss": 0.5})
    # node 13's weights are +100 but well-formed: accepted (clip_norm bounds those, below)
    got = arrays.to_torch_state_dict()
    torch.testing.assert_close(got["fc.bias"], w0["fc.bias"] + (0.01 + 0.01 + 100.0) / 3, atol=1e-4, rtol=0)
    notes = [r for r in strategy.records if r["kind"] == "sanitised"]
    assert notes == [{"kind": "sanitised", "round": 1, "node_id": 13, "stage": "train",
                      "dropped_metrics": ["backdoor", "train_loss"], "clipped": False,
                      "norm": pytest.approx(notes[0]["norm"])}]  # fmt: skip
    # train_loss is allowed, but the honest replies lack it: Flower needs the same keys everywhere


def test_clip_norm_bounds_what_one_large_reply_moves_the_aggregate(tmp_path):
    strategy, _ = wrapped(tmp_path, policy=ReplyPolicy(clip_norm=1.0))
    w0, arrays = one_round(strategy, count=4)
    got = arrays.to_torch_state_dict()
    moved = torch.cat([(got[k] - w0[k]).reshape(-1) for k in w0 if w0[k].is_floating_point()])
    honest = torch.cat([torch.full_like(w0[k], 0.01).reshape(-1) for k in w0 if w0[k].is_floating_point()])
    # the hostile delta, clipped to norm 1, weighs 4/12: the aggregate is within 1/3 of the honest mean's
    assert float((moved - honest * 2 / 3).norm()) <= 1.0 / 3 + 1e-5
    clipped = [r for r in strategy.records if r["kind"] == "sanitised"]
    assert [(r["node_id"], r["clipped"]) for r in clipped] == [(13, True)]


def test_an_integer_buffer_of_another_shape_or_out_of_range_is_rejected(tmp_path):
    for change, reason in [
        (lambda s: s.__setitem__("bn1.num_batches_tracked", torch.zeros(1000, dtype=torch.int64)), "shape"),
        (lambda s: s.__setitem__("bn1.num_batches_tracked", torch.tensor(10**9)), "local steps"),
        (lambda s: s.__setitem__("bn1.num_batches_tracked", torch.tensor(-1)), "local steps"),
        (lambda s: s.__setitem__("bn1.running_var", s["bn1.running_var"].double()), "dtype"),
    ]:
        strategy, _ = wrapped(tmp_path)
        state = new_model().state_dict()
        change(state)
        hostile = RecordDict({"arrays": ArrayRecord(torch_state_dict=state),
                              "metrics": MetricRecord({"num-examples": 4})})  # fmt: skip
        w0, arrays = one_round(strategy, hostile=hostile)
        assert torch.equal(
            arrays.to_torch_state_dict()["bn1.num_batches_tracked"], torch.tensor(1.0).double()
        )
        (rejected,) = [r for r in strategy.records if r["kind"] == "rejected"]
        assert reason in rejected["error"], rejected


def test_a_failing_wrapped_strategy_is_recorded_and_the_round_skipped(tmp_path):
    class Broken(FedAvg):
        def aggregate_train(self, server_round, replies):
            raise ZeroDivisionError("boom")

    strategy = AuditStrategy(Broken(min_available_nodes=3), model=new_model(), attacks=[], input_shape=SHAPE,
                             num_classes=CLASSES)  # fmt: skip
    _, arrays = one_round(strategy, count=4)
    assert arrays is None
    assert [r["kind"] for r in strategy.records] == ["aggregate_error"]


def test_replies_from_nodes_not_asked_or_twice_are_rejected(tmp_path):
    strategy, _ = wrapped(tmp_path)
    w0 = new_model().state_dict()
    grid = AppGrid({}, NODES)
    sent = list(strategy.configure_train(1, ArrayRecord(torch_state_dict=w0), ConfigRecord(), grid))
    replies = [Message(shifted(m, 0.01, {"num-examples": 4}), reply_to=m) for m in sent]
    replies.append(Message(shifted(sent[0], 50.0, {"num-examples": 4}), reply_to=sent[0]))
    stranger = Message(shifted(sent[1], 50.0, {"num-examples": 4}), reply_to=sent[1])
    stranger.metadata._src_node_id = 99  # a node the round never asked
    replies.append(stranger)
    arrays, _ = strategy.aggregate_train(1, replies)
    torch.testing.assert_close(
        arrays.to_torch_state_dict()["fc.bias"], w0["fc.bias"] + 0.01, atol=1e-6, rtol=0
    )
    reasons = sorted(r["error"].split(": ", 1)[1] for r in strategy.records if r["kind"] == "rejected")
    assert reasons == ["a second reply from the same node", "this node was not sent a message this round"]


# -- honest BatchNorm clients over several rounds --------------------------------------------------------


def plain_app(mods=()) -> ClientApp:
    """A ClientApp shaped like Flower's quickstart: its own model, one local epoch of SGD, the weights."""
    app = ClientApp(mods=list(mods))

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        model = new_model()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = DATA[NODES[int(ctx.node_config["partition-id"])]]
        model.train()
        for idx in torch.arange(len(data)).split(3):
            opt.zero_grad()
            F.cross_entropy(model(data.images[idx]), data.labels[idx]).backward()
            opt.step()
        metrics = MetricRecord({"num-examples": len(data), "train_loss": 0.5})
        return Message(RecordDict({"arrays": ArrayRecord(torch_state_dict=model.state_dict()),
                                   "metrics": metrics}), reply_to=msg)  # fmt: skip

    return app


def defended_app() -> ClientApp:
    """The same with gradleak's in-loop API: ``loop.weights()`` is the reply."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        model = new_model()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        loop = defend(model, lambda ps: torch.optim.SGD(ps, lr=0.1), ["pruning"])
        data = DATA[NODES[int(ctx.node_config["partition-id"])]]
        model.train()
        for idx in torch.arange(len(data)).split(3):
            loop.optimizer.zero_grad()
            F.cross_entropy(model(data.images[idx]), data.labels[idx]).backward()
            loop.optimizer.step()
        metrics = MetricRecord({"num-examples": len(data)})
        return Message(RecordDict({"arrays": ArrayRecord(torch_state_dict=loop.weights(len(data))),
                                   "metrics": metrics}), reply_to=msg)  # fmt: skip

    return app


@pytest.mark.parametrize("kind", ["plain", "defend", "mod"])
def test_batchnorm_clients_aggregate_every_round_through_fedavg(tmp_path, kind):
    app = {"plain": plain_app(), "defend": defended_app(), "mod": plain_app([DefenseMod(["pruning"])])}[kind]
    strategy, _ = wrapped(tmp_path)
    states = []

    class Watch(FedAvg):  # the global model after every round
        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            out = super().aggregate_train(server_round, replies)
            states.append((len(replies), out[0].to_torch_state_dict()))
            return out

    strategy.strategy = Watch(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3)
    grid = AppGrid(dict.fromkeys(NODES, app), NODES)
    strategy.start(grid, ArrayRecord(torch_state_dict=new_model().state_dict()), num_rounds=3)
    assert [n for n, _ in states] == [3, 3, 3]  # every reply aggregated in every round
    assert not [r for r in strategy.records if r["kind"] in ("rejected", "client_error", "aggregate_error")]
    previous = new_model().state_dict()
    for _, state in states:  # the model changes every round, weights and statistics alike
        for k in ("conv1.weight", "bn1.weight", "bn2.running_mean", "fc.bias"):
            assert not torch.equal(state[k].float(), previous[k].float()), k
        previous = state
    # two local steps a node a round: the counter FedAvg averages moves by 2 each round
    assert [float(s["bn1.num_batches_tracked"]) for _, s in states] == [2.0, 4.0, 6.0]


# -- the legacy wrapper ---------------------------------------------------------------------------------


class Proxy(ClientProxy):
    def __init__(self, node_id: int) -> None:
        super().__init__(str(node_id))
        self.node_id = node_id

    get_properties = get_parameters = fit = evaluate = reconnect = None  # type: ignore[assignment]


def legacy_fitres(shift: float, n, metrics=None) -> FitRes:
    arrays = [
        (t + shift if t.is_floating_point() else t + 1).numpy() for t in new_model().state_dict().values()
    ]
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, metrics or {})


@pytest.mark.parametrize("count", [10**18, -7, -8, 0])
def test_the_legacy_wrapper_rejects_forged_counts_and_keeps_the_honest_aggregate(tmp_path, count):
    strategy = LegacyAuditStrategy(LegacyFedAvg(), model=new_model(), attacks=[], input_shape=SHAPE,
                                   num_classes=CLASSES)  # fmt: skip
    w0 = new_model().state_dict()
    strategy._broadcast[1] = {k: v.clone() for k, v in w0.items()}  # what configure_fit keeps
    results = [(Proxy(11), legacy_fitres(0.01, 4)), (Proxy(12), legacy_fitres(0.01, 4)),
               (Proxy(13), legacy_fitres(100.0, count, {"backdoor": 1.0}))]  # fmt: skip
    params, _ = strategy.aggregate_fit(1, results, [])
    got = dict(zip(w0, parameters_to_ndarrays(params), strict=True))
    torch.testing.assert_close(torch.from_numpy(got["fc.bias"]), w0["fc.bias"] + 0.01, atol=1e-6, rtol=0)
    (rejected,) = [r for r in strategy.records if r["kind"] == "rejected"]
    assert rejected["node_id"] == 13 and "num-examples" in rejected["error"]
