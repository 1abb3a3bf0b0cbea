"""``[engine] name = "flower"``: an experiment's clients train on Flower's simulation engine (Ray backend).

:class:`FlowerRunner` starts a Flower simulation with one virtual SuperNode per client (client ``k`` is
served by the ``k``-th node id in sorted order) and runs gradleak's server loop inside its ServerApp: every
round and audit, :class:`GridEngine` sends each sampled client's task to its node as a Flower ``Message``
through the ServerApp's ``Grid`` and waits (``timeout``) for the replies; the ClientApp
(:func:`task_client_app`) trains with :func:`gradleak.tasks.client.train_client` exactly as
:class:`~gradleak.federation.simulation.InProcessEngine` does, with the same per-task seed, so the two
engines give the same updates (float rounding apart: the Ray workers run torch with their own thread count)
and the same attack results.

The train message carries the server's model as a spec and its weights (:mod:`gradleak.models.architecture`:
the registered model the experiment built, with any imprint block a malicious server put in front, as
JSON of a closed set of layer kinds; never a pickle), the recipe, the seed and how many of the client's
first samples to use (an audit's ``max_samples``): a malicious server's modified model (an imprint layer in
front, a customised copy per client) reaches the node as it does in-process. A deployment on real
SuperNodes sends weights only (:func:`gradleak.integrations.flower.apps.client_app` with
:class:`~gradleak.integrations.flower.AuditStrategy`). The reply carries the update
as it left the client's defenses (an ``ArrayRecord``), its kind and sample count, the client's error if a
defense failed closed, and, for the simulation's scoring only, which of the client's samples it used.

A node that raises becomes an error reply, a node that does not answer in time is missing: both are a
``ClientResult`` with no update and the reason, so the round goes on with the others (as in-process).

With ``secagg.enabled`` (and ``fl.secure_aggregation = true``) every round and the audit run Flower's own
SecAgg+ protocol: :meth:`SecureGridEngine.aggregate_clients` drives ``SecAggPlusWorkflow`` (key setup, key
sharing, masked uploads, unmasking) over the ServerApp's grid, the ClientApp answers through
``secaggplus_mod``, and the server gets only the unmasked aggregate: the weighted mean of the clients'
updates for a training round, their sum for the audit (every client then weighs 1: the mean times the
number of clients). A client that fails is a dropout the protocol recovers from while at least the
reconstruction threshold of clients remain (its masks are rebuilt from the others' shares); below it the
protocol halts and the round has no aggregate (recorded). Each update entry is quantised (``2 c /
quantization_range`` per client) and must lie in ``[-c, c]``: a client whose update does not fails closed
instead of being clipped. The quantisation's stochastic rounding draws from numpy's global generator on the
node: the node seeds it with the task's seed, so a SecAgg+ run is reproducible.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import flwr.compat.common.recorddict_compat as compat
import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Parameters,
    Status,
    ndarrays_to_parameters,
)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.server import LegacyContext, ServerConfig
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid, ServerApp
from torch import nn

from gradleak.federation.server import update_kind
from gradleak.federation.simulation import ClientTask, DefenseFactory, Engine, SecureRound
from gradleak.integrations.flower.apps import LEGACY_PARAMETERS, named_arrays
from gradleak.integrations.flower.config import MODULUS_RANGE, FlowerEngineConfig, SecAggPlusConfig
from gradleak.models.architecture import build, describe
from gradleak.tasks import Dataset, task_from_spec, task_spec
from gradleak.tasks.client import ClientResult, reported_samples, train_client
from gradleak.types import LocalTraining, Update
from gradleak.validation import reference_of

log = logging.getLogger(__name__)

T = TypeVar("T")
MODEL, WEIGHTS, TASK, RESULT, UPDATE, BUFFERS = "model", "weights", "task", "result", "update", "buffers"
TEMPLATES = 4  # built models a node keeps per spec, so that a round does not rebuild (or reload) them
_templates: dict[str, nn.Module] = {}


def fresh_model(spec: object) -> nn.Module:
    """A new module of the architecture a task message's spec names (built from the spec, never
    unpickled; a node keeps the last few built, so that a round does not rebuild or reload them)."""
    key = spec if isinstance(spec, str) else repr(spec)
    template = _templates.get(key)
    if template is None:
        template = build(spec)
        if len(_templates) >= TEMPLATES:
            _templates.pop(next(iter(_templates)))
        _templates[key] = template
    return copy.deepcopy(template)


def model_from(spec: object, weights: dict[str, torch.Tensor]) -> nn.Module:
    """The module a task message's spec and weights stand for (the weights loaded strictly)."""
    model = fresh_model(spec)
    model.load_state_dict(weights, strict=True)
    return model


