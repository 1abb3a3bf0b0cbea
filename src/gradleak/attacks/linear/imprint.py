"""The shared imprint (linear-leakage) machinery: programming the bins, and the analytic recovery.

Fowl et al., "Robbing the Fed" (ICLR 2022), the imprint module and its binning. Bin ``i`` computes
``h_i = ReLU(s * (<a, f(x)> - c_i))`` for a measurement direction ``a``, a scale ``s`` and cuts
``c_1 < ... < c_k`` placed at the quantiles of the measurement over the server's *public* data. A sample
whose measurement falls in ``(c_i, c_{i+1}]`` activates bins ``1..i`` (cumulative bins). With a
back-connection whose weight is the same for every bin, dL/dh_{n,i} = g_n for all active bins, hence

    dL/dW_i = sum_{n: m_n > c_i} g_n f(x_n),          dL/db_i = sum_{n: m_n > c_i} g_n
    (dL/dW_i - dL/dW_{i+1}) / (dL/db_i - dL/db_{i+1}) = sum_{n in bin i} g_n f(x_n) / sum_{n in bin i} g_n

(the paper's weight-gradient / bias-gradient ratio, applied to differences of consecutive bins): exactly
``f(x_n)`` when the bin holds one sample, a ``g``-weighted average when it holds several. Scaling the update
(FedAvg delta = -lr * grad for one SGD step) cancels in the ratio. Adam does not: its per-coordinate
normalisation ``m / (sqrt(v) + eps)`` replaces each coordinate by (roughly) its sign, which destroys the ratio
-- unless every imprint gradient is far below ``eps``, where Adam is linear in the gradient (``g / eps``).
:func:`calibrate_back_weight` uses that (see docs/attacks-linear.md); nothing here reads client data.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from gradleak.models.malicious import GroupedLinear, ImprintBlock, find_imprint
from gradleak.types import AttackInputError, Observation

log = logging.getLogger(__name__)

Measurement = Literal["random", "mean", "positive"]
MEASUREMENTS = ("random", "mean", "positive")


def measurement_direction(kind: str, dim: int, generator: torch.Generator) -> torch.Tensor:
    """A direction ``a`` (dim,): ``random`` N(0, 1), ``mean`` 1/dim (brightness), ``positive`` U(0, 1).

    ``positive`` keeps every measurement of a non-negative input non-negative.
    """
    if kind == "random":
        return torch.randn(dim, generator=generator, dtype=torch.float64)
    if kind == "mean":
        return torch.full((dim,), 1.0 / dim, dtype=torch.float64)
    if kind == "positive":
        return torch.rand(dim, generator=generator, dtype=torch.float64)
    raise ValueError(f"measurement must be one of {MEASUREMENTS}, got {kind!r}")


def cut_points(measurements: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Cuts at the ``i / (k + 1)`` quantiles (i = 1..k) of public measurements, strictly increasing."""
    m = measurements.detach().to(torch.float64).reshape(-1)
    if m.numel() < 2:
        raise ValueError(f"need at least 2 public measurements to place bins, got {m.numel()}")
    levels = torch.arange(1, num_bins + 1, dtype=torch.float64) / (num_bins + 1)
    cuts = torch.quantile(m, levels)
    tiny = 1e-9 * float(m.std().clamp_min(1e-12))
    for i in range(1, num_bins):  # ties (repeated public values) would make two bins identical
        if cuts[i] <= cuts[i - 1]:
            cuts[i] = cuts[i - 1] + tiny
    return cuts


@torch.no_grad()
def program_bins(
    linear: nn.Linear | GroupedLinear,
    direction: torch.Tensor,
    cuts: torch.Tensor,
    scale: float,
    rows: slice | None = None,
    cols: slice | None = None,
) -> None:
    """Set ``rows`` of ``linear`` to ``h_i = scale * (<direction, f> - cut_i)`` reading only ``cols``."""
    rows = rows or slice(0, linear.out_features)
    cols = cols or slice(0, linear.in_features)
    w = torch.zeros_like(linear.weight[rows])
    w[:, cols] = (scale * direction).to(w.dtype)
    linear.weight[rows] = w
    linear.bias[rows] = (-scale * cuts).to(linear.bias.dtype)


