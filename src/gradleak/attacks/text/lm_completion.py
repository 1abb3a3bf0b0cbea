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

import logging
from typing import Any

import torch
from torch import nn

from gradleak.attacks.text.family import capture_input, embedding_param, family_of, update_tensor
from gradleak.types import AttackInputError, Observation

log = logging.getLogger(__name__)


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


def complete_last_tokens(
    obs: Observation, model: nn.Module, prefixes: list[list[int]], *, refine: int = 6
) -> list[list[int]]:
    """Each prefix plus its most likely last token (see the module docstring).

    With ``refine`` > 0 the ``refine`` best tokens per sequence are then checked jointly against the whole
    head gradient (:func:`refine_last_tokens`).
    """
    if not prefixes or not family_of(model).causal:
        return prefixes
    cos = _cosine_scores(obs, model, prefixes)
    if refine <= 0:
        return [[*s, int(c.argmax())] for s, c in zip(prefixes, cos, strict=True)]
    cands = [c.topk(min(refine, c.numel())).indices.tolist() for c in cos]
    return [[*s, y] for s, y in zip(prefixes, refine_last_tokens(obs, model, prefixes, cands), strict=True)]


@torch.no_grad()
def _head_terms(model: nn.Module, prefixes: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per prefix: the softmax over the vocabulary at every position (L x V) and the LM head's inputs h
    (L x d), in float64."""
    head = output_embedding(model)
    assert head is not None
    weight = head.weight
    assert isinstance(weight, torch.Tensor)
    w64 = weight.detach().to(torch.float64)
    out = []
    for s in prefixes:
        h = capture_input(model, head, input_ids=torch.tensor([s]), use_cache=False)[0].to(torch.float64)
        out.append((torch.softmax(h @ w64.T, dim=-1), h))
    return out


def _known_terms(
    prefixes: list[list[int]],
    terms: list[tuple[torch.Tensor, torch.Tensor]],
    basis: torch.Tensor | None = None,
) -> torch.Tensor:
    """N times the head gradient of the prefixes without their unknown last labels:
    sum_t p_t h_t^T - sum_{t < L-1} e_{s[t+1]} h_t^T, with h projected on ``basis`` (d x r) when given."""
    known: torch.Tensor | None = None
    for s, (p, h) in zip(prefixes, terms, strict=True):
        hb = h if basis is None else h @ basis
        part = p.T @ hb
        part.index_add_(0, torch.tensor(s[1:], dtype=torch.long), -hb[: len(s) - 1])
        known = part if known is None else known + part
    assert known is not None
    return known


@torch.no_grad()
def _cosine_scores(obs: Observation, model: nn.Module, prefixes: list[list[int]]) -> list[torch.Tensor]:
    grad = update_tensor(obs, lm_head_param(model))
    terms = _head_terms(model, prefixes)
    rest = grad - _known_terms(prefixes, terms) / sum(len(s) for s in prefixes)
    norms = rest.norm(dim=1)
    live = norms > 1e-6 * norms.max().clamp_min(1e-300)
    out = []
    for _, h in terms:
        cos = (-rest @ h[-1]) / (norms * h[-1].norm()).clamp_min(1e-300)
        cos[~live] = -2.0
        out.append(cos)
    return out


def refine_last_tokens(
    obs: Observation, model: nn.Module, prefixes: list[list[int]], cands: list[list[int]], sweeps: int = 5
) -> list[int]:
    """The joint choice of last tokens (one of ``cands[b]`` per sequence) that best explains the head grad.

    The mean next-token loss is L = (1/N) [known terms + sum_b (logsumexp(l_b) - l_b[y_b])] with l_b the
    logits at the last prefix position, so its gradient with respect to the head weight is
    G_0 - (1/N) sum_b D_b(y_b), with G_0 computable from the prefixes and D_b(y) = d l_b[y] / dW (the row
    y for the head and, for tied heads, the input-embedding rows of the prefix through the backward pass).
    The rows that depend on the choice (candidates and prefix tokens) are compared with the observed
    gradient and the choice is made by coordinate descent from the cosine ranking (``cands[b][0]``), with
    pairwise exchanges of two sequences' tokens, until nothing changes (at most ``sweeps`` rounds).
    This removes the cosine method's errors when a last token is also an input token of the batch (tied
    heads: its row carries that token's input-embedding gradient too).
    """
    name = lm_head_param(model)
    param = dict(model.named_parameters())[name]
    observed = update_tensor(obs, name)
    rows = torch.tensor(sorted({t for s in prefixes for t in s} | {y for c in cands for y in c}))
    n_labels = sum(len(s) for s in prefixes)
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            total: torch.Tensor | None = None
            logits_last = []
            for s in prefixes:
                logits = model(input_ids=torch.tensor([s]), use_cache=False).logits[0]
                loss = torch.logsumexp(logits[-1], dim=0)
                if len(s) > 1:
                    loss = loss + nn.functional.cross_entropy(
                        logits[:-1], torch.tensor(s[1:]), reduction="sum"
                    )
                total = loss if total is None else total + loss
                logits_last.append(logits[-1])
            assert total is not None
            g0 = torch.autograd.grad(total / n_labels, param, retain_graph=True)[0]
            base = (observed - g0.to(torch.float64))[rows]
            contrib = [
                [
                    torch.autograd.grad(last[y], param, retain_graph=True)[0].to(torch.float64)[rows]
                    / n_labels
                    for y in c
                ]
                for last, c in zip(logits_last, cands, strict=True)
            ]
    finally:
        model.train(was_training)
    pick = [0] * len(prefixes)
    # observed = G_0 - (1/N) sum_b D_b(y_b)  <=>  base + sum_b contrib[b][pick_b] = 0
    current = base + sum(contrib[b][0] for b in range(len(prefixes)))
    for _ in range(sweeps):
        changed = False
        for b, options in enumerate(contrib):
            without = current - options[pick[b]]
            errs = [float((without + o).norm()) for o in options]
            best = min(range(len(options)), key=errs.__getitem__)
            changed |= best != pick[b]
            pick[b], current = best, without + options[best]
        # coordinate moves cannot exchange two sequences' tokens (a permutation is a local minimum)
        for b in range(len(cands)):
            for c in range(b + 1, len(cands)):
                yb, yc = cands[b][pick[b]], cands[c][pick[c]]
                if yb == yc or yc not in cands[b] or yb not in cands[c]:
                    continue
                i, j = cands[b].index(yc), cands[c].index(yb)
                trial = current - contrib[b][pick[b]] - contrib[c][pick[c]] + contrib[b][i] + contrib[c][j]
                if float(trial.norm()) < float(current.norm()):
                    pick[b], pick[c], current, changed = i, j, trial, True
        if not changed:
            break
    return [c[i] for c, i in zip(cands, pick, strict=True)]


@torch.no_grad()
def add_prefix_sentences(
    obs: Observation,
    model: nn.Module,
    prefixes: list[list[int]],
    missing: int,
    *,
    tol: float = 1e-4,
    sketch_dim: int = 64,
) -> list[list[int]]:
    """Add up to ``missing`` sentences that are prefixes of (or equal to) recovered ones.

    The decoder search closes a prefix only when no extension passes the span check, so a batch sentence
    that is a prefix of another one (e.g. "<unk>" beside "<unk> was born ...") is never returned, and a
    repeated sentence is returned once. Both show up in the LM-head gradient: with the prefixes of all B
    sequences known, G = (1/N) [sum_t p_t h_t^T - sum_t e_{y_t} h_t^T] is fully determined except the B
    rows of the unknown last labels, and except the rows of input tokens when the head is tied (they also
    carry the input-embedding gradient). Each candidate q (a prefix of a recovered prefix) is scored by the
    relative norm of G - (known terms of the recovered prefixes and of q) / N_q on every other row, with
    the 2B largest remaining rows (the last labels) left out; the true q leaves rounding error only
    (measured 5e-8 on GPT-2, 5e-6 on SmolLM2, against >= 2e-3 for the next candidate). The best candidate is
    added while its score is below ``tol``; otherwise nothing is added.

    The V x d residuals are compared through a fixed Gaussian sketch ``R`` (d x ``sketch_dim``, seed 0):
    ``(G - K) R`` keeps each row's norm within a few tens of percent and an exact match exactly, at
    ``sketch_dim / d`` of the cost.
    """
    if missing <= 0 or not prefixes or not family_of(model).causal:
        return prefixes
    grad = update_tensor(obs, lm_head_param(model)).to(torch.float64)
    sketch = (
        torch.randn(
            grad.shape[1], sketch_dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64
        )
        / sketch_dim**0.5
    )
    grad_s = grad @ sketch
    out = [list(s) for s in prefixes]
    for _ in range(missing):
        terms = _head_terms(model, out)
        known = _known_terms(out, terms, sketch)
        n_known = sum(len(s) for s in out)
        keep = torch.ones(grad.shape[0], dtype=torch.bool)
        keep[torch.tensor(sorted({t for s in out for t in s}))] = False
        scale = float(grad_s[keep].norm()) or 1.0
        best: tuple[float, list[int]] | None = None
        runner_up = float("inf")
        tried: set[tuple[int, ...]] = set()
        for s, (p, h) in zip(out, terms, strict=True):
            hs = h @ sketch
            extra = torch.zeros_like(grad_s)
            for length in range(1, len(s) + 1):
                t = length - 1
                extra += p[t].unsqueeze(1) * hs[t].unsqueeze(0)
                if t > 0:
                    extra[s[t]] -= hs[t - 1]
                q = tuple(s[:length])
                if q in tried:
                    continue
                tried.add(q)
                rest = (grad_s - (known + extra) / (n_known + length))[keep].norm(dim=1)
                k = min(2 * (len(out) + 1), rest.numel())
                tail = rest.pow(2).sum() - rest.topk(k).values.pow(2).sum()
                score = float(tail.clamp_min(0).sqrt()) / scale
                if best is None or score < best[0]:
                    runner_up = best[0] if best is not None else runner_up
                    best = (score, list(q))
                else:
                    runner_up = min(runner_up, score)
        if best is None or best[0] >= tol:
            log.info("prefix sentences: best score %.2e >= %.0e; none added", best[0] if best else 1.0, tol)
            break
        log.info(
            "prefix sentences: added a %d-token prefix sentence (score %.2e, next best %.2e)",
            len(best[1]),
            best[0],
            runner_up,
        )
        out.append(best[1])
    return out
