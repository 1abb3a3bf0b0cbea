"""Recovering each sequence's last token from the LM-head gradient (causal-LM loss).

Under the next-token loss the last token x_L of a sequence is only a label: it reaches no layer-1 gradient,
so DAGER's span checks stop one token short. The LM-head gradient still holds it. With N label positions,
logits W h_t and labels y_t,

    dL/dW = (1/N) sum_t (softmax(W h_t) - e_{y_t}) h_t^T.

Once the prefixes are known, the attacker computes every term except the unknown labels of the last
prefix positions; the remainder R = -(1/N) sum_b e_{y_b} h_b^T has row y_b along -h_b. Each sequence is
completed with argmax_v cos(-R_v, h_b) (tied heads add the input-embedding gradient on the prefix tokens'
rows; those rows are noisy but the true row still aligns with -h_b when its token is not also an input).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradleak.attacks.text.family import capture_input, embedding_param, family_of, update_tensor
from gradleak.types import AttackInputError, Observation


def output_embedding(model: nn.Module) -> nn.Module | None:
    """The model's LM head (``get_output_embeddings()``), or None for heads without one."""
    getter: Any = getattr(model, "get_output_embeddings", None)
    head = getter() if getter is not None else None
    return head if isinstance(head, nn.Module) else None


def lm_head_param(model: nn.Module) -> str:
    """The update key of the LM-head weight (the input embedding's when the head is tied)."""
    head = output_embedding(model)
    if head is None:
        raise AttackInputError("the model has no LM head (not a causal-LM task)")
    if head.weight is getattr(model, "get_input_embeddings")().weight:  # noqa: B009
        return embedding_param(model)
    for name, p in model.named_parameters():
        if p is head.weight:
            return name
    raise AttackInputError("the LM-head weight is not a named parameter of the model")


@torch.no_grad()
def complete_last_tokens(obs: Observation, model: nn.Module, prefixes: list[list[int]]) -> list[list[int]]:
    """Each prefix plus its most likely last token (see the module docstring)."""
    if not prefixes or not family_of(model).causal:
        return prefixes
    grad = update_tensor(obs, lm_head_param(model))
    head = output_embedding(model)
    assert head is not None
    weight = head.weight
    assert isinstance(weight, torch.Tensor)
    n_labels = sum(len(s) for s in prefixes)
    known = torch.zeros_like(grad)
    lasts = []
    for s in prefixes:
        ids = torch.tensor([s])
        h = capture_input(model, head, input_ids=ids, use_cache=False)[0].to(torch.float64)  # (len(s), d)
        p = torch.softmax(h @ weight.detach().to(torch.float64).T, dim=-1)
        known += p.T @ h
        targets = torch.tensor(s[1:], dtype=torch.long)
        known.index_add_(0, targets, -h[: len(s) - 1])
        lasts.append(h[-1])
    rest = grad - known / n_labels
    norms = rest.norm(dim=1)
    live = norms > 1e-6 * norms.max().clamp_min(1e-300)
    out = []
    for s, h in zip(prefixes, lasts, strict=True):
        cos = (-rest @ h) / (norms * h.norm()).clamp_min(1e-300)
        cos[~live] = -2.0
        out.append([*s, int(cos.argmax())])
    return out
