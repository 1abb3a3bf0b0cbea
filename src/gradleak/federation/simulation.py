"""The FL simulation: server loop (sample, broadcast, aggregate, evaluate) over a pluggable client engine.

The :class:`Engine` decides *where* client training runs (in this process, or on Flower's simulation engine
with Ray: :mod:`gradleak.federation.engines`). The server logic, the defenses and the attacks do not change
with the engine.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from gradleak.defenses.base import Defense
from gradleak.federation.server import (
    ServerOptimizer,
    apply_buffers,
    apply_update,
    sample_clients,
    screen,
    secure_sum,
    update_kind,
    weighted_mean,
)
from gradleak.registry import SERVER_OPTIMIZERS
from gradleak.tasks import IMAGE_CLASSIFICATION, Dataset, Task
from gradleak.tasks.client import ClientResult, train_client
from gradleak.types import LocalTraining, Observation, Update

log = logging.getLogger(__name__)

DefenseFactory = Callable[[], Sequence[Defense]]
PICKS = ("first", "random")  # which of a client's samples an audit's max_samples keeps
VIEW_SALT = 0x71E3  # derives a client task's seed for a repeated broadcast of an audited round (``view``)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed derived from integers (run seed, round, client) through numpy's SeedSequence."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0] >> 1)


@dataclass(frozen=True)
class ClientTask:
    """One unit of client work an engine executes: ``task`` trained on ``data`` with ``training``.
    ``private`` is the client's whole share when ``data`` is a subset of it (an audit's ``max_samples``);
    data-aware defenses (Aegis) build from it."""

    client_id: int
    data: Dataset
    training: LocalTraining
    seed: int
    private: Dataset | None = None
    task: Task = IMAGE_CLASSIFICATION


class Engine(Protocol):
    """Runs a round's client tasks against the broadcast model and returns their results in task order."""

    name: str

    def train_clients(
        self, global_model: nn.Module, tasks: Sequence[ClientTask], defenses: DefenseFactory
    ) -> list[ClientResult]: ...


@dataclass
class SecureRound:
    """What a server learns from a round under secure aggregation: one aggregate, and who is in it.

    ``aggregate``: the sample-weighted mean ``sum_k n_k u_k / sum_k n_k`` (``weighted``, what FedAvg
    applies) or the sum ``sum_k u_k`` (what an audit attacks, as
    :func:`gradleak.federation.server.secure_sum`) of
    the ``contributors``' updates; None when none arrived. ``results``: one per task, in task order, for the
    simulation's records and scoring only (each client's error, and for contributors the data their update
    used); an engine that runs the real protocol returns no update in them.
    """

    aggregate: Update | None
    results: list[ClientResult]
    contributors: list[int]


@runtime_checkable
class SecureAggregator(Protocol):
    """An engine that runs a secure-aggregation protocol itself (Flower's SecAgg+): it returns only the
    aggregate. Task ``k`` trains on ``models[k]`` (a malicious server's per-client variants)."""

    def aggregate_clients(
        self,
        models: Sequence[nn.Module],
        tasks: Sequence[ClientTask],
        defenses: DefenseFactory,
        *,
        weighted: bool,
    ) -> SecureRound: ...


