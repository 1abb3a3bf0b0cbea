"""The labels of a batch, repeated labels included, from the output layer's bias update.

For cross-entropy over a batch of ``N`` samples, the gradient of the output bias is
``g_b[c] = (1/N) sum_i (p_ic - y_ic)``, so the count of class ``c`` is exactly

    n_c = N (p_bar_c - g_b[c]),   p_bar_c = (1/N) sum_i p_ic,

and the whole problem is the batch's mean prediction ``p_bar``, which the server cannot compute without the
images. Geng et al., "Towards General Deep Leakage in Federated Learning" (2021, Sec. 3.1) and Wainakh et al.,
"User-Level Label Leakage from Gradients in Federated Learning" (PETS 2022, LLG) estimate it; this attack
offers two estimates (``prior``):

- ``"uniform"``: ``p_bar_c = 1/C``, right for a freshly initialised model (LLG's setting);
- ``"model"``: the mean softmax of the broadcast model, in the client's mode, on ``probes`` random images
  drawn in the data's range (Geng et al.'s estimate from dummy data), right where the model already
  prefers some classes whatever the input (a trained or biased model). In train mode the probes pass
  BatchNorm with their own batch statistics, not the client batch's: the estimate carries that error.

The estimated counts are rounded as :func:`gradleak.attacks.image.labels.fill_greedily` does: every class
whose bias gradient is negative (present, Zhao et al. 2020's sign rule) first, then the largest remaining
estimates. A FedAvg delta is read as the mean gradient ``(w_0 - w_T) / (lr T)`` of its public recipe (one
step: exact; several: the trajectory's average prediction stands in for ``p_bar``).

Threat model: an honest-but-curious server that sees one client's update (or a secure-aggregation sum,
whose labels are then the union's) and, for a FedAvg delta, the client's recipe; it needs the output layer
to have a bias that the update carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from gradleak.attacks.checks import require_image_input
from gradleak.attacks.image.labels import (
    fill_greedily,
    last_linear,
    mean_output_bias_gradient,
    require_cross_entropy,
)
from gradleak.attacks.image.surrogate import local_steps
from gradleak.device import DEVICE_TYPES, module_device, uniform
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation, Reconstruction

PRIORS = ("uniform", "model")


@dataclass(frozen=True)
class LabelCountsConfig:
    """``prior``: the estimate of the batch's mean prediction (module docstring); ``probes``: random images
    the ``"model"`` prior averages over; ``num_samples``: the batch size (None: the update's)."""

    prior: Literal["uniform", "model"] = "model"
    probes: int = 64
    num_samples: int | None = None

    def __post_init__(self) -> None:
        if self.prior not in PRIORS:
            raise ValueError(f"prior must be one of {PRIORS}, got {self.prior!r}")
        if isinstance(self.probes, bool) or not isinstance(self.probes, int) or self.probes < 2:
            raise ValueError(
                f"probes must be an int >= 2 (BatchNorm in train mode needs two), got {self.probes!r}"
            )
        if self.num_samples is not None and self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")


def mean_prediction(obs: Observation, probes: int, generator: torch.Generator) -> torch.Tensor:
    """The broadcast model's mean softmax, in the client's mode, over ``probes`` uniform random images."""
    model = obs.client_model()
    like = next(iter(model.parameters()))
    x = uniform((probes, *obs.input_shape), generator, like)
    with torch.no_grad():
        return torch.softmax(model(x).double(), dim=-1).mean(dim=0)


def count_labels(g_bias: torch.Tensor, p_bar: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Labels (num_samples,) int64, sorted, from the mean bias gradient and the mean prediction (module
    docstring): ``n_c = N (p_bar_c - g_b[c])``, the present classes first, then the largest estimates."""
    g = g_bias.detach().double().cpu()
    est = (num_samples * (p_bar.double().cpu() - g)).clamp_min(0)
    present = [int(k) for k in torch.argsort(g).tolist() if g[k] < 0][:num_samples]
    return fill_greedily(present, est, num_samples)


class LabelCounts:
    """Label counts of a batch (module docstring)."""

    def __init__(self, config: LabelCountsConfig | None = None) -> None:
        self.config = config or LabelCountsConfig()

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        require_image_input(obs)
        require_cross_entropy(obs)
        n = self.config.num_samples or obs.update.num_samples
        if n < 1:
            raise AttackInputError("cannot tell the batch size: the update reports 0 samples")
        name, layer = last_linear(obs.model)
        if layer.bias is None:
            raise AttackInputError(
                f"the output layer {name!r} has no bias: its update carries no label counts"
            )
        if obs.update.kind == "gradient":
            g = mean_output_bias_gradient(obs, lr=1.0, steps=1)
        else:
            if obs.training is None:
                raise AttackInputError("a FedAvg delta is read with the client's recipe, which is hidden")
            g = mean_output_bias_gradient(obs, lr=obs.training.lr, steps=local_steps(obs, "label_counts"))
        if self.config.prior == "model":
            p_bar = mean_prediction(obs, self.config.probes, generator)
        else:
            p_bar = torch.full(
                (g.numel(),), 1.0 / g.numel(), dtype=torch.float64, device=module_device(obs.model)
            )
        labels = count_labels(g, p_bar, n)
        return Reconstruction(labels=labels, stats={"classes_present": float(labels.unique().numel())})


ATTACKS.register(
    "label_counts",
    LabelCounts,
    config_cls=LabelCountsConfig,
    summary="a batch's labels with repeats from the output bias update (Geng et al. 2021; LLG, Wainakh 2022)",
    modality="image",
    devices=DEVICE_TYPES,
)

__all__ = ["LabelCounts", "LabelCountsConfig", "count_labels", "mean_prediction"]
