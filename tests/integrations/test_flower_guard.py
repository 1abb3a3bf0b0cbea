"""GuardMod on real flwr messages: a malicious model never reaches the ClientApp, an honest one does, and
each node keeps its own drift reference."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, Metadata, RecordDict  # noqa: E402
from flwr.client.mod.utils import make_ffn  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402

from gradleak.attacks import create_attack  # noqa: E402
from gradleak.integrations.flower import GuardMod  # noqa: E402
from gradleak.models import build_model  # noqa: E402
from synthetic import synthetic_dataset  # noqa: E402

SHAPE, CLASSES = (1, 12, 12), 4
DATA = synthetic_dataset(n=32, shape=SHAPE, classes=CLASSES, seed=3)


def message(state, message_type=MessageType.TRAIN) -> Message:
    metadata = Metadata(
        run_id=1, message_id="m", src_node_id=1, dst_node_id=5, reply_to_message_id="", group_id="1",
        created_at=time.time(), ttl=600.0, message_type=message_type,
    )  # fmt: skip
    content = RecordDict({"arrays": ArrayRecord(torch_state_dict=state), "config": ConfigRecord({})})
    return Message(content, metadata=metadata)


def context(node: int) -> Context:
    return Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})


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


def test_each_node_keeps_its_own_drift_reference():
    own = build_model("mlp", SHAPE, CLASSES, seed=0)
    other = build_model("mlp", SHAPE, CLASSES, seed=1).state_dict()  # a different, honest-looking model
    guard = mod(own)
    app = Recorder()
    guarded = make_ffn(app, [guard])
    assert not guarded(message(own.state_dict()), context(5)).has_error()  # node 5 accepts the first model
    assert not guarded(message(other), context(6)).has_error()  # node 6 has no reference yet
    refused = guarded(message(other), context(5))  # for node 5 every layer was rewritten
    assert refused.has_error() and "drift" in refused.error.reason
    assert app.seen == [5, 6]
