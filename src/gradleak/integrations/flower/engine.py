"""``[engine] name = "flower"``: an experiment's clients train on Flower's simulation engine (Ray backend).

:class:`FlowerRunner` starts a Flower simulation with one virtual SuperNode per client (client ``k`` is
served by the ``k``-th node id in sorted order) and runs gradleak's server loop inside its ServerApp: every
round and audit, :class:`GridEngine` sends each sampled client's task to its node as a Flower ``Message``
through the
ServerApp's ``Grid`` and waits (``timeout``) for the replies; the ClientApp (:func:`task_client_app`) trains
with :func:`gradleak.fl.client.train_client` exactly as :class:`~gradleak.fl.simulation.InProcessEngine`
does, with the same per-task seed, so the two engines give the same updates (float rounding apart: the Ray
workers run torch with their own thread count) and the same attack results.

The train message carries the server's model whole (``torch.save`` of the module: architecture and
weights), the recipe, the seed and how many of the client's first samples to use (an audit's
``max_samples``): a malicious server's modified model (an imprint layer in front, a customised copy per
client) reaches the node as it does in-process. This is a simulation engine, where server and clients run
gradleak's code; a deployment on real SuperNodes sends weights only (:func:`gradleak.integrations.flower.
apps.client_app` with :class:`~gradleak.integrations.flower.AuditStrategy`). The reply carries the update
as it left the client's defenses (an ``ArrayRecord``), its kind and sample count, the client's error if a
defense failed closed, and, for the simulation's scoring only, which of the client's samples it used.

A node that raises becomes an error reply, a node that does not answer in time is missing: both are a
``ClientResult`` with no update and the reason, so the round goes on with the others (as in-process).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from torch import nn

from gradleak.data.base import ImageDataset
from gradleak.fl.client import ClientResult, train_client
from gradleak.fl.engines import FlowerEngineConfig
from gradleak.fl.simulation import ClientTask, DefenseFactory, Engine
from gradleak.integrations.flower.apps import module_bytes, module_from
from gradleak.types import LocalTraining, Update

log = logging.getLogger(__name__)

T = TypeVar("T")
MODEL, TASK, RESULT, UPDATE = "model", "task", "result", "update"


def samples_of(task: ClientTask) -> int:
    """How many of the client's first samples the task trains on (-1: all), checked against its data."""
    if task.private is None:
        return -1
    n = len(task.data)
    if not torch.equal(task.private.subset(np.arange(n)).images, task.data.images):
        raise ValueError(
            f"client {task.client_id}'s task data is not the first {n} samples of its share: the Flower "
            "engine can only send a sample count (an audit's max_samples)"
        )
    return n


def task_message(task: ClientTask, model: bytes, node_id: int) -> Message:
    config = ConfigRecord({
        "client-id": task.client_id, "seed": task.seed, "samples": samples_of(task),
        "training": json.dumps(dataclasses.asdict(task.training)),
    })  # fmt: skip
    content = RecordDict({MODEL: ConfigRecord({"module": model}), TASK: config})
    return Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN)


def result_content(result: ClientResult) -> RecordDict:
    update = result.update
    info: dict[str, Any] = {"error": result.error or ""}
    content = RecordDict()
    if update is not None:
        info.update(kind=update.kind, samples=update.num_samples, metadata=json.dumps(dict(update.metadata)))
        content[UPDATE] = ArrayRecord(torch_state_dict=dict(update.tensors))
    if result.sample_index is not None:
        info["sample-index"] = list(result.sample_index)
    content[RESULT] = ConfigRecord(info)
    if result.stats:
        content["stats"] = MetricRecord({k: float(v) for k, v in result.stats.items()})
    return content


def result_of(reply: Message, task: ClientTask) -> ClientResult:
    """The ClientResult a node's reply stands for (truth: the task's data the update used)."""
    cid = task.client_id
    if reply.has_error():
        return ClientResult(
            cid, None, None, error=f"ClientApp error {reply.error.code}: {reply.error.reason}"
        )
    info = reply.content.config_records[RESULT]
    stats = {k: float(v) for k, v in reply.content.metric_records.get("stats", {}).items()}  # type: ignore[arg-type]
    if UPDATE not in reply.content.array_records:
        return ClientResult(cid, None, None, error=str(info["error"]) or "no update", stats=stats)
    tensors = reply.content.array_records[UPDATE].to_torch_state_dict()
    metadata = json.loads(str(info["metadata"]))
    update = Update(dict(tensors), int(info["samples"]), info["kind"], metadata)  # type: ignore[arg-type]
    index = tuple(int(i) for i in info["sample-index"]) if "sample-index" in info else None  # type: ignore[union-attr]
    truth = task.data if index is None else task.data.subset(np.asarray(index))
    return ClientResult(cid, update, truth, stats=stats, sample_index=index)


