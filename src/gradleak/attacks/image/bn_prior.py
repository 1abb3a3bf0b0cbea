"""BatchNorm statistics: read off a FedAvg reply, and used as the prior of Inverting Gradients.

**The read-off.** A client that trains in train mode updates every BatchNorm layer's running statistics
with momentum ``m`` (PyTorch's default 0.1) once per local step: ``r_t = (1 - m) r_{t-1} + m s_t``, where
``s_t`` is the step's batch mean, or its *unbiased* batch variance. A FedAvg reply carries the running
statistics whole (the ``buffers`` of an :class:`~gradleak.types.Update`, as a Flower reply carries them)
and the server sent ``r_0`` itself, so after ``k`` steps (``num_batches_tracked`` grew by ``k``)

    sum_t m (1 - m)^(k - t) s_t = r_k - (1 - m)^k r_0,

and :func:`read_batch_statistics` returns ``(r_k - (1 - m)^k r_0) / (1 - (1 - m)^k)``: for ``k = 1`` the
batch's exact per-channel mean and unbiased variance at every layer, with no prior; for ``k > 1`` a
weighted average of the steps' statistics (exact when every step saw the same batch through the same
weights, i.e. the client's data is one batch and the steps barely move the layers below; stated, not
assumed, in the record's ``bn_steps``).

**The prior.** Yin et al., "See through Gradients: Image Batch Recovery via GradInversion" (CVPR 2021),
Eq. 5: ``R_BN(x) = sum_l ||mu_l(x) - mu_l||_2 + ||sigma^2_l(x) - sigma^2_l||_2`` pulls the dummy batch's
per-layer statistics towards the target's. GradInversion takes the targets from the running statistics
(population statistics); :class:`BNPriorIG` takes them from the read-off (``source = "readoff"``, the
batch's own statistics) or, like GradInversion, from the broadcast model's running statistics
(``source = "running"``), and adds ``bn_weight * R_BN`` to Inverting Gradients' objective (Geiping et al.
2020, Eq. 4, with its TV term).

**Group consistency.** GradInversion (Sec. 3.3, Eq. 8) optimises ``G`` guesses from different seeds
together and pulls each towards the group's consensus, ``R_group = sum_g ||x_g - E(x_1..x_G)||_2^2``, where
the paper's ``E`` registers the guesses onto each other before averaging them. :class:`GradInversion`
takes ``E`` as the pixel-wise mean without registration (no alignment network offline; guesses of one
batch that converge do so in place, which is what the mean rewards), detached each step, so the term
moves every guess and never the consensus through the gradient; it returns the guess whose matching
term is lowest, with the group's spread (mean squared distance to the consensus) in ``group_spread``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from gradleak.attacks.image.ig import IGConfig, InvertingGradients
from gradleak.device import DEVICE_TYPES
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation, Reconstruction

BN = nn.modules.batchnorm._BatchNorm
SOURCES = ("readoff", "running")


@dataclass(frozen=True)
class BatchStatistics:
    """Per BatchNorm layer (by module name): the per-channel mean and unbiased variance, and the local
    steps they average over (1: one batch, exact)."""

    mean: Mapping[str, torch.Tensor]
    var: Mapping[str, torch.Tensor]
    steps: int


def batchnorm_layers(model: nn.Module) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    """The model's BatchNorm layers that track running statistics, by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, BN) and m.track_running_stats}


