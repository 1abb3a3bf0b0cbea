"""Aegis (paper 000): per-epoch large logical-batch masking with a task-relevant synthetic cache.

Algorithm 1 of paper 000: after the real mini-batches of every local epoch, the client takes **one** extra
optimiser step on the mean gradient over its whole synthetic cache ``D_i'`` (``M_i = 2048`` by default),
computed at the current parameters; after ``E`` epochs it sends the ordinary delta ``w_T - w_0``
("Protocol-Compatible Accumulated Update": nothing new crosses the wire, the cache stays local).

Logical batch: the cache is split into micro-batches; each adds ``sum_n loss_n / M`` to the gradients, all at
fixed parameters, and the optimiser steps once afterwards, so the step uses exactly the full-batch mean
gradient (up to float rounding) for a sample-decomposable loss. Layers whose training-mode output depends
on the batch (BatchNorm) break that equivalence; they are refused unless ``micro_batch >= M``.

Normalisation (paper 000 uses two descriptions and does not reconcile them):

- ``"same_lr"`` (Algorithm 1 read literally): the synthetic step applies the cache's *mean* gradient with the
  client's optimiser and learning rate, like a real mini-batch step. A synthetic sample then weighs
  ``1/M`` against a real sample's ``1/B``.
- ``"lambda"`` (the analysis, Appendix G: ``g~ = (1 - lambda) g + lambda g'``, ``lambda = M / (B + M)``): the
  synthetic gradient is weighted ``lambda / (1 - lambda) = M / B`` relative to a real step's gradient, so
  every real and synthetic sample carries the same weight, as in one batch of ``B + M``. Real steps are
  left unchanged. **Default**: it is the reading under which synthetic samples actually mix with real ones
  in a linear-leakage bin (docs/defenses.md gives the measurements for both).

Fail closed: a missing cache, a cache whose image shape differs from the real batches' (recorded by a
forward pre-hook during the first epoch), or a non-finite gradient
raises, and :class:`~gradleak.defenses.base.DefenseChain` withholds the update.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from gradleak.defenses.aegis_cache import SyntheticCache
from gradleak.defenses.base import Defense
from gradleak.registry import DEFENSES
from gradleak.types import Update

log = logging.getLogger(__name__)

NORMALISATIONS = ("lambda", "same_lr")


@dataclass(frozen=True)
class AegisConfig:
    """``cache_size`` M (the cache must hold at least M images; the first M are used); ``micro_batch``
    images per forward/backward; ``normalization`` ``"lambda"`` | ``"same_lr"``; ``real_batch_size`` B in
    ``lambda = M / (B + M)``."""

    cache_size: int = 2048
    micro_batch: int = 256
    normalization: str = "lambda"
    real_batch_size: int = 64

    def __post_init__(self) -> None:
        for key in ("cache_size", "micro_batch", "real_batch_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} must be an int >= 1, got {v!r}")
        if self.normalization not in NORMALISATIONS:
            raise ValueError(f"normalization must be one of {NORMALISATIONS}, got {self.normalization!r}")

    @property
    def lam(self) -> float:
        return self.cache_size / (self.real_batch_size + self.cache_size)

    @property
    def synthetic_weight(self) -> float:
        """Factor on the cache's mean gradient: ``M / B`` (lambda) or 1 (same_lr)."""
        return self.lam / (1 - self.lam) if self.normalization == "lambda" else 1.0


def batch_dependent(model: nn.Module) -> list[str]:
    return [
        n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]


def accumulate_mean_gradient(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, micro_batch: int, weight: float = 1.0
) -> float:
    """Set ``p.grad = weight * d/dw mean_n CE(model(x_n), y_n)`` over all ``images``, in micro-batches at
    fixed parameters; returns the mean loss."""
    n = len(images)
    for p in model.parameters():
        p.grad = None
    total = 0.0
    for x, y in zip(images.split(micro_batch), labels.split(micro_batch), strict=True):
        loss = F.cross_entropy(model(x), y, reduction="sum")
        (loss * (weight / n)).backward()
        total += float(loss.detach())
    return total / n


class AegisSynthetic(Defense):
    """The Aegis defense for one client; bind its offline-built cache with :meth:`bind` (or the
    constructor) before local training. ``DEFENSES.create("aegis", ...)`` returns an unbound instance,
    which fails closed in ``setup`` until a cache is bound."""

    name = "aegis"

    def __init__(self, config: AegisConfig | None = None, cache: SyntheticCache | None = None) -> None:
        self.config = config or AegisConfig()
        self.cache: SyntheticCache | None = None
        self.steps = 0
        self.last_loss = math.nan
        self._real_shape: tuple[int, ...] | None = None
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        if cache is not None:
            self.bind(cache)

    def bind(self, cache: SyntheticCache) -> AegisSynthetic:
        if len(cache) < self.config.cache_size:
            raise ValueError(f"cache holds {len(cache)} images, Aegis needs M = {self.config.cache_size}")
        self.cache = cache
        return self

    def setup(self, model: nn.Module, *, generator: torch.Generator) -> None:
        if self.cache is None:
            raise RuntimeError(
                "aegis has no synthetic cache: build one (defenses.aegis_cache.build_cache) and bind it"
            )
        bad = batch_dependent(model)
        if bad and self.config.micro_batch < self.config.cache_size:
            raise RuntimeError(f"batch-dependent layers {bad[:3]} break micro-batch accumulation")
        self.steps = 0
        self._real_shape = None
        self._hook = model.register_forward_pre_hook(self._record_shape)

    def _record_shape(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if self._real_shape is None and args and isinstance(args[0], torch.Tensor):
            self._real_shape = tuple(args[0].shape[1:])

    def on_epoch_end(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.cache is None:
            raise RuntimeError("aegis has no synthetic cache")
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        m = self.config.cache_size
        images, labels = self.cache.images[:m], self.cache.labels[:m]
        if self._real_shape is not None and tuple(images.shape[1:]) != self._real_shape:
            raise ValueError(f"cache images are {tuple(images.shape[1:])}, the task's are {self._real_shape}")
        optimizer.zero_grad(set_to_none=True)
        self.last_loss = accumulate_mean_gradient(
            model, images, labels, self.config.micro_batch, self.config.synthetic_weight
        )
        for n, p in model.named_parameters():
            if p.grad is not None and not torch.isfinite(p.grad).all():
                raise FloatingPointError(f"non-finite synthetic gradient in {n}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        log.debug("aegis: synthetic step %d, mean loss %.4f", self.steps, self.last_loss)

    def on_update(self, update: Update) -> Update:
        """Fail closed when no synthetic step ran (e.g. FedSGD, which has no local epochs): the update
        would leave unmasked. Otherwise the ordinary delta goes out unchanged."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.steps == 0:
            raise RuntimeError("aegis took no synthetic step (FedSGD has no epochs); update withheld")
        return update


def aegis_for_client(cache: SyntheticCache, **options: object) -> AegisSynthetic:
    """A client's Aegis defense from config options (as ``DEFENSES.create``) and its own cache."""
    defense: AegisSynthetic = DEFENSES.create("aegis", **options)
    return defense.bind(cache)


DEFENSES.register(
    "aegis",
    AegisSynthetic,
    config_cls=AegisConfig,
    summary="Aegis (paper 000): per-epoch synthetic logical-batch step; needs a client-built cache",
)
