"""Minimal, real baseline defenses for paper 000's Table 1 timing comparison (GC, GD/DP, Soteria).

- ``compression`` (gradient compression, "GC"): each step's gradient is sparsified to its top ``ratio``
  fraction of entries by magnitude per tensor, the dropped remainder is kept locally and added to the next
  step's gradient (error feedback, as in Deep Gradient Compression, Lin et al. ICLR 2018).
- ``batch_noise`` (gradient-descent noise, "GD" in paper 000's Table 1; formerly ``dp_noise``): each step's
  mini-batch gradient is clipped to global norm ``clip`` and Gaussian noise ``N(0, (sigma * clip / B)^2)``
  is added, drawn from the client's ``torch.Generator``. It is **not DP-SGD**: the clipping bounds the batch
  gradient, not each sample's, so no epsilon follows from it. DP-SGD with per-sample clipping and an
  accountant is ``dp_sgd`` (:mod:`gradleak.defenses.dp_sgd`, through Opacus).
- ``soteria`` (Sun et al., CVPR 2021): for the representation ``r`` (here the input of the layer
  ``consumer``, the FC-512 output on ``aegis_cnn``), compute per feature ``i`` the ratio
  ``||r_i|| / ||dr_i / dX||`` over the current batch ``X`` and zero the gradient columns of ``consumer`` for
  the ``percent`` % of features with the smallest ratio (the most input-revealing ones). The batch is
  captured by a forward pre-hook. **Deviation**: ``||dr_i/dX||`` is estimated from ``probes`` random
  forward-mode Jacobian-vector products (Hutchinson), not computed exactly with one backward pass per
  feature as Sun et al. do; exact is ~500 backward passes per step on FC-512.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

from gradleak.defenses.base import NOISE_STD, Defense, SetupContext
from gradleak.device import normal
from gradleak.registry import DEFENSES
from gradleak.types import Update


@dataclass(frozen=True)
class CompressionConfig:
    ratio: float = 0.1  # fraction of entries kept per tensor and step
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"compression ratio must be in (0, 1], got {self.ratio}")


class Compression(Defense):
    name = "compression"

    def __init__(self, config: CompressionConfig | None = None) -> None:
        self.config = config or CompressionConfig()
        self.residual: dict[str, torch.Tensor] = {}

    def setup(self, model: nn.Module, context: SetupContext) -> None:
        self.residual = {}

    @torch.no_grad()
    def on_gradients(self, model: nn.Module, step: int) -> None:
        for n, p in model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad + self.residual.get(n, 0.0)
            flat = g.reshape(-1)
            k = max(1, math.ceil(self.config.ratio * flat.numel()))
            keep = torch.zeros_like(flat, dtype=torch.bool)
            keep[flat.abs().topk(k).indices] = True
            sparse = torch.where(keep, flat, torch.zeros_like(flat)).reshape(g.shape)
            if self.config.error_feedback:
                self.residual[n] = g - sparse
            p.grad.copy_(sparse)


@dataclass(frozen=True)
class BatchNoiseConfig:
    clip: float = 1.0
    sigma: float = 1.0  # noise multiplier
    batch_size: int = 64  # B in the noise scale sigma * clip / B

    def __post_init__(self) -> None:
        if not (0 < self.clip < math.inf and 0 <= self.sigma < math.inf and self.batch_size >= 1):
            raise ValueError(f"need finite clip > 0, finite sigma >= 0, batch_size >= 1; got {self}")


class BatchNoise(Defense):
    name = "batch_noise"

    def __init__(self, config: BatchNoiseConfig | None = None) -> None:
        self.config = config or BatchNoiseConfig()
        self.generator: torch.Generator | None = None
        self.steps = 0  # noised steps of this local training run

    def setup(self, model: nn.Module, context: SetupContext) -> None:
        generator = context.generator
        self.generator = generator
        self.steps = 0

    @torch.no_grad()
    def on_gradients(self, model: nn.Module, step: int) -> None:
        if self.generator is None:
            raise RuntimeError("batch_noise needs setup() before on_gradients()")
        self.steps += 1
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.sqrt(sum((g.pow(2).sum() for g in grads), torch.tensor(0.0)))  # 0-dim: any device
        factor = min(1.0, self.config.clip / (float(norm) + 1e-12))
        std = self.config.sigma * self.config.clip / self.config.batch_size
        for g in grads:
            g.mul_(factor).add_(normal(g.shape, self.generator, g) * std)

    def on_update(self, update: Update) -> Update:
        """A FedSGD gradient of one noised step carries its noise scale (``batch_noise/noise_std``); after
        several steps or an optimizer's step the noise in the update has no single stated scale."""
        if update.kind != "gradient" or self.steps != 1:
            return update
        std = self.config.sigma * self.config.clip / self.config.batch_size
        meta = {**update.metadata, f"{self.name}/{NOISE_STD}": std}
        return Update(update.tensors, update.num_samples, update.kind, meta)


@dataclass(frozen=True)
class SoteriaConfig:
    consumer: str = "classifier.3"  # the layer whose input is the representation (aegis_cnn: after FC-512)
    input_module: str | None = (
        None  # None: X is the model's first positional input; else this module's output
    )
    percent: float = 80.0  # % of representation features whose gradient columns are zeroed
    probes: int = 16  # random Jacobian-vector products estimating ||dr_i/dX||

    def __post_init__(self) -> None:
        if not 0.0 <= self.percent < 100.0:
            raise ValueError(f"percent must be in [0, 100), got {self.percent}")
        if self.probes < 1:
            raise ValueError(f"probes must be >= 1, got {self.probes}")


