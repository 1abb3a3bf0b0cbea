"""Label recovery from the last layer's update (iDLG; LLG-style counts for batches).

For cross-entropy, the gradient of the output layer's bias is g_b = (1/N) sum_i (p_i - y_i), and of its
weight g_W = (1/N) sum_i (p_i - y_i) h_i^T with h_i >= 0 after ReLU/sigmoid. For N = 1 the true class is the
only row with a negative sign (Zhao et al. 2020, iDLG, Sec. 3): exact. For N > 1 we estimate counts
n_c ~ N * (mean_i p_ic - g_b[c]) with mean_i p_ic ~ 1/C at the broadcast weights, and assign the N labels
greedily (Wainakh et al. 2022, LLG): each class with a negative bias gradient first, then the largest
remaining estimates.
"""

from __future__ import annotations

import torch
from torch import nn

from gradleak.types import AttackInputError, Observation


def last_linear(model: nn.Module) -> tuple[str, nn.Linear]:
    """The last ``nn.Linear`` in module order (the output layer) and its module name."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not found:
        raise AttackInputError("label recovery needs a model whose output layer is nn.Linear")
    return found[-1]


def output_layer_gradient(obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(g_W, g_b) of the output layer, as a gradient (a FedAvg delta is negated: delta ~ -lr * sum g)."""
    name, layer = last_linear(obs.model)
    w_key = f"{name}.weight" if name else "weight"
    b_key = f"{name}.bias" if name else "bias"
    if w_key not in obs.update.tensors:
        raise AttackInputError(f"the update lacks the output layer's weight {w_key!r}")
    sign = -1.0 if obs.update.kind == "delta" else 1.0
    gw = sign * obs.update.tensors[w_key]
    gb = (
        sign * obs.update.tensors[b_key] if (layer.bias is not None and b_key in obs.update.tensors) else None
    )
    return gw, gb


def recover_labels(obs: Observation, num_samples: int) -> torch.Tensor:
    """Labels (num_samples,) int64 from the output layer's update, sorted ascending."""
    if num_samples < 1:
        raise AttackInputError(f"num_samples must be >= 1, got {num_samples}")
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
    remaining = est.clone()
    for k in labels:
        remaining[k] -= 1.0
    while len(labels) < num_samples:
        k = int(remaining.argmax())
        labels.append(k)
        remaining[k] -= 1.0
    return torch.tensor(sorted(labels), dtype=torch.long)