def samples_of(task: ClientTask) -> int:
    """How many of the client's first samples the task trains on (-1: all), checked against its data."""
    if task.private is None:
        return -1
    n = len(task.data)
    if not torch.equal(task.private.subset(np.arange(n)).inputs, task.data.inputs):
        raise ValueError(
            f"client {task.client_id}'s task data is not the first {n} samples of its share: the Flower "
            "engine can only send a sample count (an audit's max_samples)"
        )
    return n


def task_config(task: ClientTask) -> dict[str, Any]:
    """What a node needs to train ``task`` besides the model (the data is the node's own)."""
    return {"client-id": task.client_id, "seed": task.seed, "samples": samples_of(task),
            "training": json.dumps(dataclasses.asdict(task.training)),
            "learning-task": json.dumps(task_spec(task.task))}  # fmt: skip


def task_message(task: ClientTask, spec: str, weights: ArrayRecord, node_id: int) -> Message:
    content = RecordDict(
        {MODEL: ConfigRecord({"spec": spec}), WEIGHTS: weights, TASK: ConfigRecord(task_config(task))}
    )
    return Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN)


def result_content(result: ClientResult) -> RecordDict:
    update = result.update
    info: dict[str, Any] = {"error": result.error or ""}
    content = RecordDict()
    if update is not None:
        info.update(kind=update.kind, samples=update.num_samples, metadata=json.dumps(dict(update.metadata)))
        content[UPDATE] = ArrayRecord(torch_state_dict=dict(update.tensors))
        if update.buffers:  # BatchNorm statistics, as a FedAvg reply carries them
            content[BUFFERS] = ArrayRecord(torch_state_dict=dict(update.buffers))
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
    buffers = (
        reply.content.array_records[BUFFERS].to_torch_state_dict()
        if BUFFERS in reply.content.array_records
        else {}
    )
    update = Update(dict(tensors), int(info["samples"]), info["kind"], metadata, dict(buffers))  # type: ignore[arg-type]
    index = tuple(int(i) for i in info["sample-index"]) if "sample-index" in info else None  # type: ignore[union-attr]
    truth = task.data if index is None else task.data.subset(np.asarray(index))
    return ClientResult(cid, update, truth, stats=stats, sample_index=index)


def run_task(
    data: Sequence[Dataset],
    config: Any,
    model: nn.Module,
    defenses: DefenseFactory,
    data_root: str | os.PathLike[str] | None = None,
) -> tuple[nn.Module, ClientResult]:
    """Train the task a message's ``config`` (:func:`task_config`) names on the model it sent."""
    cid = int(config["client-id"])
    training = LocalTraining(**json.loads(str(config["training"])))
    learning = task_from_spec(json.loads(str(config["learning-task"])))
    n = int(config["samples"])
    share = data[cid]
    train_data, private = (share, None) if n < 0 else (share.subset(np.arange(n)), share)
    gen = torch.Generator().manual_seed(int(config["seed"]))
    result = train_client(cid, model, train_data, training, list(defenses()), gen, private=private,
                          task=learning, data_root=data_root)  # fmt: skip
    return model, result


def secure_model(spec: object, parameters: Parameters) -> nn.Module:
    """A SecAgg+ task's model: its spec, with the weights in ``state_dict`` order in ``FitIns.parameters``."""
    model = fresh_model(spec)
    model.load_state_dict(
        named_arrays(model.state_dict(), parameters, "the SecAgg+ task's model"), strict=True
    )
    return model


