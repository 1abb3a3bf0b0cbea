"""A Flower ClientApp that trains like gradleak's in-process clients, for Flower's simulation engine (Ray).

``client_app(clients, ...)`` serves node ``partition-id = k`` (Flower's simulation sets it in each node's
``node_config``) with ``clients[k]``, and trains it with :func:`gradleak.tasks.client.train_client` seeded
``derive_seed(seed, round - 1, k)``: the update a node sends in Flower round ``r`` is the one the in-process
simulation's client ``k`` computes in its round ``r - 1`` (Flower counts rounds from 1). A client whose
defense fails closed, or whose training raises, sends no arrays: Flower turns the exception into an error
reply and the round goes on with the others (:class:`~gradleak.integrations.flower.AuditStrategy` records
it). The reply carries ``w_0 + update`` (Flower's convention) and the metrics ``num-examples`` and
``partition-id``.

The same ClientApp serves Flower's legacy workflows, whose train messages carry ``FitIns`` (``fitins.
parameters``, ``fitins.config``; the round from the config's ``server-round`` if the strategy sets it, else
the message's ``group_id``): it then replies with a ``FitRes`` of the weights in ``state_dict`` order and
``num_examples``. That is what Flower's SecAgg+ workflow sends and ``secaggplus_mod`` masks:
``client_app(..., mods=[secaggplus_mod])`` beside a ServerApp running ``SecAggPlusWorkflow`` over
:class:`~gradleak.integrations.flower.LegacyAuditStrategy`.

A train message that carries a ``gradleak.architecture`` record (an architecture the server chose, as the
wrapper's malicious-server option sends: an imprint block in front of the node's own model) is refused
unless the ClientApp opted in (``accept_architecture=True``, for audits of the threat model in which the
server ships the model); the audit records the refusal as that node's error. The architecture travels as a
spec (JSON of a closed set of layer kinds, size-checked: :mod:`gradleak.models.architecture`), never as a
pickle, and only ever wraps the node's own ``build_model()``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence

import flwr.compat.common.recorddict_compat as compat
import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod
from flwr.common import Code, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from torch import nn

from gradleak.data.base import ImageDataset
from gradleak.defenses.base import Defense, DefenseFailure
from gradleak.defenses.guard import GuardConfig, MaliciousModelError
from gradleak.defenses.in_loop import private_generator
from gradleak.integrations.flower.mods import node_guard, remember
from gradleak.models.architecture import Limits, build
from gradleak.types import LocalTraining

log = logging.getLogger(__name__)
CLIENT_LIMITS = Limits(allow_registered=False)  # a deployed node wraps a sent block around its own model

PARTITION_ID = "partition-id"
ARCHITECTURE = "gradleak.architecture"  # a ConfigRecord whose "spec" is the server's architecture as JSON


LEGACY_PARAMETERS = "fitins.parameters"  # the ArrayRecord of a legacy workflow's train message
SECAGG_STATE = "secaggplus_state"  # secaggplus_mod's ConfigRecord in the node's context


def masked_names(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The entries of a model's state a client sends under SecAgg+, in order: the floating ones. Integer
    buffers (BatchNorm's ``num_batches_tracked``, a count of local steps) stay out of the masked vector:
    SecAgg+ clips every entry to its ``clipping_range`` (8 by default), which a count passes within a few
    steps; the server keeps the count it sent."""
    return [n for n, t in state.items() if t.is_floating_point()]