def normalised_direction(
    direction: torch.Tensor, public_features: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``a / std(<a, f>)`` over the public features, and the normalised public measurements."""
    f = public_features.detach().to(torch.float64).flatten(1)
    m = f @ direction
    std = float(m.std().clamp_min(1e-12))
    return direction / std, m / std


def place_bins(
    public_features: torch.Tensor,
    kind: str,
    num_bins: int,
    generator: torch.Generator,
    *,
    center: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the server's public features (N, d): the offset (their mean, or 0 without centring), the
    normalised measurement direction ``a`` and the k bin cuts at the quantiles of ``<a, f - offset>``."""
    f = public_features.detach().to(torch.float64).flatten(1)
    offset = f.mean(dim=0) if center else torch.zeros(f.shape[1], dtype=torch.float64)
    direction = measurement_direction(kind, int(f.shape[1]), generator)
    direction, measured = normalised_direction(direction, f - offset)
    return offset, direction, cut_points(measured, num_bins)


@torch.no_grad()
def calibrate_back_weight(
    model: nn.Module,
    block: ImprintBlock,
    public_images: torch.Tensor,
    num_classes: int,
    target: float,
    generator: torch.Generator,
    batch_size: int = 64,
    include_front: bool = True,
) -> float:
    """Set ``block.back_weight`` so that the largest gradient of the imprint layer (and, with
    ``include_front``, of whatever sits in front of it, e.g. Scale-MIA's encoder) on a public batch equals
    ``target``. LOKI leaves its 1x1 slot kernels out: Adam moves such a gain by at most lr per step, which
    rescales a recovered image by a fraction of a percent, while counting them would shrink every imprint
    gradient (and the precision of the update) by orders of magnitude.

    The gradient of every block parameter is linear in the back-connection weight, so one backward pass
    at weight 1 gives the scale. Labels are drawn at random (the server has no client labels; random labels
    give a larger loss gradient than confident predictions, a conservative estimate). Returns the weight.
    """
    idx = torch.randperm(len(public_images), generator=generator)[:batch_size]
    x = public_images[idx]
    y = torch.randint(0, num_classes, (len(idx),), generator=generator)
    block.back_weight.fill_(1.0)
    params = (
        [p for p in block.parameters() if p.requires_grad]
        if include_front
        else [block.linear.weight, block.linear.bias]
    )
    with torch.enable_grad():
        loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, params)
    peak = max(float(g.abs().max()) for g in grads)
    if peak <= 0:
        raise ValueError("the imprint layer received no gradient on public data (no bin fired)")
    weight = target / peak
    block.back_weight.fill_(weight)
    return weight


@dataclass(frozen=True)
class ImprintSecrets:
    """Where the imprint layer is and how its bins were programmed (the server's own knowledge)."""

    weight_name: str
    bias_name: str
    num_bins: int
    feature_shape: tuple[int, ...]
    bias: torch.Tensor  # the programmed biases (-scale * cuts), to check against the broadcast model
    offset: torch.Tensor | None = None  # the block's fixed centring (added back to recovered features)

    def to_mapping(self) -> dict[str, object]:
        return {
            "imprint_weight": self.weight_name,
            "imprint_bias": self.bias_name,
            "num_bins": self.num_bins,
            "feature_shape": tuple(self.feature_shape),
            "bias": self.bias.detach().clone(),
            **({} if self.offset is None else {"offset": self.offset.detach().clone()}),
        }

    @classmethod
    def from_observation(cls, obs: Observation) -> ImprintSecrets:
        """Read the secrets; without them, find the :class:`ImprintBlock` in the server's own model.

        Raises :class:`AttackInputError` when neither names an imprint layer, when the update lacks its
        parameters, or when the bins do not match the broadcast model.
        """
        s: Mapping[str, object] = obs.secrets
        if "imprint_weight" in s:
            try:
                weight_name, bias_name = str(s["imprint_weight"]), str(s["imprint_bias"])
                num_bins = int(s["num_bins"])  # type: ignore[call-overload]
                feature_shape = tuple(int(d) for d in s["feature_shape"])  # type: ignore[attr-defined]
                bias = torch.as_tensor(s["bias"])
                offset = torch.as_tensor(s["offset"]) if "offset" in s else None
            except (KeyError, TypeError, ValueError) as exc:
                raise AttackInputError(f"malformed imprint secrets: {exc!r}") from None
        else:
            try:
                path, block = find_imprint(obs.model)
            except LookupError as exc:
                raise AttackInputError(
                    f"no imprint layer: the observation has no imprint secrets and the model {exc}"
                ) from None
            prefix = f"{path}.linear" if path else "linear"
            weight_name, bias_name = f"{prefix}.weight", f"{prefix}.bias"
            num_bins = block.num_bins
            feature_shape = (block.linear.in_features,)
            bias = block.linear.bias.detach().clone()
            groups = getattr(block.linear, "groups", 1)
            offset = (
                block.offset.detach().reshape(groups, -1)[0].clone() if bool(block.offset.any()) else None
            )
            log.info("no imprint secrets in the observation; using the broadcast model's %s", prefix)
        secrets = cls(weight_name, bias_name, num_bins, feature_shape, bias, offset)
        secrets.check(obs)
        return secrets

    def check(self, obs: Observation) -> None:
        """The update carries the imprint parameters and the broadcast model has these bins."""
        missing = [n for n in (self.weight_name, self.bias_name) if n not in obs.update.tensors]
        if missing:
            raise AttackInputError(
                f"the update lacks the imprint parameters {missing}: was this model broadcast by the attack?"
            )
        params = dict(obs.model.named_parameters())
        if self.weight_name not in params or self.bias_name not in params:
            raise AttackInputError(f"the broadcast model has no parameter {self.weight_name!r}")
        w, b = params[self.weight_name], params[self.bias_name]
        if w.shape[0] != self.num_bins or b.shape[0] != self.num_bins or self.bias.shape[0] != self.num_bins:
            raise AttackInputError(
                f"bins do not match the broadcast model: secrets say {self.num_bins} bins "
                f"({self.bias.shape[0]} biases), the model's imprint layer has {w.shape[0]} rows"
            )
        expect = int(torch.tensor(self.feature_shape).prod())
        if w.shape[1] != expect:
            raise AttackInputError(
                f"imprint features do not match: secrets say {self.feature_shape}, "
                f"the layer reads {w.shape[1]}"
            )
        if not torch.allclose(b.detach().to(self.bias.dtype), self.bias, rtol=1e-5, atol=1e-12):
            raise AttackInputError("bins do not match the broadcast model: its imprint biases differ")
        if self.offset is not None and self.offset.numel() != expect:
            raise AttackInputError(
                f"imprint offset has {self.offset.numel()} values, the layer reads {expect}"
            )

    def restore(self, features: torch.Tensor) -> torch.Tensor:
        """Recovered (centred) features plus the block's offset."""
        return features if self.offset is None else features + self.offset.to(features.dtype).reshape(1, -1)


