"""A causal LM's last tokens from a LoRA update: the labels the adapters' gradient still holds.

Under the next-token loss each sequence's last token ``y_b`` is only the label of the position before it
(:mod:`gradleak.attacks.text.lm_completion`); with LoRA the LM head is frozen, so the head-gradient read of
full fine-tuning is gone, but the label still reaches every adapter through the backward pass. Once the
prefixes ``s_b`` are known (the span search recovers every token but the last), the attacker runs the
broadcast model on them and splits the FedSGD gradient of the mean loss over the ``N = sum_b |s_b|`` label
positions into what it can compute and what it cannot:

    g = (1/N) [ grad sum_{b, t < |s_b|-1} CE(z_bt, s_b[t+1]) + grad sum_b logsumexp(z_b) ]
        - (1/N) sum_b grad z_b[y_b],

with ``z_b`` the logits at the last prefix position and every gradient taken over the adapter parameters.
So ``r = N (g - known) = -sum_b grad z_b[y_b]``, and ``-<grad z_b[y], r>`` scores every candidate ``y`` of
sequence ``b`` at once: it is the directional derivative of the logits ``z_b`` along ``-r`` (two forward
passes, a central difference in float64). The sequences are completed greedily: the (sequence, token) pair
with the highest score is taken, its term ``grad z_b[y]`` removed from ``r``, and the scores recomputed for
the rest (the terms of different sequences overlap; peeling the strongest first keeps one sequence's label
from being read as another's).

Where it stands: on the GPT-2 arch (random weights, r = 16) it completes every sentence exactly; on
SmolLM2-135M with its real weights (r = 256, B = 8, Rotten Tomatoes) it picks wrong tokens for all eight
and takes 188 s on 2 cores: the raw score favours tokens whose logit gradient is large, and a trained
model's output rows are strongly correlated, so the true token does not stand out. Off by default
(``DagerLoRAConfig.complete_from_adapters``). The exact route left for it: the last block's output
projection acts position by position, so its adapter's ``dL/dB = s sum_t delta_t (A a_t)^T`` splits into
one rank-one term per sequence once the known positions are subtracted; solving for each ``delta_b`` and
mapping it back through the position-wise tail (MLP, norms) to the head gives ``W[y_b]`` directly.

Threat model: the honest-but-curious server of DAGER, a FedSGD update (one gradient at the broadcast
weights, eval mode: no dropout) of the adapters alone; it needs the prefixes (from the span search) and the
model the update was computed on. Written here from the loss above; DAGER (Petrov et al., NeurIPS 2024)
reads the last token off the LM head, which a LoRA update does not carry.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import nn

from gradleak.attacks.text.family import update_tensor
from gradleak.types import Observation

log = logging.getLogger(__name__)

STEP = 1e-3  # the central difference's step, as a norm in the adapters' parameter space (float64)


def complete_from_adapters(obs: Observation, model: nn.Module, prefixes: list[list[int]]) -> list[list[int]]:
    """Each prefix plus the last token the adapter gradient explains best (module docstring); prefixes
    unchanged where the update is not a FedSGD gradient or carries no adapter."""
    if not prefixes or obs.update.kind != "gradient" or any(len(s) < 1 for s in prefixes):
        return prefixes
    work = copy.deepcopy(model).to(torch.float64).eval()
    params = {n: p for n, p in work.named_parameters() if n in obs.update.tensors}
    for p in work.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    if not params:
        return prefixes
    ids, mask, last = _batch(prefixes, work)
    n = sum(len(s) for s in prefixes)  # the label positions of the client's sequences (last tokens included)
    logits = work(input_ids=ids, attention_mask=mask).logits
    known = _known_loss(logits, ids, prefixes, last) / n
    names = list(params)
    g_known = torch.autograd.grad(known, [params[k] for k in names])
    residual = [
        n * (update_tensor(obs, k).to(g.device) - g) for k, g in zip(names, g_known, strict=True)
    ]  # = -sum_b grad z_b[y_b]
    chosen: dict[int, int] = {}
    rows = torch.arange(len(prefixes))
    while len(chosen) < len(prefixes):
        scores = _directional(work, params, names, [-r for r in residual], ids, mask)[rows, last]  # (B, V)
        scores[list(chosen)] = -torch.inf
        b, y = divmod(int(scores.argmax()), scores.shape[1])
        chosen[b] = y
        term = torch.autograd.grad(
            work(input_ids=ids, attention_mask=mask).logits[b, last[b], y], [params[k] for k in names]
        )
        residual = [r + t for r, t in zip(residual, term, strict=True)]
    return [[*s, chosen[b]] for b, s in enumerate(prefixes)]


def _batch(prefixes: list[list[int]], model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefixes right-padded (``input_ids``, ``attention_mask``) and each one's last position."""
    device = next(model.parameters()).device
    width = max(len(s) for s in prefixes)
    ids = torch.zeros(len(prefixes), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(prefixes):
        ids[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[b, : len(s)] = 1
    last = torch.tensor([len(s) - 1 for s in prefixes], device=device)
    return ids, mask, last


def _known_loss(
    logits: torch.Tensor, ids: torch.Tensor, prefixes: list[list[int]], last: torch.Tensor
) -> torch.Tensor:
    """The summed loss terms that do not depend on the unknown labels: each prefix's own next-token
    cross-entropies and the log-partition of its last position's logits."""
    total = logits.new_zeros(())
    for b, s in enumerate(prefixes):
        if len(s) > 1:
            total = total + F.cross_entropy(logits[b, : len(s) - 1], ids[b, 1 : len(s)], reduction="sum")
        total = total + torch.logsumexp(logits[b, int(last[b])], dim=-1)
    return total


@torch.no_grad()
def _directional(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    names: list[str],
    direction: list[torch.Tensor],
    ids: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """The logits' derivative along ``direction`` in the adapters' parameters, by a central difference."""
    norm = float(torch.sqrt(sum((d * d).sum() for d in direction)))  # type: ignore[arg-type]
    if norm == 0.0:
        return torch.zeros(*ids.shape, 1, dtype=torch.float64)
    h = STEP / norm
    outs = []
    for sign in (1.0, -1.0):
        for k, d in zip(names, direction, strict=True):
            params[k].add_(d, alpha=sign * h)
        outs.append(model(input_ids=ids, attention_mask=mask).logits)
        for k, d in zip(names, direction, strict=True):
            params[k].sub_(d, alpha=sign * h)
    return (outs[0] - outs[1]) / (2 * h)