class InProcessEngine:
    """Sequential client training in this process (deterministic, no extra dependencies).

    A client whose training raises is one failed client, as a ClientApp that raises is on Flower: its
    result carries no update and the error, the round goes on with the others (logged with the traceback).
    """

    name = "inprocess"

    def __init__(self, progress: bool = False, data_root: str | os.PathLike[str] | None = None) -> None:
        self.progress = progress
        self.data_root = data_root  # the clients' data root (SetupContext.data_root of their defenses)

    def train_clients(
        self, global_model: nn.Module, tasks: Sequence[ClientTask], defenses: DefenseFactory
    ) -> list[ClientResult]:
        results = []
        for task in tqdm(tasks, desc="clients", leave=False, disable=not self.progress):
            gen = torch.Generator().manual_seed(task.seed)
            try:
                result = train_client(
                    task.client_id, global_model, task.data, task.training, defenses(), gen,
                    private=task.private, task=task.task, data_root=self.data_root,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - one client's crash is that client's failure
                log.exception("client %d raised during local training", task.client_id)
                result = ClientResult(task.client_id, None, None, error=f"{type(exc).__name__}: {exc}")
            results.append(result)
        return results


@dataclass(frozen=True)
class FLConfig:
    """Federated training schedule. ``fraction`` of clients is sampled each round; the server applies the
    aggregate with ``server_optimizer``: ``"sgd"`` (``w += server_lr * delta``, FedAvg's own step) or an
    adaptive FedOpt optimiser (``"adam"``, ``"adamw"``, :class:`~gradleak.federation.server.ServerOptimizer`)
    at ``server_lr`` with ``server_weight_decay``."""

    rounds: int = 3
    fraction: float = 0.1
    training: LocalTraining = field(default_factory=LocalTraining)
    server_lr: float = 1.0
    server_optimizer: str = "sgd"
    server_weight_decay: float = 0.0
    secure_aggregation: bool = False
    eval_every: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.rounds, int) or self.rounds < 0:
            raise ValueError(f"rounds must be an int >= 0, got {self.rounds!r}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction!r}")
        if not 0 < self.server_lr < math.inf:
            raise ValueError(f"server_lr must be a positive finite number, got {self.server_lr!r}")
        if not isinstance(self.eval_every, int) or self.eval_every < 1:
            raise ValueError(f"eval_every must be an int >= 1, got {self.eval_every!r}")
        if self.server_optimizer != "sgd" and self.server_optimizer not in SERVER_OPTIMIZERS:
            known = ["sgd", *SERVER_OPTIMIZERS.names()]
            raise ValueError(f"server_optimizer must be one of {known}, got {self.server_optimizer!r}")
        if not 0 <= self.server_weight_decay < math.inf:
            raise ValueError(
                f"server_weight_decay must be a finite number >= 0, got {self.server_weight_decay!r}"
            )