@dataclass(frozen=True)
class Recovered:
    """Per recovered bin: the feature vector, the bin index, and the bias-update mass it rests on."""

    features: torch.Tensor  # (M, D) float64
    bins: torch.Tensor  # (M,) long, index of the bin
    mass: torch.Tensor  # (M,) |bias difference|


def invert_bins(
    weight_update: torch.Tensor,
    bias_update: torch.Tensor,
    *,
    max_items: int | None = None,
    rel_tol: float = 1e-6,
) -> Recovered:
    """Analytic recovery from cumulative bins (module docstring): one feature vector per non-empty bin.

    Bins are the rows of ``weight_update`` (k, D) ordered by increasing cut. A bin counts as non-empty when
    its bias difference exceeds ``rel_tol`` times the largest one (empty bins differ only by rounding).
    At most ``max_items`` bins are returned, those with the largest bias difference first.
    """
    gw = weight_update.detach().to(torch.float64)
    gb = bias_update.detach().to(torch.float64)
    if gw.dim() != 2 or gb.dim() != 1 or gw.shape[0] != gb.shape[0]:
        raise AttackInputError(
            f"imprint update shapes {tuple(gw.shape)} and {tuple(gb.shape)} are not (k, D) and (k,)"
        )
    dw = gw.clone()
    db = gb.clone()
    dw[:-1] -= gw[1:]
    db[:-1] -= gb[1:]
    mass = db.abs()
    peak = float(mass.max()) if mass.numel() else 0.0
    if peak == 0.0:
        empty = torch.empty(0, gw.shape[1], dtype=torch.float64)
        return Recovered(empty, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.float64))
    keep = torch.nonzero(mass > rel_tol * peak).reshape(-1)
    keep = keep[torch.argsort(mass[keep], descending=True)]
    if max_items is not None:
        keep = keep[:max_items]
    features = dw[keep] / db[keep, None]
    return Recovered(features, keep, mass[keep])


def features_to_images(features: torch.Tensor, input_shape: tuple[int, ...]) -> torch.Tensor:
    """(M, D) recovered inputs -> (M, C, H, W) float32 images clamped to [0, 1]."""
    return features.reshape(-1, *input_shape).clamp(0, 1).to(torch.float32)


def local_step_count(obs: Observation) -> int | None:
    """How many local optimiser steps the update spans, when the client said so (FedAvg metadata)."""
    steps = obs.update.metadata.get("local_steps")
    return int(steps) if isinstance(steps, int) else (1 if obs.update.kind == "gradient" else None)
