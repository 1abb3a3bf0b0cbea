"""GuardMod and GateMod on real flwr messages: a malicious model never reaches the ClientApp, an honest one
does, each node keeps its own drift reference; a leaky reply leaves defended or not at all."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import (  # noqa: E402
    ArrayRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.client.mod.utils import make_ffn  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402

from flowergrid import node_context, train_message  # noqa: E402
from gradleak.attacks import create_attack  # noqa: E402
from gradleak.audit.gate import GateConfig  # noqa: E402
from gradleak.integrations.flower import DefenseMod, GateMod, GuardMod  # noqa: E402
from gradleak.models import build_model  # noqa: E402
from synthetic import synthetic_dataset  # noqa: E402

SHAPE, CLASSES = (1, 12, 12), 4
DATA = synthetic_dataset(n=32, shape=SHAPE, classes=CLASSES, seed=3)


def message(state, message_type=MessageType.TRAIN) -> Message:
    return train_message(state, node=5, group="1", message_type=message_type)


def context(node: int) -> Context:
    return node_context(node)


class Recorder:
    """A ClientApp stand-in that records what reached it."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, msg: Message, ctx: Context) -> Message:
        self.seen.append(ctx.node_id)
        return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)


def mod(own) -> GuardMod:
    return GuardMod(own, lambda ctx: DATA.images)


def trap(own):
    attack = create_attack("trap_weights")
    return attack.prepare(own, DATA.images, generator=torch.Generator().manual_seed(0))[0]


def test_a_malicious_model_never_reaches_the_client_app():
    own = build_model("mlp", SHAPE, CLASSES, seed=0)
    app = Recorder()
    reply = make_ffn(app, [mod(own)])(message(trap(own).state_dict()), context(5))
    assert reply.has_error() and reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert "balance" in reply.error.reason and "not trained" in reply.error.reason
    assert app.seen == []


def test_an_honest_model_passes_and_other_messages_are_not_inspected():
    own = build_model("mlp", SHAPE, CLASSES, seed=0)
    app = Recorder()
    guarded = make_ffn(app, [mod(own)])
    assert not guarded(message(own.state_dict()), context(5)).has_error()
    broken = {"nonsense": torch.zeros(1)}  # an evaluate message is not a model to train
    guarded(message(broken, MessageType.EVALUATE), context(5))
    assert app.seen == [5, 5]


def test_each_node_keeps_its_own_drift_reference_in_its_context():
    """The reference lives in the node's Context.state, which Flower keeps across a node's messages, not in
    the mod: a fresh GuardMod for every message (a ClientApp process that serves one) still sees drift."""
    own = build_model("mlp", SHAPE, CLASSES, seed=0)
    other = build_model("mlp", SHAPE, CLASSES, seed=1).state_dict()  # a different, honest-looking model
    nodes = {5: context(5), 6: context(6)}
    app = Recorder()

    def send(state, node):
        return make_ffn(app, [mod(own)])(message(state), nodes[node])

    assert not send(own.state_dict(), 5).has_error()  # node 5 accepts the first model
    assert not send(other, 6).has_error()  # node 6 has no reference yet
    refused = send(other, 5)  # for node 5 every layer was rewritten
    assert refused.has_error() and "drift" in refused.error.reason
    assert app.seen == [5, 6]


def test_an_unreadable_model_is_refused_not_raised():
    msg = message(build_model("mlp", SHAPE, CLASSES, seed=0).state_dict())
    record = msg.content["arrays"]
    first = next(iter(record))
    record[first] = type(record[first])(np.array(["abc"]))  # a string array: no tensor to build
    reply = make_ffn(Recorder(), [mod(build_model("mlp", SHAPE, CLASSES, seed=0))])(msg, context(5))
    assert reply.has_error() and "cannot be read" in reply.error.reason


def test_the_gate_mod_defends_a_leaky_reply_as_the_defense_mod_would_and_withholds_when_asked():
    """One image through an MLP leaks; GateMod's reply equals DefenseMod's with the gate's defense, and with
    withhold=True the node replies with an error instead."""
    shape = (1, 12, 12)
    own = functools.partial(build_model, "mlp", shape, 3, seed=0, hidden=(32,))
    one = synthetic_dataset(n=1, shape=shape, classes=3, seed=1)
    reference = synthetic_dataset(n=64, shape=shape, classes=3, seed=2)
    w0 = own().state_dict()

    def train(msg: Message, ctx: Context) -> Message:  # one SGD step on the image, lr 0.1
        model = own()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        torch.nn.functional.cross_entropy(model(one.images), one.labels).backward()
        out = {n: p.detach() - 0.1 * p.grad for n, p in model.named_parameters()}
        return Message(RecordDict({"arrays": ArrayRecord(torch_state_dict=out),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)  # fmt: skip

    prune = ("pruning", {"ratio": 0.9})
    config = GateConfig(("ig", {"max_iterations": 150}), threshold_db=3.0, defenses=[prune])
    gate = GateMod(own, lambda ctx: one, lambda ctx: reference, config, seed=0)
    gated = make_ffn(train, [gate])(message(w0), context(5))
    plain = make_ffn(train, [DefenseMod([prune], seed=0)])(message(w0), context(5))
    assert not gated.has_error()
    (node, _, decision) = gate.decisions[0]
    assert node == 5 and decision.triggered and decision.leakage_db > 3.0
    got, want = gated.content["arrays"].to_torch_state_dict(), plain.content["arrays"].to_torch_state_dict()
    for n in w0:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)
    withholding = GateMod(own, lambda ctx: one, lambda ctx: reference,
                          GateConfig(config.attack, threshold_db=3.0, withhold=True), seed=0)  # fmt: skip
    refused = make_ffn(train, [withholding])(message(w0), context(5))
    assert refused.has_error() and "withheld by the leakage gate" in refused.error.reason