class Soteria(Defense):
    name = "soteria"

    def __init__(self, config: SoteriaConfig | None = None) -> None:
        self.config = config or SoteriaConfig()
        self._call: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._rep: torch.Tensor | None = None
        self._probing = False
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def setup(self, model: nn.Module, context: SetupContext) -> None:
        generator = context.generator
        modules = dict(model.named_modules())
        consumer = modules.get(self.config.consumer)
        if not isinstance(consumer, nn.Linear):
            raise ValueError(f"soteria: {self.config.consumer!r} is not a Linear layer of this model")
        self.consumer = consumer
        self._generator = generator
        for h in self._handles:
            h.remove()
        self._handles = [model.register_forward_pre_hook(self._keep_call, with_kwargs=True)]
        self._handles.append(consumer.register_forward_pre_hook(self._keep_rep))
        if self.config.input_module is not None:
            source = modules.get(self.config.input_module)
            if source is None:
                raise ValueError(f"soteria: no module named {self.config.input_module!r}")
            self._handles.append(source.register_forward_hook(self._inject_tangent))

    def _keep_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._probing:  # the training forward, not the probe replay
            self._call = (args, kwargs)

    def _keep_rep(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self._rep = args[0]

    def _inject_tangent(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
        if not self._probing:
            return None
        v = normal(output.shape, self._generator, output)
        return fwAD.make_dual(output, v)

    def ratios(self, model: nn.Module, x: torch.Tensor | None = None) -> torch.Tensor:
        """``||r_i|| / ||dr_i/dX||`` per representation feature on the batch ``x`` (default: the last one).

        ``||dr_i/dX||_F^2 = E_v ||(dr_i/dX) v||^2`` for ``v ~ N(0, I)``: ``probes`` forward-mode
        Jacobian-vector products (one batched forward pass) estimate every feature's norm at once, where
        the exact value needs one backward pass per feature (Sun et al. loop over features).
        """
        k, gen = self.config.probes, self._generator
        if self.config.input_module is None:
            if x is None:
                if self._call is None or not self._call[0]:
                    raise RuntimeError("soteria saw no forward pass with a positional input")
                x = self._call[0][0]
            assert x is not None
            xs = x.detach().repeat(k, *([1] * (x.dim() - 1)))
            v = normal(xs.shape, gen, xs, dtype=xs.dtype)
            with torch.no_grad(), fwAD.dual_level():
                self._probing = True
                try:
                    model(fwAD.make_dual(xs, v))
                finally:
                    self._probing = False
                primal, tangent = fwAD.unpack_dual(self._probe_rep())
            n = len(x)
        else:
            if self._call is None:
                raise RuntimeError("soteria saw no forward pass")
            kwargs = {key: _repeat(val, k) for key, val in self._call[1].items() if key != "labels"}
            args = tuple(_repeat(a, k) for a in self._call[0])
            with torch.no_grad(), fwAD.dual_level():
                self._probing = True
                try:
                    model(*args, **kwargs)
                finally:
                    self._probing = False
                primal, tangent = fwAD.unpack_dual(self._probe_rep())
            n = primal.shape[0] // k
        r = primal[:n].reshape(-1, primal.shape[-1])
        jac_sq = tangent.reshape(-1, tangent.shape[-1]).pow(2).sum(dim=0) / k  # (features,)
        self._rep = None
        return r.norm(dim=0) / jac_sq.sqrt().clamp_min(1e-12)

    def _probe_rep(self) -> torch.Tensor:
        rep = self._rep
        if rep is None:
            raise RuntimeError(f"soteria: the forward pass never reached {self.config.consumer!r}")
        return rep

    @torch.no_grad()
    def on_gradients(self, model: nn.Module, step: int, **_: Any) -> None:
        if self._call is None:
            raise RuntimeError("soteria saw no forward pass")
        grad = self.consumer.weight.grad
        if grad is None:
            raise RuntimeError(f"soteria: {self.config.consumer!r} has no gradient")
        ratio = self.ratios(model)
        k = int(self.config.percent / 100 * len(ratio))
        if k:
            grad[:, ratio.argsort()[:k]] = 0.0


def _repeat(value: Any, k: int) -> Any:
    """Batch tensors stacked ``k`` times along dim 0 (other call arguments unchanged)."""
    return (
        value.repeat(k, *([1] * (value.dim() - 1)))
        if isinstance(value, torch.Tensor) and value.dim()
        else value
    )


class NoDefense(Defense):
    """No defense: a grid's baseline cell (every hook a no-op; the update leaves as trained)."""

    name = "none"


DEFENSES.register("none", NoDefense, summary="no defense: the baseline cell of a grid")
DEFENSES.register("compression", Compression, config_cls=CompressionConfig,
                  summary="top-k gradient sparsification each step with error feedback (GC)")  # fmt: skip
DEFENSES.register("batch_noise", BatchNoise, config_cls=BatchNoiseConfig,
                  summary="clip the batch gradient, add Gaussian noise each step (no epsilon)")  # fmt: skip
DEFENSES.rename("dp_noise", "batch_noise",
                "it clips the batch gradient, not each sample's: not DP-SGD, which is dp_sgd")  # fmt: skip
DEFENSES.register("soteria", Soteria, config_cls=SoteriaConfig,
                  summary="prune the representation gradient by ||r||/||dr/dX|| (Sun et al.)")  # fmt: skip
