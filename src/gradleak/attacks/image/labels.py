"""Label recovery from the last layer's update (iDLG; LLG-style counts for batches).

For cross-entropy, the gradient of the output layer's bias is g_b = (1/N) sum_i (p_i - y_i), and of its
weight g_W = (1/N) sum_i (p_i - y_i) h_i^T with h_i >= 0 after ReLU/sigmoid. For N = 1 the true class is the
only row with a negative sign (Zhao et al. 2020, iDLG, Sec. 3): exact. For N > 1 we estimate counts
n_c ~ N * (mean_i p_ic - g_b[c]) with mean_i p_ic ~ 1/C at the broadcast weights, and assign the N labels
greedily (Wainakh et al. 2022, LLG): each class with a negative bias gradient first, then the largest
remaining estimates.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from gradleak.types import AttackInputError, Observation
from gradleak.update import DEFAULT_LOSS

log = logging.getLogger(__name__)


def last_linear(model: nn.Module) -> tuple[str, nn.Linear]:
    """The last ``nn.Linear`` in module order (the output layer) and its module name."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not found:
        raise AttackInputError("label recovery needs a model whose output layer is nn.Linear")
    return found[-1]


def require_cross_entropy(obs: Observation) -> None:
    """Label recovery reads the output layer's update as cross-entropy's ``p - y``: refuse a recipe that
    states another loss (an MSE's bias gradient at near-uniform predictions is cross-entropy's scaled by
    about 2 / C^2, and every class would look present) rather than return wrong labels."""
    loss = DEFAULT_LOSS if obs.training is None else obs.training.loss
    if loss != DEFAULT_LOSS:
        raise AttackInputError(
            f"label recovery reads the output layer as cross-entropy's, but the recipe trains with loss = "
            f"{loss!r}: grant the labels (audit.grant_labels = true) to attack this recipe"
        )


def output_layer_gradient(obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(g_W, g_b) of the output layer, as a gradient (a FedAvg delta is negated: delta ~ -lr * sum g)."""
    name, layer = last_linear(obs.model)
    w_key = f"{name}.weight" if name else "weight"
    b_key = f"{name}.bias" if name else "bias"
    if w_key not in obs.update.tensors:
        raise AttackInputError(f"the update lacks the output layer's weight {w_key!r}")
    sign = obs.update.gradient_sign
    gw = sign * obs.update.tensors[w_key]
    gb = (
        sign * obs.update.tensors[b_key] if (layer.bias is not None and b_key in obs.update.tensors) else None
    )
    return gw, gb


def recover_labels(obs: Observation, num_samples: int) -> torch.Tensor:
    """Labels (num_samples,) int64 from the output layer's update, sorted ascending."""
    if num_samples < 1:
        raise AttackInputError(f"num_samples must be >= 1, got {num_samples}")
    require_cross_entropy(obs)
    gw, gb = output_layer_gradient(obs)
    row = gw.sum(dim=1) if gb is None else gb  # (C,) signed per-class score
    if num_samples == 1:
        return row.argmin().reshape(1).to(torch.long)
    if gb is not None:  # n_c ~ N * (1/C - g_b[c]) for a mean gradient at near-uniform predictions
        est = num_samples * (1.0 / row.numel() - row)
    else:  # no bias: share the N labels in proportion to each row's negative mass
        neg = (-row).clamp_min(0)
        est = num_samples * neg / neg.sum().clamp_min(1e-12)
    labels: list[int] = [int(k) for k in torch.nonzero(row < 0).flatten().tolist()][:num_samples]
    return fill_greedily(labels, est, num_samples)


def mean_output_bias_gradient(obs: Observation, *, lr: float, steps: int) -> torch.Tensor:
    """g_bar_b = (w_0 - w_T)_b / (lr T): the output bias's mean gradient along a T-step SGD trajectory.

    Paper 001, Eq. 2 applied to the last layer's bias. For a FedSGD gradient (one step) it is the gradient.
    """
    if lr <= 0 or steps < 1:
        raise AttackInputError(f"need lr > 0 and steps >= 1 to scale the update, got lr={lr}, steps={steps}")
    gw, gb = output_layer_gradient(obs)
    if gb is None:
        raise AttackInputError("label-count recovery from a multi-step update needs the output layer's bias")
    scale = 1.0 if obs.update.kind == "gradient" else 1.0 / (lr * steps)
    return gb * scale


def recover_label_counts(obs: Observation, num_samples: int, *, lr: float, steps: int) -> torch.Tensor:
    """Labels (num_samples,) int64 of a multi-step (FedAvg) update from its output-bias update, sorted.

    Each SGD step on a batch of B adds ``lr/B sum_i (p_i - y_i)`` to ``w_0 - w_T`` in the bias; over E
    epochs of T = E ceil(N/B) steps, ``g_bar_b = (w_0 - w_T)_b / (lr T) ~ (1/N) sum_i (p_bar_i - y_i)`` with
    p_bar the softmax averaged along the trajectory, so ``n_c ~ N (p_bar_c - g_bar_b[c])``. We take
    p_bar_c = 1/C for classes that gain (g_bar_b[c] < 0) and p_bar_c = g_bar_b[c] (i.e. n_c = 0) for the
    others, then normalise the estimates to sum to N and round greedily as :func:`recover_labels` does
    (every class with a negative mean gradient first). Paper 001: labels are recovered from the last
    layer, then held fixed.

    Clean cross-entropy bias gradients sum to zero, so some class always gains; noise added to the update
    (update DP, a client's noise mod) can leave none. The labels are then still a best guess, not a refusal:
    every class is weighted by ``max(1/C - g_bar_b[c], 0)`` (uniformly where that is zero everywhere), so the
    attack runs and its score, not a missing record, tells how much the noise hid.
    """
    if num_samples < 1:
        raise AttackInputError(f"num_samples must be >= 1, got {num_samples}")
    require_cross_entropy(obs)
    g = mean_output_bias_gradient(obs, lr=lr, steps=steps).detach().to(torch.float64)
    gaining = g < 0
    if not bool(gaining.any()):
        log.warning("no class gains in the output bias update (noise?): label counts are a best guess")
        est = (1.0 / g.numel() - g).clamp_min(0)
        est = est if float(est.sum()) > 0 else torch.ones_like(g)
        return fill_greedily([], num_samples * est / est.sum(), num_samples)
    est = torch.where(gaining, 1.0 / g.numel() - g, torch.zeros_like(g)).clamp_min(0)
    est = num_samples * est / est.sum().clamp_min(1e-12)
    order = torch.argsort(g)  # most negative first
    labels: list[int] = [int(k) for k in order[: int(gaining.sum())].tolist()][:num_samples]
    return fill_greedily(labels, est, num_samples)


def fill_greedily(labels: list[int], est: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Complete ``labels`` to ``num_samples`` by repeatedly taking the class with the largest remaining
    estimated count ``est`` (each label already taken uses up one), sorted ascending."""
    remaining = est.clone()
    for k in labels:
        remaining[k] -= 1.0
    labels = list(labels)
    while len(labels) < num_samples:
        k = int(remaining.argmax())
        labels.append(k)
        remaining[k] -= 1.0
    return torch.tensor(sorted(labels), dtype=torch.long)
