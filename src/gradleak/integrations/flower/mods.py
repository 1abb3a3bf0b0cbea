"""gradleak defenses as Flower client mods: ``ClientApp(mods=[GuardMod(...), DefenseMod(["pruning"])])``.

:class:`GuardMod` checks the model of every train message before the ClientApp sees it (the client's guard,
:mod:`gradleak.defenses.guard`) and refuses to train on a malicious one.

A mod sees only messages: the model the server sent (``w_0``, the train message's one ``ArrayRecord``) and
the model the ClientApp replies with (``w_T``). So a mod can run exactly the defenses that act on the
outgoing update (only an ``on_update`` hook, e.g. ``pruning``, ``update_noise``): it forms the update
``w_T - w_0`` of the floating-point arrays, passes it through the defenses and the update validation, and
replies with ``w_0 + defended update`` (Flower's convention: a train reply carries weights). Defenses that
act on every step's gradient or at epoch end (``batch_noise``, ``compression``, ``soteria``, ``aegis``,
``aegis_llm``) need the training loop: :class:`DefenseMod` refuses them, naming
:func:`gradleak.defenses.in_loop.defend` for the ClientApp's ``@app.train()`` function.

Fail closed: a defense error, a non-finite update or a reply that does not match what was sent becomes an
error reply (``ErrorCode.MOD_FAILED_PRECONDITION``) carrying no arrays. The mod composes with Flower's own
mods; placed before ``fixedclipping_mod`` in ``mods=[...]`` it acts on the already clipped update (mods
wrap in list order, so the first one handles the reply last).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from flwr.app import ArrayRecord, Context, Error, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode
from torch import nn

from gradleak.audit.gate import GateConfig, GateDecision, LeakageGate
from gradleak.data.base import ImageDataset
from gradleak.defenses.base import (
    DefenseChain,
    DefenseFailure,
    SetupContext,
    check_statistics,
    is_update_level,
    statistics_note,
)
from gradleak.defenses.guard import GuardConfig, ModelGuard
from gradleak.defenses.in_loop import DefenseSpec, build_defenses, private_generator
from gradleak.federation.simulation import derive_seed
from gradleak.integrations.flower.replies import NUM_EXAMPLES, whole_number
from gradleak.types import LocalTraining, Update
from gradleak.validation import InvalidUpdateError, check_update

log = logging.getLogger(__name__)

BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")  # BatchNorm statistics


def reply_metric(reply: Message, key: str) -> int | None:
    """A whole-number metric of a ClientApp's reply (``num-examples``, ``partition-id``), from any
    MetricRecord; None when absent or not a whole number."""
    value = next((m[key] for m in reply.content.metric_records.values() if key in m), None)
    return whole_number(value)


class UnsupportedModError(ValueError):
    """A defense that needs the training loop was asked to run as a mod."""


class DefenseMod:
    """A Flower ``Mod`` applying gradleak update-level ``defenses`` to a ClientApp's train replies.

    ``seed=None`` (the default) draws the defenses' randomness from the operating system for every
    message: a server that knows gradleak, the node id and the round cannot regenerate the noise. An
    explicit ``seed`` makes it reproducible per node and round (``derive_seed(seed, node_id, round)``, the
    round from the message's ``group_id``) for experiments only: such noise can be subtracted.
    BatchNorm buffers (``running_mean``, ``running_var``, ``num_batches_tracked``) are statistics, not
    weights: they are checked (finite, as sent) and passed through as trained (``statistics="send"``), not
    clipped or noised, so a differentially private defense's epsilon does not cover them (a warning says
    so); ``statistics="withhold"`` replies with the statistics the server sent instead (FedBN: this
    client's stay local). The reply's arrays keep the dtypes the ClientApp produced (its model's), whatever
    dtype the server's strategy sent (Flower's FedAvg sends an averaged int64 counter back as float64).
    """

    def __init__(
        self, defenses: Sequence[DefenseSpec], *, seed: int | None = None, statistics: str = "send"
    ) -> None:
        self.specs = list(defenses)
        self.seed = seed
        self.statistics = check_statistics(statistics)
        if seed is not None:
            log.warning(
                "DefenseMod(seed=%d): reproducible noise is predictable noise; experiments only", seed
            )
        for d in build_defenses(self.specs):  # checked now, when the ClientApp is built
            if not is_update_level(d):
                raise UnsupportedModError(
                    f"defense {d.name!r} acts inside local training (each step's gradient or the epoch end), "
                    "which a Flower mod cannot see: apply it in the ClientApp's @app.train() function with "
                    "gradleak.defenses.in_loop.defend(model, optimizer_factory, [...])"
                )

    def __call__(self, msg: Message, ctx: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type.split(".")[0] != MessageType.TRAIN:  # also "train.<action>"
            return call_next(msg, ctx)
        if len(msg.content.array_records) != 1:
            return _refuse(
                msg,
                f"expects one ArrayRecord in the train message, found {len(msg.content.array_records)}",
            )
        w0 = next(iter(msg.content.array_records.values())).to_torch_state_dict()
        reply = call_next(msg, ctx)
        if reply.has_error():
            return reply
        if len(reply.content.array_records) != 1:
            return _refuse(
                msg, f"expects exactly one ArrayRecord in the reply, found {len(reply.content.array_records)}"
            )
        key, record = next(iter(reply.content.array_records.items()))
        wt = record.to_torch_state_dict()
        if list(wt) != list(w0):
            return _refuse(msg, "the reply's arrays do not carry the names the server sent")
        try:
            defended = self._defend(w0, wt, reply, ctx, msg)
        except (DefenseFailure, InvalidUpdateError) as exc:
            return _refuse(msg, str(exc))
        reply.content[key] = ArrayRecord(torch_state_dict=defended)
        return reply

    def _defend(
        self,
        w0: dict[str, torch.Tensor],
        wt: dict[str, torch.Tensor],
        reply: Message,
        ctx: Context,
        msg: Message,
    ) -> dict[str, torch.Tensor]:
        # the ClientApp's dtypes (its model's): the server's may differ (FedAvg's float64 counter)
        floats = {
            n: w0[n].to(t.dtype)
            for n, t in wt.items()
            if t.is_floating_point() and not n.endswith(BUFFER_SUFFIXES)
        }
        buffers = {n: wt[n] for n in w0 if n not in floats}
        bad = [n for n, t in buffers.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad:
            raise InvalidUpdateError(f"node {ctx.node_id}: buffers {bad[:3]} hold non-finite values")
        source = f"node {ctx.node_id}, round {msg.metadata.group_id or '?'}"
        delta = {n: wt[n] - t for n, t in floats.items()}
        samples = reply_metric(reply, NUM_EXAMPLES) or 1
        update = Update(delta, samples, "delta", {"node_id": ctx.node_id})
        check_update(update, floats, source=source)  # what the ClientApp produced
        chain = DefenseChain(build_defenses(self.specs))  # fresh per message: no state across rounds
        note = statistics_note(chain.defenses, [n for n, t in buffers.items() if t.is_floating_point()],
                               self.statistics)  # fmt: skip
        if note is not None:
            log.warning("gradleak DefenseMod, node %s: %s", ctx.node_id, note)
        out = self.transform(chain, update, w0, ctx, msg)
        check_update(out, floats, source=source)
        withhold = self.statistics == "withhold"
        kept = {n: w0[n].to(t.dtype) for n, t in buffers.items()} if withhold else buffers
        return {name: (floats[name] + out.tensors[name]) if name in floats else kept[name] for name in w0}

    def transform(
        self, chain: DefenseChain, update: Update, w0: dict[str, torch.Tensor], ctx: Context, msg: Message
    ) -> Update:
        """The outgoing update: ``update`` through the defenses (subclasses may decide otherwise)."""
        chain.setup(nn.Module(), SetupContext(self._generator(ctx, msg)))
        return chain.on_update(update)

    def _generator(self, ctx: Context, msg: Message) -> torch.Generator:
        if self.seed is None:
            return private_generator()
        group = msg.metadata.group_id
        rnd = int(group) if group.isdigit() else 0
        return torch.Generator().manual_seed(derive_seed(self.seed, ctx.node_id, rnd))


class GateMod(DefenseMod):
    """The client's leakage gate (:mod:`gradleak.audit.gate`) as a Flower ``Mod``: the ClientApp's reply is
    attacked by the gate's fast attack before it leaves the node and, above the threshold, defended (or,
    with ``GateConfig(withhold=True)``, replaced by an error reply).

    ``own()``: a fresh model of the node's architecture (the server's weights are loaded into it);
    ``data(context)``: the data the ClientApp trained on (the truth the gate scores against);
    ``reference(context)``: images for the floors (the node's held-out data or a public set);
    ``training``: the node's local recipe, when the attack should know it. Each decision is logged and kept
    in :attr:`decisions` on the node (node id, round, decision); nothing of it is sent to the server.
    """

    def __init__(
        self,
        own: Callable[[], nn.Module],
        data: Callable[[Context], ImageDataset],
        reference: Callable[[Context], ImageDataset],
        config: GateConfig | None = None,
        *,
        training: LocalTraining | None = None,
        seed: int | None = None,
        statistics: str = "send",
    ) -> None:
        self.config = config or GateConfig()
        super().__init__(list(self.config.defenses), seed=seed, statistics=statistics)
        self.own, self.data, self.reference, self.training = own, data, reference, training
        self.decisions: list[tuple[int, str, GateDecision]] = []

    def transform(
        self, chain: DefenseChain, update: Update, w0: dict[str, torch.Tensor], ctx: Context, msg: Message
    ) -> Update:
        model = self.own()
        state = model.state_dict()
        model.load_state_dict({n: w0[n].to(t.dtype) for n, t in state.items()})
        gate = LeakageGate(self.config, reference=self.reference(ctx))
        out, decision = gate.check(model, update, self.data(ctx), training=self.training,
                                   generator=self._generator(ctx, msg))  # fmt: skip
        self.decisions.append((ctx.node_id, msg.metadata.group_id, decision))
        if out is None:
            raise DefenseFailure(
                f"withheld by the leakage gate: {decision.leakage_db} dB above the floor "
                f"> {decision.threshold_db} dB"
            )
        return out


GUARD_STATE = "gradleak.guard.accepted"
"""The key of a node's ``Context.state`` record holding the last model its guard accepted."""


def node_guard(own: nn.Module, config: GuardConfig, trusted_start: bool, ctx: Context) -> ModelGuard:
    """A guard whose drift reference is the model this node last accepted, kept in ``ctx.state`` (Flower
    keeps a node's context across its messages; a ClientApp process may not live that long)."""
    guard = ModelGuard(own, config, trusted_start=trusted_start)
    if GUARD_STATE in ctx.state.array_records:
        guard.accepted = ctx.state.array_records[GUARD_STATE].to_torch_state_dict()
    return guard


def remember(guard: ModelGuard, ctx: Context) -> None:
    """Keep the model ``guard`` accepted in the node's context."""
    if guard.accepted is not None:
        ctx.state[GUARD_STATE] = ArrayRecord(torch_state_dict=guard.accepted)


class GuardMod:
    """A Flower ``Mod`` running the client's guard on every train message, before the ClientApp trains.

    ``own``: the node's own model (the architecture it expects; with ``trusted_start`` also the initial
    weights it agreed to); ``probe(context)``: a batch of the node's own training inputs (read by the weight
    checks on this node only). A model that fails the guard is never passed on: the reply is an error
    (``ErrorCode.MOD_FAILED_PRECONDITION``) that says why, and nothing is trained or sent. The drift
    reference lives in the node's ``Context.state``, so it survives a ClientApp process that serves one
    message. It reads message-API train messages (one ArrayRecord of named arrays); gradleak's own
    ``client_app(..., guard=...)`` also guards the legacy (SecAgg+) path.
    """

    def __init__(
        self,
        own: nn.Module,
        probe: Callable[[Context], torch.Tensor],
        config: GuardConfig | None = None,
        *,
        trusted_start: bool = False,
    ) -> None:
        self.own = own
        self.probe = probe
        self.config = config or GuardConfig()
        self.trusted_start = trusted_start

    def __call__(self, msg: Message, ctx: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type.split(".")[0] != MessageType.TRAIN:
            return call_next(msg, ctx)
        if len(msg.content.array_records) != 1:
            return _refuse(
                msg, f"expects one ArrayRecord, found {len(msg.content.array_records)}", "GuardMod"
            )
        try:
            state = next(iter(msg.content.array_records.values())).to_torch_state_dict()
        except Exception as exc:  # noqa: BLE001 - an undecodable model is refused, never raised
            return _refuse(msg, f"the model's arrays cannot be read: {type(exc).__name__}: {exc}", "GuardMod")
        guard = node_guard(self.own, self.config, self.trusted_start, ctx)
        verdict = guard.inspect(state, self.probe(ctx))
        if not verdict.safe:
            return _refuse(
                msg, f"the server's model looks malicious, not trained: {verdict.reason()}", "GuardMod"
            )
        remember(guard, ctx)
        return call_next(msg, ctx)


def _refuse(msg: Message, reason: str, mod: str = "DefenseMod") -> Message:
    log.error("gradleak %s: %s; the update is withheld", mod, reason)
    return Message(
        Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=f"gradleak {mod}: {reason}"), reply_to=msg
    )