def read_batch_statistics(model: nn.Module, buffers: Mapping[str, torch.Tensor]) -> BatchStatistics:
    """The batch statistics behind a reply's running statistics (module docstring); ``model`` holds what
    the server sent (``r_0``), ``buffers`` what came back. :class:`AttackInputError` when the reply has no
    BatchNorm buffers, no step was taken, steps differ between layers, or a layer uses a cumulative average
    (``momentum=None``)."""
    layers = batchnorm_layers(model)
    if not layers:
        raise AttackInputError("the model has no BatchNorm layer with running statistics")
    mean, var, steps = {}, {}, set()
    for name, layer in layers.items():
        keys = [f"{name}.running_mean", f"{name}.running_var", f"{name}.num_batches_tracked"]
        if any(k not in buffers for k in keys):
            raise AttackInputError(f"the reply carries no running statistics of {name!r} (withheld: FedBN?)")
        if layer.momentum is None or not 0 < float(layer.momentum) <= 1:
            raise AttackInputError(
                f"{name!r} has momentum {layer.momentum!r} (a cumulative average, or none): not read off here"
            )
        assert layer.num_batches_tracked is not None
        k = int(buffers[keys[2]]) - int(layer.num_batches_tracked)
        steps.add(k)
        m = float(layer.momentum)
        decay = (1 - m) ** k
        r0_mean, r0_var = layer.running_mean, layer.running_var
        assert r0_mean is not None and r0_var is not None
        mean[name] = (buffers[keys[0]].double() - decay * r0_mean.double()) / (1 - decay) if k else r0_mean
        var[name] = (buffers[keys[1]].double() - decay * r0_var.double()) / (1 - decay) if k else r0_var
    if len(steps) != 1 or min(steps) < 1:
        raise AttackInputError(
            f"the layers' batch counters moved by {sorted(steps)} steps: need the same k >= 1"
        )
    return BatchStatistics(mean, var, steps.pop())


def running_statistics(model: nn.Module) -> BatchStatistics:
    """GradInversion's targets: the broadcast model's running statistics."""
    layers = batchnorm_layers(model)
    if not layers:
        raise AttackInputError("the model has no BatchNorm layer with running statistics")
    mean = {n: m.running_mean.double() for n, m in layers.items() if m.running_mean is not None}
    var = {n: m.running_var.double() for n, m in layers.items() if m.running_var is not None}
    return BatchStatistics(mean, var, 0)


class StatisticsRecorder:
    """Forward hooks that record each BatchNorm layer's input batch mean and unbiased variance."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.handles = [
            layer.register_forward_hook(self._hook(name)) for name, layer in batchnorm_layers(model).items()
        ]

    def _hook(self, name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        def record(_m: nn.Module, args: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
            x = args[0]
            dims = [0, *range(2, x.dim())]
            self.seen[name] = (x.mean(dim=dims), x.var(dim=dims, unbiased=True))

        return record

    def penalty(self, target: BatchStatistics) -> torch.Tensor:
        """GradInversion's R_BN (Eq. 5) of the last forward pass against ``target``."""
        terms = [
            (mu - target.mean[n].to(mu)).norm() + (v - target.var[n].to(v)).norm()
            for n, (mu, v) in self.seen.items()
        ]
        return torch.stack(terms).sum()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass(frozen=True)
class BNPriorIGConfig(IGConfig):
    """Inverting Gradients' options, plus ``bn_weight`` (the prior's weight) and ``source`` (where the
    prior's targets come from: the reply's buffers, ``"readoff"``, or the broadcast model's running
    statistics, ``"running"``)."""

    bn_weight: float = 1e-2
    source: Literal["readoff", "running"] = "readoff"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (
            isinstance(self.bn_weight, int | float) and math.isfinite(self.bn_weight) and self.bn_weight >= 0
        ):
            raise ValueError(f"bn_weight must be a finite number >= 0, got {self.bn_weight!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")


