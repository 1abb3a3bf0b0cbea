"""A Flower ClientApp that trains like gradleak's in-process clients, for Flower's simulation engine (Ray).

``client_app(clients, ...)`` serves node ``partition-id = k`` (Flower's simulation sets it in each node's
``node_config``) with ``clients[k]``, and trains it with :func:`gradleak.fl.client.train_client` seeded
``derive_seed(seed, round - 1, k)``: the update a node sends in Flower round ``r`` is the one the in-process
simulation's client ``k`` computes in its round ``r - 1`` (Flower counts rounds from 1). A client whose
defense fails closed, or whose training raises, sends no arrays: Flower turns the exception into an error
reply and the round goes on with the others (:class:`~gradleak.integrations.flower.AuditStrategy` records
it). The reply carries ``w_0 + update`` (Flower's convention) and the metrics ``num-examples`` and
``partition-id``.

A train message that carries a ``gradleak.architecture`` record (the server's own module, as the wrapper's
malicious-server option sends: an architecture the server chose, e.g. an imprint layer in front) is
trained on that module instead of ``build_model()``: the threat model in which the server ships the model.
A ClientApp that builds its own architecture and loads weights strictly refuses such a message (its
``load_state_dict`` raises), which the audit records as that node's error.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from gradleak.data.base import ImageDataset
from gradleak.defenses.base import Defense, DefenseFailure
from gradleak.types import LocalTraining

PARTITION_ID = "partition-id"
ARCHITECTURE = "gradleak.architecture"  # a ConfigRecord whose "module" is torch.save of the server's module


def module_bytes(model: nn.Module) -> bytes:
    """The whole module (architecture and weights), for a simulation's server to send."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    return buffer.getvalue()


def module_from(blob: bytes) -> nn.Module:
    """The module :func:`module_bytes` sent (unpickled: only for a server whose code you run yourself)."""
    model = torch.load(io.BytesIO(blob), weights_only=False)
    if not isinstance(model, nn.Module):
        raise TypeError(f"the message's module is a {type(model).__name__}, not a torch module")
    return model


def client_app(
    clients: Sequence[ImageDataset],
    build_model: Callable[[], object],
    training: LocalTraining,
    *,
    defenses: Callable[[], Sequence[Defense]] = tuple,
    seed: int = 0,
) -> ClientApp:
    """A ClientApp whose node ``partition-id = k`` trains ``clients[k]`` (see the module docstring).

    ``build_model()`` returns the architecture (the weights come from the server's message);
    ``defenses()`` a fresh list of defenses per round, as the in-process engine builds them. Both travel
    to the Ray actors: pass functions importable by name there (``functools.partial(
    gradleak.models.build_model, "aegis_cnn", shape, classes, seed=0)``), not a test's or notebook's own.
    """
    data = list(clients)
    app = ClientApp()

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        from gradleak.fl.client import train_client
        from gradleak.fl.simulation import derive_seed

        k = int(ctx.node_config[PARTITION_ID])
        if ARCHITECTURE in msg.content.config_records:  # the server chose the architecture
            model: object = module_from(msg.content.config_records[ARCHITECTURE]["module"])  # type: ignore[arg-type]
        else:
            model = build_model()
        assert isinstance(model, torch.nn.Module)
        w0 = msg.content.array_records["arrays"].to_torch_state_dict()
        model.load_state_dict(w0)
        rnd = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
        gen = torch.Generator().manual_seed(derive_seed(seed, rnd - 1, k))
        result = train_client(k, model, data[k], training, list(defenses()), gen)
        if result.update is None:
            raise DefenseFailure(f"partition {k}: {result.error}")
        sign = 1.0 if result.update.kind == "delta" else -training.lr  # a FedSGD gradient as one SGD step
        weights = {n: t.clone() for n, t in w0.items()}
        for name, u in result.update.tensors.items():
            weights[name] = w0[name] + sign * u
        metrics = MetricRecord({"num-examples": result.update.num_samples, PARTITION_ID: k})
        return Message(RecordDict({"arrays": ArrayRecord(torch_state_dict=weights), "metrics": metrics}),
                       reply_to=msg)  # fmt: skip

    return app
