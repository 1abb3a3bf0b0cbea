"""The client's classification loss (``LocalTraining.loss``), registered in :data:`gradleak.registry.LOSSES`.

Each entry is ``factory(logits, target) -> scalar``: ``target`` is the int64 labels ``(B,)`` or a
``(B, K)`` probability matrix (DLG's soft labels), and the loss is the batch mean.

- ``cross_entropy``: the softmax cross-entropy every gradleak client trains with by default.
- ``mse``: the squared distance between the softmax output and the one-hot label, averaged over the batch
  and the classes (PyTorch's ``mse_loss`` default). Eloul et al. (arXiv 2204.12495) pair an MSE loss with
  same-label batches (:mod:`gradleak.tasks.batching`) so that the last dense layer's per-sample gradients
  overlap instead of de-mixing as under cross-entropy; the paper does not pin down the MSE's input here,
  and softmax probabilities against one-hot targets is our reading.

:func:`criterion` gives the loss an observation's recipe states: the attacks that differentiate the
client's loss use it, so an attacker who knows the recipe (the public-recipe threat model) matches the
gradient of the loss the client trained with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from gradleak.registry import LOSSES
from gradleak.update import DEFAULT_LOSS, LocalTraining

Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target)


def softmax_mse(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of ``softmax(logits)`` against the one-hot ``target`` (or a probability matrix)."""
    probs = F.softmax(logits, dim=-1)
    if not target.is_floating_point():
        target = F.one_hot(target, probs.shape[-1]).to(probs.dtype)
    return F.mse_loss(probs, target)


LOSSES.register("cross_entropy", lambda: cross_entropy, summary="softmax cross-entropy (the default)")
LOSSES.register(
    "mse", lambda: softmax_mse, summary="MSE of the softmax against one-hot labels (Eloul et al. 2022)"
)


def criterion(training: LocalTraining | None) -> Criterion:
    """The loss of ``training`` (cross-entropy where the recipe is hidden: the common case)."""
    return LOSSES.create(DEFAULT_LOSS if training is None else training.loss)