class BNPriorIG(InvertingGradients):
    """Inverting Gradients with GradInversion's BatchNorm prior; see the module docstring. Needs a client
    that trained in train mode (the statistics are the batch's)."""

    config: BNPriorIGConfig

    def __init__(self, config: BNPriorIGConfig | None = None) -> None:
        super().__init__(config or BNPriorIGConfig())
        self._recorder: StatisticsRecorder | None = None
        self._target_stats: BatchStatistics | None = None

    def prior(self, x: torch.Tensor) -> torch.Tensor:
        if self._recorder is None or self._target_stats is None or not self._recorder.seen:
            return x.new_zeros(())
        return self.config.bn_weight * self._recorder.penalty(self._target_stats).to(x.dtype)

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        if obs.mode != "train":
            raise AttackInputError("the BatchNorm prior needs an update computed in train mode")
        if self.config.source == "readoff":
            target = read_batch_statistics(obs.model, obs.update.buffers)
        else:
            target = running_statistics(obs.model)
        self._target_stats = target
        try:
            rec = super().reconstruct(obs, generator=generator)
        finally:
            if self._recorder is not None:
                self._recorder.remove()
            self._recorder, self._target_stats = None, None
        return dataclasses.replace(rec, stats={**rec.stats, "bn_steps": float(target.steps)})

    def attach(self, model: nn.Module) -> None:
        """Record the statistics of ``model``'s forward passes (called on the attack's copy of the model)."""
        self._recorder = StatisticsRecorder(model)


@dataclass(frozen=True)
class GradInversionConfig(BNPriorIGConfig):
    """:class:`BNPriorIGConfig` with GradInversion's targets (``source = "running"``) and its group:
    ``group`` guesses from different seeds optimised together, ``group_weight`` the weight of the
    consistency term (module docstring)."""

    source: Literal["readoff", "running"] = "running"
    group: int = 4
    group_weight: float = 1e-2

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"group must be an int >= 1, got {self.group!r}")
        if not (isinstance(self.group_weight, int | float) and 0 <= self.group_weight < math.inf):
            raise ValueError(f"group_weight must be a finite number >= 0, got {self.group_weight!r}")


class GradInversion(BNPriorIG):
    """Yin et al. 2021: Inverting Gradients' matching with the BatchNorm prior and group consistency over
    ``group`` seeds (module docstring). Threat model: an honest-but-curious server that knows the labels
    (granted, or recovered from the output layer) and the client's mode (train, so BatchNorm normalises
    with the batch's statistics); its BatchNorm targets come from the model it broadcast (``running``)
    or from a FedAvg reply's buffers (``readoff``)."""

    config: GradInversionConfig
    label = "GradInversion"

    def __init__(self, config: GradInversionConfig | None = None) -> None:
        super().__init__(config or GradInversionConfig())

    @property
    def guesses(self) -> int:  # type: ignore[override]
        return self.config.group

    def group_term(self, xs: list[torch.Tensor]) -> torch.Tensor | float:
        """``group_weight * sum_g ||x_g - E(x)||^2`` (per image, averaged over the batch), ``E`` the guesses'
        pixel-wise mean, detached (module docstring)."""
        consensus = torch.stack([x.detach() for x in xs]).mean(dim=0)
        total: torch.Tensor | float = 0.0
        for x in xs:
            total = total + self.config.group_weight * (x - consensus).pow(2).sum(dim=(1, 2, 3)).mean()
        return total

    def finished(self, guesses: list[torch.Tensor]) -> None:
        consensus = torch.stack(guesses).mean(dim=0)
        self.last_spread = float(torch.stack([(x - consensus).pow(2).mean() for x in guesses]).mean())

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        self.last_spread = math.nan
        rec = super().reconstruct(obs, generator=generator)
        return dataclasses.replace(rec, stats={**rec.stats, "group_spread": self.last_spread})


ATTACKS.register(
    "gradinversion",
    GradInversion,
    config_cls=GradInversionConfig,
    summary="GradInversion: IG + BatchNorm prior (running statistics) + group consistency (Yin et al. 2021)",
    modality="image",
    devices=DEVICE_TYPES,
)
ATTACKS.register(
    "ig_bn",
    BNPriorIG,
    config_cls=BNPriorIGConfig,
    summary="IG + GradInversion's BatchNorm prior, targets read off the reply's buffers (Yin et al. 2021)",
    modality="image",
    devices=DEVICE_TYPES,
)

__all__ = [
    "BNPriorIG",
    "GradInversion",
    "GradInversionConfig",
    "BNPriorIGConfig",
    "BatchStatistics",
    "StatisticsRecorder",
    "batchnorm_layers",
    "read_batch_statistics",
    "running_statistics",
]
