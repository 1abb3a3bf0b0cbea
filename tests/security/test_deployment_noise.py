"""Noise a server can regenerate, it can subtract. The deployment ClientApp seeded its defenses from
``derive_seed(0, round, partition-id)`` (the round and the partition id are the server's to know, and the
reply even reported the partition id): a server rebuilt the generator and removed the noise. Now it draws
from the operating system unless an experiment asks for a seed. Also: Opacus' secure mode cannot run here
(its torchcsprng predates this torch) and is refused at config time instead of running as if secure;
BatchNorm statistics leave un-noised beside a DP defense, with a warning, or stay local on request."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("flwr")

from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    Metadata,
    MetricRecord,
    RecordDict,
)  # noqa: E402

from gradleak.defenses.dp_sgd import DPSGDConfig  # noqa: E402
from gradleak.defenses.in_loop import build_defenses, defend  # noqa: E402
from gradleak.federation.simulation import derive_seed  # noqa: E402
from gradleak.integrations.flower import DefenseMod  # noqa: E402
from gradleak.integrations.flower.apps import client_app  # noqa: E402
from gradleak.models import build_model  # noqa: E402
from gradleak.tasks.client import train_client  # noqa: E402
from gradleak.types import LocalTraining  # noqa: E402
from synthetic import synthetic_dataset  # noqa: E402

SHAPE, CLASSES = (1, 12, 12), 3
CLIENTS = [synthetic_dataset(n=4, shape=SHAPE, classes=CLASSES, seed=k) for k in range(2)]
TRAINING = LocalTraining("fedavg", epochs=1, batch_size=4, lr=0.05)
build = functools.partial(build_model, "sme_cnn", SHAPE, CLASSES, seed=0)
NOISE = functools.partial(build_defenses, [("update_noise", {"clip": 1.0, "sigma": 1.0})])


def metadata(round_: int) -> Metadata:
    return Metadata(run_id=1, message_id="m", src_node_id=1, dst_node_id=5, reply_to_message_id="",
                    group_id=str(round_), created_at=time.time(), ttl=600.0,
                    message_type=MessageType.TRAIN)  # fmt: skip


def message(round_: int = 2) -> Message:
    content = RecordDict({"arrays": ArrayRecord(torch_state_dict=build().state_dict()),
                          "config": ConfigRecord({"server-round": round_})})  # fmt: skip
    return Message(content, metadata=metadata(round_))


def reply_weights(app, k: int = 1) -> dict[str, torch.Tensor]:
    ctx = Context(run_id=1, node_id=5, node_config={"partition-id": k}, state=RecordDict(), run_config={})
    return app(message(), ctx).content["arrays"].to_torch_state_dict()


def test_the_deployment_client_app_draws_its_noise_from_the_operating_system():
    deployed = client_app(CLIENTS, build, TRAINING, defenses=NOISE)  # seed left at its default
    a, b = reply_weights(deployed), reply_weights(deployed)
    assert not torch.equal(
        a["classifier.3.bias"], b["classifier.3.bias"]
    )  # the same round and node: fresh noise each time
    # the server's regeneration from what it knows (round 2, partition 1) under the old default seed 0
    model = build()
    gen = torch.Generator().manual_seed(derive_seed(0, 2 - 1, 1))
    guess = train_client(1, model, CLIENTS[1], TRAINING, NOISE(), gen).update
    regenerated = build().state_dict()["classifier.3.bias"] + guess.tensors["classifier.3.bias"]
    assert not torch.allclose(a["classifier.3.bias"], regenerated, atol=1e-3)
    # an experiment that asks for a seed gets exactly that regeneration (the old behaviour, now opt-in)
    seeded = client_app(CLIENTS, build, TRAINING, defenses=NOISE, seed=0)
    torch.testing.assert_close(reply_weights(seeded)["classifier.3.bias"], regenerated, atol=1e-6, rtol=0)


def test_opacus_secure_mode_is_refused_at_config_time_with_the_reason():
    with pytest.raises(ValueError, match="torchcsprng"):
        DPSGDConfig(secure_mode=True)


class BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2)
        self.fc = torch.nn.Linear(2 * 10 * 10, CLASSES)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


def trained_loop(defenses):
    torch.manual_seed(0)
    model = BNNet().train()
    loop = defend(
        model, lambda ps: torch.optim.SGD(ps, lr=0.1), defenses, generator=torch.Generator().manual_seed(1)
    )
    data = CLIENTS[0]
    loop.optimizer.zero_grad()
    F.cross_entropy(model(data.images), data.labels).backward()
    loop.optimizer.step()
    return loop


def test_batchnorm_statistics_beside_a_dp_defense_are_named_in_a_warning_or_withheld(caplog):
    torch.manual_seed(0)
    sent = {k: v.clone() for k, v in BNNet().state_dict().items()}
    loop = trained_loop([("update_noise", {"clip": 1.0, "sigma": 0.1})])
    with caplog.at_level("WARNING"):
        weights = loop.weights(4)
    assert "covers the model's parameters only" in caplog.text and "bn.running_mean" in caplog.text
    assert not torch.equal(weights["bn.running_mean"], sent["bn.running_mean"])  # sent as trained
    caplog.clear()
    loop = trained_loop([("update_noise", {"clip": 1.0, "sigma": 0.1})])
    with caplog.at_level("WARNING"):
        weights = loop.weights(4, statistics="withhold")
    assert caplog.text == ""
    for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert torch.equal(weights[k], sent[k]), k  # FedBN: the client's statistics stay local
    caplog.clear()
    with caplog.at_level("WARNING"):
        trained_loop(["pruning"]).weights(4)  # no DP claim, nothing to warn about
    assert caplog.text == ""


def test_defense_mod_keeps_the_client_dtypes_when_the_server_sent_float64_buffers():
    """Flower's FedAvg returns the averaged int64 counter as float64; the mod must reply in the model's."""
    model = BNNet()
    w0 = {k: (v.double() if k.endswith("num_batches_tracked") else v) for k, v in model.state_dict().items()}
    msg = Message(RecordDict({"arrays": ArrayRecord(torch_state_dict=w0)}), metadata=metadata(2))

    def app(m, ctx):
        trained = {
            k: (v + 1 if not v.is_floating_point() else v + 0.01) for k, v in model.state_dict().items()
        }
        content = RecordDict({"arrays": ArrayRecord(torch_state_dict=trained),
                              "metrics": MetricRecord({"num-examples": 4})})  # fmt: skip
        return Message(content, reply_to=m)

    for statistics in ("send", "withhold"):
        ctx = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
        reply = DefenseMod(["pruning"], statistics=statistics)(msg, ctx, app)
        got = reply.content["arrays"].to_torch_state_dict()
        assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in model.state_dict().items()}
        expected = 1 if statistics == "send" else 0
        assert int(got["bn.num_batches_tracked"]) == expected