def secure_reply(
    msg: Message,
    data: Sequence[Dataset],
    defenses: DefenseFactory,
    data_root: str | os.PathLike[str] | None = None,
) -> Message:
    """A SecAgg+ round's train message (legacy ``FitIns``, the task in its config): the update's tensors
    as ``FitRes`` parameters, in the model's parameter order, for ``secaggplus_mod`` to mask. A failed
    client raises (a dropout for the protocol), as does an update outside the clipping range."""
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    config = fitins.config
    model, result = run_task(
        data, config, secure_model(config["spec"], fitins.parameters), defenses, data_root
    )
    cid = result.client_id
    if result.update is None:
        raise RuntimeError(f"client {cid}: {result.error}")
    names = list(reference_of(model))
    tensors = [result.update.tensors[n].detach() for n in names]
    clip = float(config["clipping-range"])
    peak = max(float(t.abs().max()) for t in tensors)
    if not peak <= clip:  # also NaN
        raise ValueError(
            f"client {cid}: an update entry reaches {peak:.4g}, beyond SecAgg+'s clipping_range {clip}; the "
            "client withholds it rather than have it clipped (raise [engine.options.secagg] clipping_range)"
        )
    samples = result.update.num_samples
    metrics: dict[str, Any] = {"samples": samples, "kind": result.update.kind}
    if result.sample_index is not None:
        metrics["sample-index"] = json.dumps(list(result.sample_index))
    weight = samples if bool(config["weighted"]) else 1
    fitres = FitRes(
        Status(Code.OK, ""), ndarrays_to_parameters([t.numpy() for t in tensors]), weight, metrics
    )
    # secaggplus_mod quantises with stochastic rounding from numpy's global generator right after this
    # returns, in this process: seeded by the task, the aggregate is reproducible
    np.random.seed(int(config["seed"]) % 2**32)
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)


def secagg_when_asked(msg: Message, ctx: Context, call_next: ClientAppCallable) -> Message:
    """``secaggplus_mod`` for the messages of a SecAgg+ round; the engine's plain task messages pass."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, ctx, call_next)
    return call_next(msg, ctx)


def task_client_app(
    clients: Sequence[Dataset],
    defenses: DefenseFactory,
    *,
    secagg: bool = False,
    data_root: str | os.PathLike[str] | None = None,
) -> ClientApp:
    """The ClientApp of the Flower engine: it holds every client's data (a simulation) and trains the
    client the task names (module docstring). ``defenses()`` builds a fresh list per task; it travels
    to the Ray actors with the data, so it must be importable there by name (a ``functools.partial`` of
    :func:`gradleak.defenses.in_loop.build_defenses`), not a closure of a test or notebook. ``secagg``:
    answer SecAgg+ rounds too (through ``secaggplus_mod``). ``data_root``: the clients' data root, for their
    defenses' setup (a public split); bound here, never taken from a message."""
    data = list(clients)
    app = ClientApp(mods=[secagg_when_asked] if secagg else [])

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        if LEGACY_PARAMETERS in msg.content.array_records:
            return secure_reply(msg, data, defenses, data_root)
        config = msg.content.config_records[TASK]
        spec = msg.content.config_records[MODEL]["spec"]
        model = model_from(spec, msg.content.array_records[WEIGHTS].to_torch_state_dict())
        _, result = run_task(data, config, model, defenses, data_root)
        return Message(result_content(result), reply_to=msg)

    return app


class _Node(ClientProxy):
    """The proxy SecAggPlusWorkflow reads a node id from (it sends through the grid, not the proxy)."""

    def __init__(self, node_id: int) -> None:
        super().__init__(str(node_id))
        self.node_id = node_id

    def _unused(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the SecAgg+ workflow talks to nodes through the grid")

    get_properties = get_parameters = fit = evaluate = reconnect = _unused


class _SecureTasks(Strategy):
    """The legacy strategy SecAggPlusWorkflow drives for one gradleak round: it hands out the tasks' FitIns
    and keeps what the workflow unmasked; the model is gradleak's to update, so it returns no parameters."""

    def __init__(self, fitins: list[tuple[ClientProxy, FitIns]]) -> None:
        self.fitins = fitins
        self.results: list[tuple[ClientProxy, FitRes]] = []
        self.failures: list[Any] = []
        self.aggregated = False  # whether the workflow got as far as unmasking

    def initialize_parameters(self, client_manager: Any) -> Parameters | None:
        return None

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> Any:
        return self.fitins

    def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> tuple[None, dict[str, Any]]:
        self.results, self.failures, self.aggregated = list(results), list(failures), True
        return None, {}

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: Any) -> Any:
        return []

    def aggregate_evaluate(
        self, server_round: int, results: Any, failures: Any
    ) -> tuple[None, dict[str, Any]]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> None:
        return None