@dataclass
class RoundResult:
    """One round: who trained, what the server received, the aggregate it applied, test accuracy.

    ``dropped`` lists the clients whose update did not reach the aggregate: a defense failed closed, the
    client withheld an invalid update, or the server rejected it; ``errors`` gives each one's reason.
    ``metrics``: the task's other test metrics (a causal LM's ``perplexity``), empty when not evaluated.
    """

    round: int
    client_ids: list[int]
    results: list[ClientResult]
    aggregate: Update | None
    accuracy: float | None
    seconds: float
    dropped: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class FederatedSimulation:
    """Server loop over ``clients`` (one dataset per client) with a global ``model`` updated in place;
    every client trains ``task`` (image classification by default)."""

    def __init__(
        self,
        model: nn.Module,
        clients: Sequence[Dataset],
        config: FLConfig,
        *,
        seed: int,
        test: Dataset | None = None,
        engine: Engine | None = None,
        defenses: DefenseFactory = tuple,
        task: Task = IMAGE_CLASSIFICATION,
    ) -> None:
        if not clients:
            raise ValueError("a federation needs at least one client")
        self.model = model
        self.clients = list(clients)
        self.config = config
        self.seed = seed
        self.test = test
        self.engine: Engine = engine or InProcessEngine()
        self.defenses = defenses
        self.task = task
        self._rng = np.random.default_rng(derive_seed(seed, 0xC11E))
        self.history: list[RoundResult] = []
        self.server_optimizer = (
            None
            if config.server_optimizer == "sgd"
            else ServerOptimizer(config.server_optimizer, model, config.server_lr, config.server_weight_decay)
        )

    def tasks(self, round_idx: int, client_ids: Sequence[int], training: LocalTraining) -> list[ClientTask]:
        return [
            ClientTask(
                cid, self.clients[cid], training, derive_seed(self.seed, round_idx, cid), task=self.task
            )
            for cid in client_ids
        ]

    def run_round(self, round_idx: int) -> RoundResult:
        start = time.perf_counter()
        ids = sample_clients(len(self.clients), self.config.fraction, self._rng)
        tasks = self.tasks(round_idx, ids, self.config.training)
        if self.config.secure_aggregation:
            secure = self.secure_round([self.model] * len(tasks), tasks, round_idx=round_idx, weighted=True)
            results, aggregate, arrived = secure.results, secure.aggregate, set(secure.contributors)
        else:
            results = self.engine.train_clients(self.model, tasks, self.defenses)
            results = screen(results, self.model, round_idx=round_idx, kind=update_kind(self.config.training))
            received = [r.update for r in results if r.update is not None]
            aggregate = weighted_mean(received) if received else None
            arrived = {r.client_id for r in results if r.update is not None}
        for r in results:
            if r.client_id not in arrived:
                log.warning("round %d: client %d sent nothing (%s)", round_idx, r.client_id, r.error)
        if aggregate is None:
            log.error("round %d: no client's update reached the server; the model is unchanged", round_idx)
        else:
            bad = [n for n, t in aggregate.tensors.items() if not bool(torch.isfinite(t).all())]
            if bad:  # finite updates can still overflow in the sum: the model is left as it was
                log.error("round %d: the aggregate overflowed in %s; not applied", round_idx, bad[:3])
                aggregate = None
            elif self.server_optimizer is not None:
                self.server_optimizer.step(aggregate)
                apply_buffers(self.model, aggregate)  # FedOpt steps the parameters; statistics are averaged
            else:
                apply_update(self.model, aggregate, self.config.server_lr)
        metrics: dict[str, float] = {}
        if self.test is not None and (round_idx + 1) % self.config.eval_every == 0:
            metrics = self.evaluate()
        acc = metrics.pop("accuracy", None)
        errors = {r.client_id: r.error or "no update" for r in results if r.client_id not in arrived}
        rr = RoundResult(
            round_idx, ids, results, aggregate, acc, time.perf_counter() - start, list(errors), errors,
            metrics,
        )  # fmt: skip
        # the history keeps no per-client payloads: ~2.75 MB per client update for paper 000's classifier
        self.history.append(dataclasses.replace(rr, results=[], aggregate=None))
        log.info("round %d: %d clients, accuracy %s, %.2fs", round_idx, len(ids), acc, rr.seconds)
        return rr

    def evaluate(self) -> dict[str, float]:
        """The task's test metrics of the global model (``accuracy`` always; e.g. ``perplexity``)."""
        if self.test is None:
            raise ValueError("this simulation has no test set")
        return self.task.evaluate(self.model, self.test)

    def run(self, rounds: int | None = None, progress: bool = False) -> list[RoundResult]:
        n = self.config.rounds if rounds is None else rounds
        start = len(self.history)
        for r in tqdm(range(start, start + n), desc="FL rounds", disable=not progress):
            self.run_round(r)
        return self.history[start:]  # light records: per-client payloads are not kept

    def collect(
        self,
        client_ids: Sequence[int],
        training: LocalTraining,
        *,
        round_idx: int | None = None,
        broadcast: nn.Module | None = None,
        max_samples: int | None = None,
        pick: str = "first",
        view: int = 0,
    ) -> list[ClientResult]:
        """Have ``client_ids`` train without aggregating: the updates an audit attacks.

        ``broadcast`` replaces the global model for this round (a malicious server's modified model);
        ``max_samples`` keeps ``max_samples`` of each client's samples (e.g. paper 001's k = 50 images per
        client): its first ones, or with ``pick="random"`` a seeded random subset (:meth:`audit_tasks`).
        ``round_idx`` defaults to the next round index, so the clients' randomness is that round's.
        ``view`` > 0: the same round broadcast again (``audit.views``): the same samples, fresh randomness.
        """
        r = len(self.history) if round_idx is None else round_idx
        tasks = self.audit_tasks(r, client_ids, training, max_samples, pick, view)
        model = self.model if broadcast is None else broadcast
        results = self.engine.train_clients(model, tasks, self.defenses)
        return screen(results, model, round_idx=r, kind=update_kind(training))

    def audit_tasks(
        self,
        round_idx: int,
        client_ids: Sequence[int],
        training: LocalTraining,
        max_samples: int | None,
        pick: str = "first",
        view: int = 0,
    ) -> list[ClientTask]:
        """The round's tasks for ``client_ids``, each on ``max_samples`` of its samples if given: the first
        ones (``pick="first"``), or a random subset in index order (``pick="random"``, seeded by the
        simulation's seed, the round and the client, so every attack of an audit sees the same one). The
        first samples of a client of a class-ordered data set (CIFAR-10's loader) are one or two classes.
        ``view`` k > 0 gives each task the same samples and a seed of its own (the round broadcast again:
        fresh shuffling and defense noise)."""
        if pick not in PICKS:
            raise ValueError(f"pick must be one of {PICKS}, got {pick!r}")
        if not isinstance(view, int) or view < 0:
            raise ValueError(f"view must be an int >= 0, got {view!r}")
        tasks = self.tasks(round_idx, client_ids, training)
        if view:
            tasks = [dataclasses.replace(t, seed=derive_seed(t.seed, VIEW_SALT, view)) for t in tasks]
        if max_samples is None:
            return tasks
        keep = [self._keep(t, max_samples, round_idx, pick) for t in tasks]
        pairs = zip(tasks, keep, strict=True)
        return [dataclasses.replace(t, data=t.data.subset(k), private=t.data) for t, k in pairs]

    def _keep(self, task: ClientTask, max_samples: int, round_idx: int, pick: str) -> np.ndarray:
        n = len(task.data)
        if pick == "first" or max_samples >= n:
            return np.arange(min(max_samples, n))
        rng = np.random.default_rng(derive_seed(self.seed, 0x5B5E, round_idx, task.client_id))
        return np.sort(rng.choice(n, size=max_samples, replace=False))

    def collect_secure(
        self,
        client_ids: Sequence[int],
        training: LocalTraining,
        *,
        models: Sequence[nn.Module] | None = None,
        max_samples: int | None = None,
        pick: str = "first",
    ) -> SecureRound:
        """:meth:`collect` under secure aggregation: the sum of the clients' updates is all the server gets
        (client ``client_ids[k]`` trains ``models[k]``, default the global model)."""
        r = len(self.history)
        tasks = self.audit_tasks(r, client_ids, training, max_samples, pick)
        models = [self.model] * len(tasks) if models is None else list(models)
        return self.secure_round(models, tasks, round_idx=r, weighted=False)

    def secure_round(
        self, models: Sequence[nn.Module], tasks: Sequence[ClientTask], *, round_idx: int, weighted: bool
    ) -> SecureRound:
        """``tasks`` (task ``k`` on ``models[k]``) under secure aggregation (:class:`SecureRound`). An engine
        that runs the protocol itself does (its aggregate is checked like any update: an invalid one is
        None); otherwise the clients train here and the server is shown only their sum or weighted mean."""
        if len(models) != len(tasks):
            raise ValueError(f"{len(models)} models for {len(tasks)} tasks")
        kind = update_kind(tasks[0].training) if tasks else "delta"
        if isinstance(self.engine, SecureAggregator):
            secure = self.engine.aggregate_clients(models, tasks, self.defenses, weighted=weighted)
            if secure.aggregate is not None:
                agg = Update(secure.aggregate.tensors, max(secure.aggregate.num_samples, 1),
                             secure.aggregate.kind, secure.aggregate.metadata)  # fmt: skip
                (checked,) = screen([ClientResult(-1, agg, None)], models[0], round_idx=round_idx, kind=kind)
                if checked.update is None:  # fail closed: nobody's update is applied or attacked
                    log.error("round %d: the secure aggregate was rejected: %s", round_idx, checked.error)
                    rejected = [r if r.error else dataclasses.replace(r, truth=None, error=checked.error)
                                for r in secure.results]  # fmt: skip
                    secure = SecureRound(None, rejected, [])
            return secure
        results: list[ClientResult] = []
        for _, group in itertools.groupby(zip(models, tasks, strict=True), key=lambda mt: id(mt[0])):
            pairs = list(group)
            model = pairs[0][0]
            trained = self.engine.train_clients(model, [t for _, t in pairs], self.defenses)
            results += screen(trained, model, round_idx=round_idx, kind=kind)
        received = [r.update for r in results if r.update is not None]
        aggregate = None
        if received:
            aggregate = weighted_mean(received) if weighted else secure_sum(received)
        return SecureRound(aggregate, results, [r.client_id for r in results if r.update is not None])

    def sample(self) -> list[int]:
        return sample_clients(len(self.clients), self.config.fraction, self._rng)

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """What resuming needs after the last finished round: the global model's state (parameters and
        buffers, and an adaptive server optimiser's moments) and the sampler's state with the number of
        rounds run (JSON-able)."""
        tensors = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}  # rest on the CPU
        state: dict[str, object] = {"rounds": len(self.history), "sampler": self._rng.bit_generator.state}
        if self.server_optimizer is not None:
            opt_tensors, state["server_optimizer"] = self.server_optimizer.state_tensors()
            tensors.update(opt_tensors)
        return tensors, state

    def restore(
        self, tensors: Mapping[str, torch.Tensor], state: Mapping[str, object], history: Sequence[RoundResult]
    ) -> None:
        """Continue from :meth:`state`: the model, the sampler and the light round history are set so that
        the next rounds equal those of an uninterrupted run."""
        if state.get("rounds") != len(history):
            raise ValueError(
                f"checkpoint after {state.get('rounds')} rounds, but {len(history)} round records"
            )
        model = {k: v for k, v in tensors.items() if not k.startswith("server_opt/")}
        self.model.load_state_dict(model, strict=True)
        if self.server_optimizer is not None:
            opt = {k: v for k, v in tensors.items() if k.startswith("server_opt/")}
            self.server_optimizer.load(opt, state["server_optimizer"])  # type: ignore[arg-type]
        self._rng.bit_generator.state = state["sampler"]  # type: ignore[assignment]
        self.history = list(history)


