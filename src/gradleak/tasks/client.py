"""Client-side local training: FedSGD (one gradient) or FedAvg (E epochs of SGD/Adam/AdamW), with defense
hooks, for any :class:`~gradleak.tasks.Task` (image classification, text classification, causal LM).

FedSGD (McMahan et al. 2017): the client sends g = dL/dw at the broadcast weights w_0 on one batch.
FedAvg: the client runs E epochs over its data in batches of B and sends delta = w_T - w_0. L is the
task's loss; the model trains in the task's mode (``Task.mode``), recorded in the update's metadata.
The returned :class:`ClientResult` keeps the data the update was computed on (``truth``) apart from the
update itself; only the engine's evaluation code reads it, never an attack.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from gradleak.defenses.base import Defense, DefenseFailure
from gradleak.defenses.in_loop import DefendedLoop
from gradleak.device import CPU
from gradleak.registry import LOSSES, OPTIMIZERS, SAMPLERS
from gradleak.tasks import IMAGE_CLASSIFICATION, Dataset, Task
from gradleak.types import MODE, LocalTraining, Update
from gradleak.update import DEFAULT_LOSS


@dataclass
class ClientResult:
    """One client's outcome: the update that left it (None if a defense failed closed) and its truth."""

    client_id: int
    update: Update | None
    truth: Dataset | None = None  # FedSGD: the batch; FedAvg: the client's data (metrics only)
    error: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    # which samples of the client's training data the update was computed on (None: all of them); an
    # engine that runs the client elsewhere sends these indices back so the simulation can score the attacks
    sample_index: tuple[int, ...] | None = None


OPTIMIZERS.register("sgd", torch.optim.SGD, summary="SGD (FedAvg's local step; LocalTraining.momentum)")
OPTIMIZERS.register("adam", torch.optim.Adam, summary="Adam (weight decay as an L2 term)")
OPTIMIZERS.register("adamw", torch.optim.AdamW, summary="AdamW (decoupled weight decay)")


def make_optimizer(params: Sequence[nn.Parameter], training: LocalTraining) -> torch.optim.Optimizer:
    """The recipe's optimizer over ``params`` (its ``lr``, ``weight_decay`` and, where set, ``momentum``)."""
    extra = {"momentum": training.momentum} if training.momentum else {}
    return OPTIMIZERS.get(training.optimizer)(
        params, lr=training.lr, weight_decay=training.weight_decay, **extra
    )


def _batches(data: Dataset, training: LocalTraining, generator: torch.Generator) -> list[torch.Tensor]:
    """One epoch's batches of ``data`` under the recipe's batching (:mod:`gradleak.tasks.batching`)."""
    cut = SAMPLERS.create(training.batching)
    return cut(len(data), data.labels, training.batch_size, shuffle=training.shuffle, generator=generator)


def _loss(task: Task, model: nn.Module, batch: Dataset, training: LocalTraining) -> torch.Tensor:
    """The task's loss on ``batch``; a recipe's other criterion (``training.loss``) is passed to the task
    (the image task takes one: :func:`check_criterion`)."""
    if training.loss == DEFAULT_LOSS:
        return task.loss(model, batch)
    return task.loss(model, batch, criterion=training.loss)  # type: ignore[call-arg]


def check_criterion(task: Task, training: LocalTraining) -> None:
    """A recipe with another loss than cross-entropy needs a task whose ``loss`` takes ``criterion=``
    (the image task does; the text tasks and a plugin's may not): refused before any training."""
    if training.loss != DEFAULT_LOSS and "criterion" not in inspect.signature(task.loss).parameters:
        raise ValueError(
            f"loss = {training.loss!r} needs a task that takes a criterion; {task.name!r} trains with its "
            "own loss only"
        )


def reported_samples(training: LocalTraining, available: int) -> int:
    """The sample count an update of ``training`` on ``available`` samples reports (its FedAvg weight):
    FedSGD's one batch, FedAvg's whole data."""
    return min(training.batch_size, available) if training.protocol == "fedsgd" else available


