"""A malicious server cannot run code on a client through a model it sends: the architecture travels as a
spec of a closed set of layer kinds (JSON), never as a pickle. The attack that worked before: a
``torch.save``d object whose ``__reduce__`` runs a command, put in the ``gradleak.architecture`` record of a
train message (deployment ClientApp) or in the model record of the Flower engine's task message; loaded
with ``torch.load(..., weights_only=False)`` it ran on the client before any type check. Here it is refused
and nothing runs; honest specs (every malicious model gradleak builds) round-trip exactly; oversized or
malformed specs are refused before anything is allocated."""

from __future__ import annotations

import copy
import io
import json
import os
import time

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, Metadata, RecordDict  # noqa: E402

from gradleak.attacks import create_attack  # noqa: E402
from gradleak.integrations.flower.apps import ARCHITECTURE, ArchitectureRefused, client_app  # noqa: E402
from gradleak.integrations.flower.engine import MODEL, TASK, WEIGHTS, task_client_app  # noqa: E402
from gradleak.models import build_model  # noqa: E402
from gradleak.models.architecture import FORMAT, ArchitectureError, Limits, build, describe  # noqa: E402
from gradleak.types import LocalTraining  # noqa: E402
from synthetic import synthetic_dataset  # noqa: E402

SHAPE, CLASSES = (1, 12, 12), 3


class Payload:
    """What a malicious server pickles: unpickling it creates ``marker`` (a stand-in for any command)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def payload(marker) -> bytes:
    buffer = io.BytesIO()
    torch.save(Payload(str(marker)), buffer)  # torch.save pickles: the blob the old server sent
    return buffer.getvalue()


def model():
    return build_model("sme_cnn", SHAPE, CLASSES, seed=0)


def train_message(content: RecordDict) -> Message:
    metadata = Metadata(run_id=1, message_id="m", src_node_id=1, dst_node_id=5, reply_to_message_id="",
                        group_id="1", created_at=time.time(), ttl=600.0,
                        message_type=MessageType.TRAIN)  # fmt: skip
    return Message(content, metadata=metadata)


def context() -> Context:
    return Context(run_id=1, node_id=5, node_config={"partition-id": 0}, state=RecordDict(), run_config={})


@pytest.mark.parametrize("accept", [False, True])
@pytest.mark.parametrize("field", ["module", "spec"])
def test_a_pickled_module_from_the_server_never_runs_on_a_deployed_client(tmp_path, accept, field):
    marker = tmp_path / "pwned"
    content = RecordDict({
        "arrays": ArrayRecord(torch_state_dict=model().state_dict()),
        "config": ConfigRecord({"server-round": 1}),
        ARCHITECTURE: ConfigRecord({field: payload(marker)}),
    })  # fmt: skip
    data = [synthetic_dataset(n=4, shape=SHAPE, classes=CLASSES)]
    app = client_app(data, model, LocalTraining(batch_size=4), accept_architecture=accept)
    with pytest.raises((ArchitectureRefused, ArchitectureError)) as err:
        app(train_message(content), context())
    assert not marker.exists()  # the old client_app created it while loading the record
    if not accept:
        assert "accept_architecture=True" in str(err.value)


def test_a_pickled_module_never_runs_on_a_flower_engine_node(tmp_path):
    marker = tmp_path / "pwned"
    content = RecordDict({
        MODEL: ConfigRecord({"spec": payload(marker), "module": payload(marker)}),
        WEIGHTS: ArrayRecord(torch_state_dict=model().state_dict()),
        TASK: ConfigRecord({"client-id": 0}),
    })  # fmt: skip
    app = task_client_app([synthetic_dataset(n=4, shape=SHAPE, classes=CLASSES)], tuple)
    with pytest.raises(ArchitectureError, match="not JSON"):
        app(train_message(content), context())
    assert not marker.exists()


@pytest.mark.parametrize(
    ("name", "options"), [("robbing_the_fed", {"num_bins": 8}), ("loki", {}), ("scale_mia", {})]
)
def test_every_malicious_model_gradleak_builds_travels_as_a_spec_exactly(name, options):
    public = torch.rand((64, *SHAPE), generator=torch.Generator().manual_seed(0))
    sent, _ = create_attack(name, **options).prepare(copy.deepcopy(model()), public,
                                                    generator=torch.Generator().manual_seed(1))  # fmt: skip
    for own in (False, True):
        rebuilt = build(describe(sent, own=own), own=model)
        rebuilt.load_state_dict(sent.state_dict(), strict=True)
        x = torch.rand((3, *SHAPE), generator=torch.Generator().manual_seed(2))
        assert torch.equal(rebuilt.eval()(x), sent.eval()(x))


def spec_of(node) -> str:
    return json.dumps({"format": FORMAT, "model": node})


BLOCK = {"feature_dim": 144, "num_bins": 8, "groups": 1, "front": {"kind": "flatten", "start": 1, "end": -1}}


def imprint(**block) -> dict:
    return {"kind": "imprint", "block": {**BLOCK, **block}, "body": {"kind": "own"}}


@pytest.mark.parametrize(
    ("node", "reason"),
    [
        (imprint(num_bins=2**20), "size limit"),
        (imprint(front={"kind": "linear", "in": 2**24, "out": 2**24, "bias": True}), "size limit"),
        (imprint(front={"kind": "eval", "code": "1"}), "unknown layer kind"),
        ({"kind": "module", "path": "os.system"}, "unknown spec node kind"),
        ({"kind": "registered", "name": "sme_cnn", "input_shape": [1, 12, 12], "num_classes": 3, "seed": 0,
          "options": {}}, "only its own model"),
        (imprint(num_bins=-1), "num_bins"),
        ({"kind": "imprint", "block": BLOCK, "body": {"kind": "own", "extra": 1}}, "bad spec node"),
    ],
)  # fmt: skip
def test_a_deployed_client_refuses_specs_that_are_too_large_or_not_of_the_closed_set(node, reason):
    with pytest.raises(ArchitectureError, match=reason):
        build(spec_of(node), own=model, limits=Limits(allow_registered=False))


def test_a_spec_nested_too_deep_is_refused():
    node: dict = {"kind": "own"}
    for _ in range(12):
        node = {"kind": "imprint", "block": BLOCK, "body": node}
    with pytest.raises(ArchitectureError, match="too deep|size limit"):
        build(spec_of(node), own=model)


def test_a_module_without_a_spec_is_refused_with_the_way_out():
    with pytest.raises(ArchitectureError, match="build it with gradleak.models.build_model"):
        describe(torch.nn.Linear(2, 2))
