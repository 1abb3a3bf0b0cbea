"""A Flower ClientApp that trains like gradleak's in-process clients, for Flower's simulation engine (Ray).

``client_app(clients, ...)`` serves node ``partition-id = k`` (Flower's simulation sets it in each node's
``node_config``) with ``clients[k]``, and trains it with :func:`gradleak.fl.client.train_client` seeded
``derive_seed(seed, round - 1, k)``: the update a node sends in Flower round ``r`` is the one the in-process
simulation's client ``k`` computes in its round ``r - 1`` (Flower counts rounds from 1). A client whose
defense fails closed, or whose training raises, sends no arrays: Flower turns the exception into an error
reply and the round goes on with the others (:class:`~gradleak.integrations.flower.AuditStrategy` records
it). The reply carries ``w_0 + update`` (Flower's convention) and the metrics ``num-examples`` and
``partition-id``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from gradleak.data.base import ImageDataset
from gradleak.defenses.base import Defense, DefenseFailure
from gradleak.types import LocalTraining

PARTITION_ID = "partition-id"


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
        import torch  # the Ray actor imports this module alone: torch must be imported for ArrayRecord

        from gradleak.fl.client import train_client
        from gradleak.fl.simulation import derive_seed

        k = int(ctx.node_config[PARTITION_ID])
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
