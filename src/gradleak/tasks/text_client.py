"""The FL client for federated transformer fine-tuning (paper 002, Section III-A).

FedSGD: one gradient g = dL/dw at the broadcast weights on one batch of B sequences (the single-client,
single-step setting of paper 002 and DAGER). FedAvg: ``steps`` optimiser steps over the client's batches,
sending delta = w_T - w_0. The loss is the mean next-token cross-entropy over real tokens
(``causal_lm``; padded positions carry label -100) or the sequence-classification cross-entropy
(``classification``). Gradients are taken in eval mode (no dropout) unless ``dropout=True``.

Defenses (:mod:`gradleak.defenses`) run through the same hooks as the image client: ``setup`` on the client's
copy of the model before the optimiser is built (AEGIS freezes attention there), ``on_gradients`` after every
backward and before the optimiser step (the step uses the defended gradient, and FedSGD exports exactly that
gradient), ``on_epoch_end`` after each epoch, ``on_update`` on the outgoing payload. Fail closed: any hook
failure raises :class:`~gradleak.defenses.base.DefenseFailure` and nothing is returned; a FedSGD step that a
defense skipped (every gradient cleared, e.g. a non-finite gradient under AEGIS) fails closed the same way.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from gradleak.data.text import TextBatch
from gradleak.defenses.base import Defense
from gradleak.defenses.in_loop import DefendedLoop
from gradleak.registry import OPTIMIZERS
from gradleak.tasks import text_loss
from gradleak.types import MODE, Update

_DEFAULT_SEED = 0


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def _generator(generator: torch.Generator | None) -> torch.Generator:
    return generator if generator is not None else torch.Generator().manual_seed(_DEFAULT_SEED)


def fedsgd_text_update(
    model: nn.Module,
    batch: TextBatch,
    task: str,
    *,
    dropout: bool = False,
    client_id: int = 0,
    defenses: Sequence[Defense] = (),
    generator: torch.Generator | None = None,
) -> Update:
    """One gradient of the batch's mean loss at the model's current weights (the model is not changed).

    With ``defenses`` the gradient is taken on a private copy of the model, after ``setup``, and passed
    through ``on_gradients`` and ``on_update``; frozen parameters export a zero gradient.
    """
    work = copy.deepcopy(model) if defenses else model
    was_training = work.training
    loop = DefendedLoop(work, None, defenses, generator=_generator(generator), source=f"client {client_id}")
    work.train(dropout)
    work.zero_grad(set_to_none=True)
    try:
        text_loss(work, batch, task).backward()
        return loop.gradient(len(batch), {"client_id": client_id, MODE: "train" if dropout else "eval"})
    finally:  # the model is left as it was, whatever happened
        work.zero_grad(set_to_none=True)
        work.train(was_training)


class LocalTrainer:
    """The client's local fine-tuning loop, one step at a time, on ``model`` itself (pass a copy to keep it).

    ``setup`` of every defense runs first (AEGIS freezes attention there), then the optimiser (SGD, Adam,
    AdamW, ``weight_decay``) is built over the parameters that still require a gradient. Each :meth:`step` is
    forward, backward, ``on_gradients`` (the defended gradient), optimiser step, so the optimiser always steps
    on exactly what the defenses left (paper 002, Algorithm 1). The learning rate follows a linear warm-up
    over ``warmup_steps`` and, when ``total_steps`` is given, a linear decay to 0 at ``total_steps`` (the
    usual transformers schedule, paper 002 Sec. VI-A); without either it is constant.
    """

    def __init__(
        self,
        model: nn.Module,
        task: str,
        *,
        lr: float = 5e-5,
        optimizer: str = "sgd",
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        total_steps: int | None = None,
        dropout: bool = False,
        defenses: Sequence[Defense] = (),
        generator: torch.Generator | None = None,
        source: str = "client",
    ) -> None:
        if optimizer not in OPTIMIZERS:  # the optimisers LocalTraining allows (sgd, adam, adamw, a plugin's)
            raise ValueError(f"optimizer must be one of {OPTIMIZERS.names()}, got {optimizer!r}")
        if lr <= 0 or weight_decay < 0 or warmup_steps < 0:
            raise ValueError(f"need lr > 0, weight_decay >= 0, warmup_steps >= 0; got {lr}, {weight_decay}, "
                             f"{warmup_steps}")  # fmt: skip
        if total_steps is not None and total_steps <= warmup_steps:
            raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps})")
        self.model, self.task, self.dropout = model, task, dropout

        def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
            return OPTIMIZERS.get(optimizer)(params, lr=lr, weight_decay=weight_decay)

        # setup, then the optimiser over what stays trainable; on_gradients before every step
        self.loop = DefendedLoop(model, build, defenses, generator=_generator(generator), source=source)
        assert self.loop.optimizer is not None
        self.optimizer: torch.optim.Optimizer = self.loop.optimizer
        self.base_lr, self.warmup_steps, self.total_steps = lr, warmup_steps, total_steps
        self.steps_done = 0

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return self.base_lr
        left = max(self.total_steps - step, 0)
        return self.base_lr * left / (self.total_steps - self.warmup_steps)

    def step(self, batch: TextBatch) -> float:
        """One defended optimiser step on ``batch``; returns the batch loss before the step."""
        self.model.train(self.dropout)
        batch = batch.to(next(self.model.parameters()).device)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.steps_done)
        self.optimizer.zero_grad(set_to_none=True)
        loss = text_loss(self.model, batch, self.task)
        loss.backward()
        self.optimizer.step()  # the defenses' on_gradients run first (the loop's step pre-hook)
        self.steps_done += 1
        return float(loss.detach())

    def end_epoch(self) -> None:
        self.loop.end_epoch()


def fedavg_text_update(
    model: nn.Module,
    batches: Sequence[TextBatch],
    task: str,
    *,
    lr: float = 5e-5,
    epochs: int = 1,
    optimizer: str = "sgd",
    dropout: bool = False,
    client_id: int = 0,
    defenses: Sequence[Defense] = (),
    generator: torch.Generator | None = None,
) -> Update:
    """``epochs`` passes over ``batches`` with SGD, Adam or AdamW (:class:`LocalTrainer`, constant ``lr``) on
    a copy; returns delta = w_T - w_0 through the defenses' ``on_update``.
    """
    if not batches or epochs < 1:
        raise ValueError("need at least one batch and epochs >= 1")
    work = copy.deepcopy(model)
    trainer = LocalTrainer(
        work, task, lr=lr, optimizer=optimizer, dropout=dropout, defenses=defenses, generator=generator,
        source=f"client {client_id}",
    )  # fmt: skip
    for _ in range(epochs):
        for batch in batches:
            trainer.step(batch)
        trainer.end_epoch()
    n = sum(len(b) for b in batches)
    # through on_update and the validation; raises DefenseFailure (send nothing) where the image client's
    # train_client returns update=None with the reason
    meta = {"client_id": client_id, "steps": trainer.steps_done, MODE: "train" if dropout else "eval"}
    return trainer.loop.update(n, meta)