def named_arrays(
    reference: Mapping[str, torch.Tensor], parameters: Parameters, source: str, *, cast: bool = True
) -> dict[str, torch.Tensor]:
    """Legacy ``Parameters`` as the named tensors of ``reference`` (a ``state_dict``: the NumPyClient
    convention; or the model's parameters, as the engine's SecAgg+ clients send them): same order, the same
    shapes (checked); ``cast``: to the reference's dtypes (a SecAgg+ aggregate is float64; a client's own
    arrays are checked for the model's dtypes instead, ``cast=False``)."""
    from gradleak.validation import InvalidUpdateError

    try:
        arrays = parameters_to_ndarrays(parameters)
    except Exception as exc:  # noqa: BLE001 - undecodable bytes are the sender's fault
        raise InvalidUpdateError(f"{source}: arrays that do not decode: {type(exc).__name__}"[:300]) from None
    if len(arrays) != len(reference):
        raise InvalidUpdateError(
            f"{source}: {len(arrays)} arrays, but the model has {len(reference)} entries to fill"
        )
    out = {}
    for (name, ref), array in zip(reference.items(), arrays, strict=True):
        if tuple(array.shape) != tuple(ref.shape):
            raise InvalidUpdateError(
                f"{source}: array {name!r} has shape {tuple(array.shape)}, the model's {tuple(ref.shape)}"
            )
        try:
            t = torch.from_numpy(np.array(array, copy=True))
        except TypeError as exc:  # a dtype torch has no tensor for (object, strings)
            raise InvalidUpdateError(f"{source}: array {name!r}: {exc}"[:300]) from None
        out[name] = t.to(ref.dtype) if cast else t
    return out


def check_secagg_range(arrays: Mapping[str, torch.Tensor], ctx: Context, source: str) -> None:
    """Under ``secaggplus_mod`` (its state in the node's context after the setup stage), every array it
    will mask must be finite and within its ``clipping_range``: SecAgg+ would clip a larger value silently
    (a BatchNorm ``num_batches_tracked`` count too), so the reply is withheld instead (fail closed)."""
    state = ctx.state.config_records.get(SECAGG_STATE)
    known = state is not None and "clipping_range" in state
    clip = float(state["clipping_range"]) if known else math.inf  # type: ignore[arg-type,index]
    for name, t in arrays.items():
        peak = float(t.detach().abs().max()) if t.numel() else 0.0
        if not peak <= clip:  # also NaN
            raise ValueError(
                f"{source}: {name} reaches {peak:.4g}, beyond SecAgg+'s clipping_range {clip}: the reply is "
                "withheld rather than clipped (raise the workflow's clipping_range)"
            )


class ArchitectureRefused(RuntimeError):
    """The server sent an architecture of its own choosing to a ClientApp that did not opt in."""


def sent_model(
    msg: Message, build_model: Callable[[], object], accept_architecture: bool, limits: Limits, k: int
) -> nn.Module:
    """The module this node trains: its own ``build_model()``, or, when the message carries a
    ``gradleak.architecture`` spec and the ClientApp opted in, that spec built around its own model
    (never unpickled: :mod:`gradleak.models.architecture`)."""
    if ARCHITECTURE not in msg.content.config_records:
        model = build_model()
    elif not accept_architecture:
        raise ArchitectureRefused(
            f"partition {k}: the server sent an architecture of its own choosing (a "
            f"{ARCHITECTURE!r} record); this ClientApp trains only its own model "
            "(client_app(..., accept_architecture=True) opts in, for audits of a malicious server)"
        )
    else:
        spec = msg.content.config_records[ARCHITECTURE].get("spec")
        model = build(spec, own=build_model, limits=limits)  # type: ignore[arg-type]
    if not isinstance(model, nn.Module):
        raise TypeError(f"build_model() returned a {type(model).__name__}, not a torch module")
    return model


