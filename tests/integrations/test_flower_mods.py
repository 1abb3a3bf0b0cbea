"""gradleak defenses as Flower client mods, on real flwr messages: each mod changes the reply exactly as the
in-process defense changes the same update, composes with Flower's own mods, and fails closed."""

from __future__ import annotations

import math

import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import (  # noqa: E402
    ArrayRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.client.mod.utils import make_ffn  # noqa: E402
from flwr.clientapp.mod import fixedclipping_mod  # noqa: E402

import flowergrid  # noqa: E402
from gradleak.defenses.base import Defense, SetupContext  # noqa: E402
from gradleak.federation.simulation import derive_seed  # noqa: E402
from gradleak.integrations.flower import DefenseMod, UnsupportedModError, is_update_level  # noqa: E402
from gradleak.models import build_model  # noqa: E402
from gradleak.registry import DEFENSES  # noqa: E402
from gradleak.types import Update  # noqa: E402

NODE = 7


def model_state() -> dict[str, torch.Tensor]:
    return build_model("sme_cnn", (1, 12, 12), 3, seed=0).state_dict()


def train_message(state, config=None, message_type=MessageType.TRAIN) -> Message:
    return flowergrid.train_message(state, node=NODE, config=config, message_type=message_type)


def context() -> Context:
    return flowergrid.node_context(NODE)


def client_app(step: float = 0.05, poison: bool = False):
    """A ClientApp train function: w_T = w_0 + a fixed, seeded 'training' step (NaN when ``poison``)."""

    def train(msg: Message, ctx: Context) -> Message:
        w = msg.content["arrays"].to_torch_state_dict()
        g = torch.Generator().manual_seed(1)
        out = {
            n: t + step * torch.randn(t.shape, generator=g) if t.is_floating_point() else t
            for n, t in w.items()
        }
        if poison:
            first = next(iter(out))
            out[first] = out[first].clone().fill_(math.nan)
        reply = RecordDict(
            {"arrays": ArrayRecord(torch_state_dict=out), "metrics": MetricRecord({"num-examples": 16})}
        )
        return Message(reply, reply_to=msg)

    return train


def in_process(name: str, options: dict, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same defense on the same update, in process, seeded as the mod seeds it."""
    d: Defense = DEFENSES.create(name, **options)
    d.setup(torch.nn.Module(), SetupContext(torch.Generator().manual_seed(derive_seed(0, NODE, 3))))
    return dict(d.on_update(Update(delta, 16)).tensors)


@pytest.mark.parametrize(
    ("name", "options"), [("pruning", {"ratio": 0.7}), ("update_noise", {"clip": 0.5, "sigma": 0.1})]
)
def test_the_mod_changes_the_reply_as_the_in_process_defense_changes_the_update(name, options):
    w0 = model_state()
    msg = train_message(w0)
    reply = make_ffn(client_app(), [DefenseMod([(name, options)], seed=0)])(msg, context())
    assert not reply.has_error()
    sent = reply.content["arrays"].to_torch_state_dict()
    plain = client_app()(msg, context()).content["arrays"].to_torch_state_dict()
    delta = {n: plain[n] - w0[n] for n in w0}
    expected = in_process(name, options, delta)
    for n in w0:
        torch.testing.assert_close(sent[n] - w0[n], expected[n], rtol=0, atol=1e-6)  # (w0 + u) - w0 rounding
    assert reply.content["metrics"]["num-examples"] == 16  # the rest of the reply is untouched


def test_after_flowers_fixed_clipping_mod_it_prunes_the_clipped_update():
    w0 = model_state()
    msg = train_message(w0, {"clipping_norm": 0.3})
    mods = [DefenseMod([("pruning", {"ratio": 0.5})]), fixedclipping_mod]  # Flower clips first on the way out
    reply = make_ffn(client_app(), mods)(msg, context())
    assert not reply.has_error()
    sent = reply.content["arrays"].to_torch_state_dict()
    plain = client_app()(msg, context()).content["arrays"].to_torch_state_dict()
    delta = {n: (plain[n] - w0[n]).double() for n in w0}
    norm = math.sqrt(sum(float(t.pow(2).sum()) for t in delta.values()))
    clipped = {n: (t * min(1.0, 0.3 / norm)).float() for n, t in delta.items()}  # the slow obvious way
    expected = in_process("pruning", {"ratio": 0.5}, clipped)
    for n in w0:
        torch.testing.assert_close(sent[n] - w0[n], expected[n], rtol=0, atol=1e-6)
    sent_norm = math.sqrt(sum(float((sent[n] - w0[n]).double().pow(2).sum()) for n in w0))
    assert sent_norm <= 0.3 + 1e-5


def test_a_defense_that_needs_the_training_loop_is_refused_with_the_in_loop_api_named():
    for name in ("batch_noise", "compression", "soteria", "aegis", "aegis_llm"):
        assert not is_update_level(DEFENSES.create(name)), name
        with pytest.raises(UnsupportedModError, match=r"in_loop\.defend"):
            DefenseMod([name])
    assert is_update_level(DEFENSES.create("pruning")) and is_update_level(DEFENSES.create("update_noise"))


class Broken(Defense):
    name = "broken"

    def on_update(self, update):
        raise RuntimeError("boom")


@pytest.mark.parametrize("case", ["defense_raises", "non_finite_reply"])
def test_the_mod_fails_closed_with_an_error_reply_and_no_arrays(case):
    msg = train_message(model_state())
    mod = DefenseMod([Broken()]) if case == "defense_raises" else DefenseMod(["pruning"])
    reply = make_ffn(client_app(poison=case == "non_finite_reply"), [mod])(msg, context())
    assert reply.has_error() and not reply.has_content()
    assert "gradleak DefenseMod" in reply.error.reason
    assert ("boom" if case == "defense_raises" else "non-finite") in reply.error.reason


def test_other_messages_pass_through_untouched():
    msg = train_message(model_state(), message_type=MessageType.EVALUATE)
    calls = []

    def evaluate(m, c):
        calls.append(m)
        return Message(RecordDict({"metrics": MetricRecord({"acc": 0.5})}), reply_to=m)

    reply = make_ffn(evaluate, [DefenseMod(["pruning"])])(msg, context())
    assert calls == [msg] and reply.content["metrics"]["acc"] == 0.5


def test_without_a_seed_the_noise_cannot_be_regenerated():
    """The default draws from the operating system: two identical messages get different noise."""
    w0 = model_state()
    app = make_ffn(client_app(), [DefenseMod([("update_noise", {"clip": 0.5, "sigma": 0.1})])])
    first = app(train_message(w0), context()).content["arrays"].to_torch_state_dict()
    second = app(train_message(w0), context()).content["arrays"].to_torch_state_dict()
    assert all(not torch.equal(first[n], second[n]) for n in w0 if w0[n].is_floating_point())


def test_train_actions_are_defended_too():
    w0 = model_state()
    msg = train_message(w0, message_type="train.finetune")  # routed to @app.train("finetune")
    reply = make_ffn(client_app(), [DefenseMod([("pruning", {"ratio": 0.9})])])(msg, context())
    sent = reply.content["arrays"].to_torch_state_dict()
    zeros = sum(int(((sent[n] - w0[n]) == 0).sum()) for n in w0)
    assert zeros >= 0.9 * sum(t.numel() for t in w0.values()) - len(w0)


class BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3)
        self.bn = torch.nn.BatchNorm2d(2)


@pytest.mark.parametrize("poison_buffer", [False, True])
def test_batchnorm_buffers_pass_through_checked_not_clipped(poison_buffer):
    torch.manual_seed(0)
    w0 = BNNet().state_dict()

    def train(msg, ctx):
        w = msg.content["arrays"].to_torch_state_dict()
        out = {n: t + 0.5 if t.is_floating_point() else t + 1 for n, t in w.items()}
        if poison_buffer:
            out["bn.running_var"] = torch.full_like(out["bn.running_var"], math.nan)
        return Message(RecordDict({"arrays": ArrayRecord(torch_state_dict=out)}), reply_to=msg)

    reply = make_ffn(train, [DefenseMod([("update_noise", {"clip": 0.01, "sigma": 0.0})])])(
        train_message(w0), context()
    )
    if poison_buffer:
        assert reply.has_error() and "bn.running_var" in reply.error.reason
        return
    sent = reply.content["arrays"].to_torch_state_dict()
    for n in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert torch.equal(sent[n], w0[n] + (0.5 if w0[n].is_floating_point() else 1))  # as trained
    weights = ("conv.weight", "conv.bias", "bn.weight", "bn.bias")
    norm = math.sqrt(sum(float((sent[n] - w0[n]).double().pow(2).sum()) for n in weights))
    assert norm == pytest.approx(0.01, rel=1e-4)  # only the weights were clipped to C