def server_view(
    broadcast: nn.Module,
    results: Sequence[ClientResult],
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    secure_aggregation: bool,
    training: LocalTraining | None,
    grant_labels: bool = False,
    secrets: Mapping[str, object] | None = None,
    grant_lengths: bool = False,
) -> list[Observation]:
    """What the server observes: one Observation per received update, or one for the secure sum.

    ``training`` is the recipe the threat model makes public (None hides it). Labels are attached only when
    ``grant_labels``, text samples' lengths (their attention masks' sums) only when ``grant_lengths`` (and
    neither under secure aggregation, where they would be a union across clients).
    ``secrets`` are what a malicious server planted in ``broadcast``.
    """
    secrets = dict(secrets or {})
    received = [r for r in results if r.update is not None]
    if not received:
        return []
    w0 = copy.deepcopy(broadcast).eval()
    if secure_aggregation:
        agg = secure_sum([r.update for r in received])  # type: ignore[misc]
        return [secure_observation(w0, agg, len(received), input_shape=input_shape, num_classes=num_classes,
                                   training=training, secrets=secrets)]  # fmt: skip
    out = []
    for r in received:
        truth_labels = None if r.truth is None else r.truth.labels
        labels = truth_labels.clone() if (grant_labels and truth_labels is not None) else None
        mask = getattr(r.truth, "attention_mask", None) if grant_lengths else None
        lengths = None if mask is None else tuple(int(n) for n in mask.sum(dim=1))
        out.append(Observation(w0, r.update, input_shape, num_classes, training, labels, secrets,  # type: ignore[arg-type]
                               lengths=lengths))  # fmt: skip
    return out


def secure_observation(
    broadcast: nn.Module,
    aggregate: Update,
    num_clients: int,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    training: LocalTraining | None,
    secrets: Mapping[str, object] | None = None,
) -> Observation:
    """What the server observes under secure aggregation: the aggregate of ``num_clients`` clients, no
    labels (they would be a union across clients)."""
    return Observation(broadcast, aggregate, input_shape, num_classes, training, secrets=dict(secrets or {}),
                       aggregated=True, num_clients=num_clients)  # fmt: skip