def client_app(
    clients: Sequence[ImageDataset],
    build_model: Callable[[], object],
    training: LocalTraining,
    *,
    defenses: Callable[[], Sequence[Defense]] = tuple,
    seed: int | None = None,
    mods: Sequence[Mod] = (),
    accept_architecture: bool = False,
    limits: Limits = CLIENT_LIMITS,
    guard: GuardConfig | None = None,
) -> ClientApp:
    """A ClientApp whose node ``partition-id = k`` trains ``clients[k]`` (see the module docstring).

    ``build_model()`` returns the architecture (the weights come from the server's message);
    ``defenses()`` a fresh list of defenses per round, as the in-process engine builds them. Both travel
    to the Ray actors: pass functions importable by name there (``functools.partial(
    gradleak.models.build_model, "aegis_cnn", shape, classes, seed=0)``), not a test's or notebook's own.
    ``mods``: Flower mods around it (e.g. ``[secaggplus_mod]``, ``[DefenseMod([...])]``).

    ``seed=None`` (the default) draws the client's randomness (shuffling, the defenses' noise) from the
    operating system: a server knows the round and the partition id, so noise it could regenerate it
    could subtract. An int seed reproduces the in-process simulation's client (``derive_seed(seed, round
    - 1, k)``), for experiments and tests only. ``accept_architecture``: train a model the server chose
    (its imprint block around this node's own model, within ``limits``); by default such a message is
    refused. ``guard``: run the client's guard (:mod:`gradleak.defenses.guard`) on every model before
    training, on the node's own data; a hit raises :class:`~gradleak.defenses.guard.MaliciousModelError`
    (Flower replies with an error) and nothing is trained.
    """
    if seed is not None:
        log.warning("client_app(seed=%d): reproducible noise is predictable noise; experiments only", seed)
    data = list(clients)
    app = ClientApp(mods=list(mods))

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        from gradleak.federation.simulation import derive_seed
        from gradleak.tasks.client import train_client

        k = int(ctx.node_config[PARTITION_ID])
        model = sent_model(msg, build_model, accept_architecture, limits, k)
        legacy = LEGACY_PARAMETERS in msg.content.array_records
        if legacy:  # a legacy workflow's FitIns (e.g. SecAgg+)
            fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
            w0 = named_arrays(model.state_dict(), fitins.parameters, f"partition {k}'s train message")
            rnd = int(fitins.config.get("server-round", msg.metadata.group_id))
        else:
            w0 = msg.content.array_records["arrays"].to_torch_state_dict()
            rnd = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
        if guard is not None:  # its drift reference lives in the node's context (mods.node_guard)
            checker = node_guard(build_model(), guard, False, ctx)  # type: ignore[arg-type]
            verdict = checker.inspect(w0, data[k].images[: guard.probe_size])
            if not verdict.safe:
                raise MaliciousModelError(
                    f"partition {k}: the server's model looks malicious: {verdict.reason()}"
                )
            remember(checker, ctx)
        model.load_state_dict(w0)
        gen = (
            private_generator()
            if seed is None
            else torch.Generator().manual_seed(derive_seed(seed, rnd - 1, k))
        )
        result = train_client(k, model, data[k], training, list(defenses()), gen)
        if result.update is None:
            raise DefenseFailure(f"partition {k}: {result.error}")
        sign = 1.0 if result.update.kind == "delta" else -training.lr  # a FedSGD gradient as one SGD step
        weights = {n: t.clone() for n, t in w0.items()}
        for name, u in result.update.tensors.items():
            weights[name] = w0[name] + sign * u
        for name, b in result.update.buffers.items():  # the statistics as trained, as a FedAvg reply carries
            weights[name] = b.to(w0[name].dtype)
        n = result.update.num_samples
        if legacy:
            if SECAGG_STATE in ctx.state.config_records:  # integer buffers stay out of the masked vector
                weights = {n: weights[n] for n in masked_names(weights)}
            check_secagg_range(weights, ctx, f"partition {k}")
            arrays = ndarrays_to_parameters([t.detach().numpy() for t in weights.values()])
            fitres = FitRes(Status(Code.OK, ""), arrays, n, {PARTITION_ID: k})
            return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)
        metrics = MetricRecord({"num-examples": n, PARTITION_ID: k})
        return Message(RecordDict({"arrays": ArrayRecord(torch_state_dict=weights), "metrics": metrics}),
                       reply_to=msg)  # fmt: skip

    return app