class GridEngine:
    """An :class:`~gradleak.federation.simulation.Engine` that trains each task on its client's Flower
    node."""

    name = "flower"

    def __init__(self, grid: Grid, node_of: dict[int, int], defenses: DefenseFactory, timeout: float) -> None:
        self.grid, self.node_of, self.defenses, self.timeout = grid, node_of, defenses, timeout

    def check(self, tasks: Sequence[ClientTask], defenses: DefenseFactory) -> None:
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

    def train_clients(
        self, global_model: nn.Module, tasks: Sequence[ClientTask], defenses: DefenseFactory
    ) -> list[ClientResult]:
        self.check(tasks, defenses)
        spec, weights = describe(global_model), ArrayRecord(torch_state_dict=global_model.state_dict())
        messages = [task_message(t, spec, weights, self.node_of[t.client_id]) for t in tasks]
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


class SecureGridEngine(GridEngine):
    """The Flower engine with SecAgg+ (module docstring): :meth:`aggregate_clients` runs the protocol."""

    def __init__(
        self,
        grid: Grid,
        node_of: dict[int, int],
        defenses: DefenseFactory,
        timeout: float,
        context: Context,
        secagg: SecAggPlusConfig,
    ) -> None:
        super().__init__(grid, node_of, defenses, timeout)
        self.context, self.secagg = context, secagg
        self.rounds = 0  # the protocol runs so far: each run's messages carry its number as group id

    def workflow(self, max_weight: float) -> SecAggPlusWorkflow:
        c = self.secagg
        return SecAggPlusWorkflow(
            num_shares=c.share_fraction, reconstruction_threshold=c.threshold_fraction, max_weight=max_weight,
            clipping_range=c.clipping_range, quantization_range=c.quantization_range,
            modulus_range=MODULUS_RANGE, timeout=self.timeout,
        )  # fmt: skip

    def aggregate_clients(
        self,
        models: Sequence[nn.Module],
        tasks: Sequence[ClientTask],
        defenses: DefenseFactory,
        *,
        weighted: bool,
    ) -> SecureRound:
        self.check(tasks, defenses)
        if len(models) != len(tasks):
            raise ValueError(f"{len(models)} models for {len(tasks)} tasks")
        self.secagg.check_round_size(len(tasks), "this round")
        sent: dict[int, tuple[str, Parameters]] = {}  # one serialisation per distinct model
        fitins: list[tuple[ClientProxy, FitIns]] = []
        for model, task in zip(models, tasks, strict=True):
            if id(model) not in sent:
                arrays = [t.detach().cpu().numpy() for t in model.state_dict().values()]
                sent[id(model)] = (describe(model), ndarrays_to_parameters(arrays))
            spec, parameters = sent[id(model)]
            config = {**task_config(task), "spec": spec, "weighted": weighted,
                      "clipping-range": self.secagg.clipping_range}  # fmt: skip
            fitins.append((_Node(self.node_of[task.client_id]), FitIns(parameters, config)))
        strategy = _SecureTasks(fitins)
        self.rounds += 1
        current = ConfigRecord({WorkflowKey.CURRENT_ROUND: self.rounds})
        state = RecordDict({MAIN_PARAMS_RECORD: ArrayRecord(), MAIN_CONFIGS_RECORD: current})
        base = self.context
        context = LegacyContext(
            Context(run_id=base.run_id, node_id=base.node_id, node_config=base.node_config, state=state,
                    run_config=base.run_config),
            config=ServerConfig(num_rounds=1), strategy=strategy,
        )  # fmt: skip
        # the largest weight a client will report: its ratio to max_weight is quantised, so the closer the
        # better (FedSGD clients report their batch size, FedAvg ones their data)
        max_weight = max(reported_samples(t.training, len(t.data)) for t in tasks) if weighted else 1.0
        self.workflow(max_weight)(self.grid, context)
        return self.secure_round(models[0], tasks, strategy, weighted)

    def secure_round(
        self, model: nn.Module, tasks: Sequence[ClientTask], strategy: _SecureTasks, weighted: bool
    ) -> SecureRound:
        """The unmasked aggregate as named tensors, and per task who contributed and on which samples."""
        if not strategy.aggregated:  # the workflow stopped before unmasking: nobody is in an aggregate
            error = (
                f"SecAgg+ run {self.rounds} halted before unmasking (fewer clients than its threshold "
                "answered a stage): no aggregate this round"
            )
            log.error(error)
            return SecureRound(None, [ClientResult(t.client_id, None, None, error=error) for t in tasks], [])
        by_node = {int(proxy.node_id): res for proxy, res in strategy.results}
        unique = dict.fromkeys(str(f)[-300:] for f in strategy.failures)  # Flower lists a dropout twice
        reasons = "; ".join(unique) or "no reply in time"
        results, contributors, samples = [], [], 0
        for task in tasks:
            res = by_node.get(self.node_of[task.client_id])
            if res is None:
                error = f"no masked update reached the SecAgg+ aggregate (the round's failures: {reasons})"
                results.append(ClientResult(task.client_id, None, None, error=error))
                continue
            index = json.loads(str(res.metrics["sample-index"])) if "sample-index" in res.metrics else None
            truth = task.data if index is None else task.data.subset(np.asarray(index))
            sample_index = None if index is None else tuple(int(i) for i in index)
            results.append(ClientResult(task.client_id, None, truth, sample_index=sample_index))
            contributors.append(task.client_id)
            samples += int(res.metrics["samples"])
        if not strategy.results:
            log.error("SecAgg+ round %d: no aggregate (%s)", self.rounds, reasons)
            return SecureRound(None, results, [])
        # every FitRes holds the aggregate; its arrays are the model's parameters, in order
        mean = named_arrays(reference_of(model), strategy.results[0][1].parameters, "the SecAgg+ aggregate")
        scale = 1.0 if weighted else float(len(contributors))  # unweighted: the mean, times k = the sum
        tensors = {name: t * scale for name, t in mean.items()}
        kind = update_kind(tasks[0].training)
        aggregate = Update(tensors, samples, kind,
                           {"num_clients": len(contributors), "secure_aggregation": "secagg+"})  # fmt: skip
        return SecureRound(aggregate, results, contributors)


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
        clients: Sequence[Dataset],
        defenses: DefenseFactory,
        work: Callable[[Engine], T],
        *,
        progress: bool = False,
        data_root: str | os.PathLike[str] | None = None,
    ) -> T:
        from flwr.simulation import run_simulation

        outcome: dict[str, Any] = {}
        server = ServerApp()

        @server.main()
        def main(grid: Grid, context: Context) -> None:
            try:
                node_of = discover(grid, len(clients), self.config.startup_timeout)
                c = self.config
                engine = (
                    SecureGridEngine(grid, node_of, defenses, c.timeout, context, c.secagg)
                    if c.secagg.enabled
                    else GridEngine(grid, node_of, defenses, c.timeout)
                )
                outcome["value"] = work(engine)
            except BaseException as exc:  # re-raised in the caller's thread, after Flower has shut down
                outcome["error"] = exc

        log.info("Flower simulation: %d virtual SuperNodes on Ray (%s)", len(clients), self.backend_config())
        run_simulation(
            server_app=server, num_supernodes=len(clients),
            client_app=task_client_app(clients, defenses, secagg=self.config.secagg.enabled,
            data_root=data_root),
            backend_config=self.backend_config(),
        )  # fmt: skip
        if "error" in outcome:
            raise outcome["error"]
        if "value" not in outcome:
            raise RuntimeError("the Flower simulation ended before gradleak's rounds finished")
        return outcome["value"]
