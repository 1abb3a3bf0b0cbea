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
from collections.abc import Sequence

import torch
from torch import nn

from gradleak.defenses.base import Defense, DefenseChain, DefenseFailure
from gradleak.text.data import TextBatch
from gradleak.types import Update

_DEFAULT_SEED = 0


def text_loss(model: nn.Module, batch: TextBatch, task: str) -> torch.Tensor:
    """Mean cross-entropy of ``model`` on ``batch`` for ``task`` (causal_lm or classification)."""
    if task == "causal_lm":
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    elif task == "classification":
        if batch.labels is None:
            raise ValueError("classification needs batch.labels")
        labels = batch.labels
    else:
        raise ValueError(f"task must be 'causal_lm' or 'classification', got {task!r}")
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels)
    loss: torch.Tensor = out.loss
    return loss


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
    chain = DefenseChain(defenses)
    work = copy.deepcopy(model) if defenses else model
    was_training = work.training
    if defenses:
        chain.setup(work, generator=_generator(generator))
    work.train(dropout)
    work.zero_grad(set_to_none=True)
    text_loss(work, batch, task).backward()
    if defenses:
        chain.on_gradients(work, 0)
        if all(p.grad is None for p in work.parameters()):
            raise DefenseFailure("every gradient was cleared by a defense (step skipped); nothing is sent")
    grads = _grads(work)
    work.zero_grad(set_to_none=True)
    work.train(was_training)
    update = Update(grads, len(batch), kind="gradient", metadata={"client_id": client_id})
    return chain.on_update(update) if defenses else update


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
    """``epochs`` passes over ``batches`` with SGD or AdamW on a copy; returns delta = w_T - w_0.

    The optimiser is built after the defenses' ``setup`` and holds only parameters that still require a
    gradient; it steps on the gradients as ``on_gradients`` left them.
    """
    if optimizer not in ("sgd", "adamw"):
        raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {optimizer!r}")
    if not batches or epochs < 1 or lr <= 0:
        raise ValueError("need at least one batch, epochs >= 1 and lr > 0")
    chain = DefenseChain(defenses)
    work = copy.deepcopy(model)
    chain.setup(work, generator=_generator(generator))
    work.train(dropout)
    params = [p for p in work.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(params, lr=lr) if optimizer == "sgd" else torch.optim.AdamW(params, lr=lr)
    )
    step = 0
    for _ in range(epochs):
        for batch in batches:
            opt.zero_grad(set_to_none=True)
            text_loss(work, batch, task).backward()
            chain.on_gradients(work, step)
            opt.step()
            step += 1
        chain.on_epoch_end(work, opt)
    w0 = dict(model.named_parameters())
    delta = {n: (p.detach() - w0[n].detach()).clone() for n, p in work.named_parameters()}
    n = sum(len(b) for b in batches)
    meta = {"client_id": client_id, "steps": step}
    return chain.on_update(Update(delta, n, kind="delta", metadata=meta))