def fedsgd_update(
    model: nn.Module,
    data: Dataset,
    loop: DefendedLoop,
    generator: torch.Generator,
    training: LocalTraining,
    task: Task = IMAGE_CLASSIFICATION,
) -> tuple[Update, torch.Tensor]:
    """Gradient of the task's mean loss on one batch drawn from ``data`` (the first batch of a shuffled
    epoch under the recipe's batching); returns it with the batch's (sorted) indices into ``data``."""
    shuffled = dataclasses.replace(training, shuffle=True)
    idx = _batches(data, shuffled, generator)[0].sort().values
    batch = data.subset(idx)
    model.zero_grad(set_to_none=True)
    loss = _loss(task, model, batch, training)
    loss.backward()
    return loop.gradient(len(batch)), idx


def fedavg_update(
    model: nn.Module,
    data: Dataset,
    training: LocalTraining,
    loop: DefendedLoop,
    generator: torch.Generator,
    task: Task = IMAGE_CLASSIFICATION,
) -> Update:
    """E epochs of mini-batch training in the defended loop; returns delta = w_T - w_0."""
    opt = loop.optimizer
    assert opt is not None
    for _ in range(training.epochs):
        for idx in _batches(data, training, generator):
            opt.zero_grad(set_to_none=True)
            loss = _loss(task, model, data.subset(idx), training)
            loss.backward()
            opt.step()  # the defenses' on_gradients run first (DefendedLoop's step pre-hook)
        loop.end_epoch()
    return loop.update(len(data))


def train_client(
    client_id: int,
    global_model: nn.Module,
    data: Dataset,
    training: LocalTraining,
    defenses: Sequence[Defense],
    generator: torch.Generator,
    *,
    private: Dataset | None = None,
    task: Task = IMAGE_CLASSIFICATION,
    data_root: str | os.PathLike[str] | None = None,
) -> ClientResult:
    """Run one client's local training of ``task`` on a private copy of the broadcast model, in the task's
    mode, through :class:`~gradleak.defenses.in_loop.DefendedLoop` (the same hooks a user's own loop gets).

    Defenses whose ``setup`` takes ``data`` receive the client's private data: ``private`` when given (the
    client's whole share when the training data is a subset of it, e.g. an audit's ``max_samples``), else
    ``data``. It stays on the client; only the update leaves. ``data_root``: where this party's data files
    are, for a defense that reads a public split (:class:`~gradleak.defenses.base.SetupContext`).

    Fail closed: if a defense raises, or the outgoing update is invalid (non-finite after a diverged step),
    the result carries ``update=None`` and the error text.
    """
    check_criterion(task, training)
    model = copy.deepcopy(global_model)
    model.train(task.mode == "train")
    fedavg = training.protocol == "fedavg"
    try:
        loop = DefendedLoop(
            model,
            (lambda params: make_optimizer(list(params), training)) if fedavg else None,
            defenses,
            generator=generator,
            data=data if private is None else private,
            train_data=data,
            data_root=data_root,
            source=f"client {client_id}",
            criterion=None if training.loss == DEFAULT_LOSS else LOSSES.create(training.loss),
        )
        index: tuple[int, ...] | None = None
        if fedavg:
            update, truth = fedavg_update(model, data, training, loop, generator, task), data
        else:
            update, idx = fedsgd_update(model, data, loop, generator, training, task)
            truth, index = data.subset(idx), tuple(int(i) for i in idx)
    except DefenseFailure as exc:
        return ClientResult(client_id, None, None, error=str(exc))
    meta = {**update.metadata, "client_id": client_id, MODE: task.mode}  # the mode it trained in
    update = dataclasses.replace(update.to(CPU), metadata=meta)  # updates rest on the CPU (gradleak.device)
    return ClientResult(client_id, update, truth, sample_index=index)
