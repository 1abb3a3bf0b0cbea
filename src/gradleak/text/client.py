"""The FL client for federated transformer fine-tuning (paper 002, Section III-A).

FedSGD: one gradient g = dL/dw at the broadcast weights on one batch of B sequences (the single-client,
single-step setting of paper 002 and DAGER). FedAvg: ``steps`` optimiser steps over the client's batches,
sending delta = w_T - w_0. The loss is the mean next-token cross-entropy over real tokens
(``causal_lm``; padded positions carry label -100) or the sequence-classification cross-entropy
(``classification``). Gradients are taken in eval mode (no dropout) unless ``dropout=True``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from gradleak.text.data import TextBatch
from gradleak.types import Update


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


def fedsgd_text_update(
    model: nn.Module, batch: TextBatch, task: str, *, dropout: bool = False, client_id: int = 0
) -> Update:
    """One gradient of the batch's mean loss at the model's current weights (the model is not changed)."""
    was_training = model.training
    model.train(dropout)
    model.zero_grad(set_to_none=True)
    text_loss(model, batch, task).backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return Update(grads, len(batch), kind="gradient", metadata={"client_id": client_id})


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
) -> Update:
    """``epochs`` passes over ``batches`` with SGD or AdamW on a copy; returns delta = w_T - w_0."""
    if optimizer not in ("sgd", "adamw"):
        raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {optimizer!r}")
    if not batches or epochs < 1 or lr <= 0:
        raise ValueError("need at least one batch, epochs >= 1 and lr > 0")
    work = copy.deepcopy(model)
    work.train(dropout)
    params = [p for p in work.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(params, lr=lr) if optimizer == "sgd" else torch.optim.AdamW(params, lr=lr)
    )
    for _ in range(epochs):
        for batch in batches:
            opt.zero_grad(set_to_none=True)
            text_loss(work, batch, task).backward()
            opt.step()
    w0 = dict(model.named_parameters())
    delta = {n: (p.detach() - w0[n].detach()).clone() for n, p in work.named_parameters()}
    n = sum(len(b) for b in batches)
    meta = {"client_id": client_id, "steps": epochs * len(batches)}
    return Update(delta, n, kind="delta", metadata=meta)