def task_client_app(clients: Sequence[ImageDataset], defenses: DefenseFactory) -> ClientApp:
    """The ClientApp of the Flower engine: it holds every client's data (a simulation) and trains the
    client the task names (module docstring). ``defenses()`` builds a fresh list per task; it travels
    to the Ray actors with the data, so it must be importable there by name (a ``functools.partial`` of
    :func:`gradleak.defenses.in_loop.build_defenses`), not a closure of a test or notebook."""
    data = list(clients)
    app = ClientApp()

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        task = msg.content.config_records[TASK]
        cid = int(task["client-id"])  # type: ignore[arg-type]
        model = module_from(msg.content.config_records[MODEL]["module"])  # type: ignore[arg-type]
        training = LocalTraining(**json.loads(str(task["training"])))
        n = int(task["samples"])  # type: ignore[arg-type]
        share = data[cid]
        train_data, private = (share, None) if n < 0 else (share.subset(np.arange(n)), share)
        gen = torch.Generator().manual_seed(int(task["seed"]))  # type: ignore[arg-type]
        result = train_client(cid, model, train_data, training, list(defenses()), gen, private=private)
        return Message(result_content(result), reply_to=msg)

    return app


class GridEngine:
    """An :class:`~gradleak.fl.simulation.Engine` that trains each task on its client's Flower node."""

    name = "flower"

    def __init__(self, grid: Grid, node_of: dict[int, int], defenses: DefenseFactory, timeout: float) -> None:
        self.grid, self.node_of, self.defenses, self.timeout = grid, node_of, defenses, timeout

    def train_clients(
        self, global_model: nn.Module, tasks: Sequence[ClientTask], defenses: DefenseFactory
    ) -> list[ClientResult]:
        if defenses is not self.defenses:
            raise ValueError(
                "the Flower engine's ClientApp was built with another defense factory than this round's: "
                "the defenses run on the nodes, so they are fixed when the simulation starts"
            )
        ids = [t.client_id for t in tasks]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a round's tasks must be for distinct clients, got {ids}")
        unknown = sorted(set(ids) - set(self.node_of))
        if unknown:
            raise ValueError(f"clients {unknown} have no Flower node (nodes: {len(self.node_of)})")
        blob = module_bytes(global_model)
        messages = [task_message(t, blob, self.node_of[t.client_id]) for t in tasks]
        replies = {
            int(r.metadata.src_node_id): r for r in self.grid.send_and_receive(messages, timeout=self.timeout)
        }
        results = []
        for task in tasks:
            reply = replies.get(self.node_of[task.client_id])
            if reply is None:
                results.append(
                    ClientResult(task.client_id, None, None, error=f"no reply within {self.timeout} s")
                )
            else:
                results.append(result_of(reply, task))
        return results


def discover(grid: Grid, expected: int, timeout: float) -> dict[int, int]:
    """Client id -> Flower node id (the sorted node ids, in order), once every node has registered.
    Not by asking each node its ``partition-id``: the first message to a node costs about a second on
    Flower's simulation engine here, so asking 1,000 nodes took longer than the rounds."""
    deadline = time.monotonic() + timeout
    nodes = sorted(grid.get_node_ids())
    while len(nodes) < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(nodes)} of {expected} Flower nodes registered within {timeout} s")
        time.sleep(0.2)
        nodes = sorted(grid.get_node_ids())
    return {k: int(node) for k, node in enumerate(nodes[:expected])}


class FlowerRunner:
    """Runs ``work`` inside the ServerApp of a Flower simulation on Ray (module docstring)."""

    def __init__(self, config: FlowerEngineConfig) -> None:
        self.config = config

    def backend_config(self) -> dict[str, Any]:
        c = self.config
        return {"client_resources": {"num_cpus": c.client_cpus}, "init_args": {"num_cpus": c.cpus}}

    def run(
        self,
        clients: Sequence[ImageDataset],
        defenses: DefenseFactory,
        work: Callable[[Engine], T],
        *,
        progress: bool = False,
    ) -> T:
        from flwr.simulation import run_simulation

        outcome: dict[str, Any] = {}
        server = ServerApp()

        @server.main()
        def main(grid: Grid, context: Context) -> None:
            try:
                node_of = discover(grid, len(clients), self.config.startup_timeout)
                outcome["value"] = work(GridEngine(grid, node_of, defenses, self.config.timeout))
            except BaseException as exc:  # re-raised in the caller's thread, after Flower has shut down
                outcome["error"] = exc

        log.info("Flower simulation: %d virtual SuperNodes on Ray (%s)", len(clients), self.backend_config())
        run_simulation(
            server_app=server, client_app=task_client_app(clients, defenses), num_supernodes=len(clients),
            backend_config=self.backend_config(),
        )  # fmt: skip
        if "error" in outcome:
            raise outcome["error"]
        if "value" not in outcome:
            raise RuntimeError("the Flower simulation ended before gradleak's rounds finished")
        return outcome["value"]
