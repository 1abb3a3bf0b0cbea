"""Conditional image generators for Aegis' task-relevant synthetic cache (paper 000, "Task-Relevant
Synthetic Cache").

A :class:`ConditionalGenerator` maps class labels to images aligned with the task: ``(N, C, H, W)`` float32
in [0, 1], the client's size and channel layout. Paper 000 samples its cache from a conditional generator
driven by locally visible labels (default Stable Diffusion 2.0, :mod:`gradleak.generators.diffusers_adapter`)
and allows generators adapted on a sanctioned client-side split (:mod:`gradleak.generators.gaussian`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch.nn import functional as F


@runtime_checkable
class ConditionalGenerator(Protocol):
    """labels ``(N,)`` int64 -> images ``(N, *image_shape)`` float32 in [0, 1]."""

    image_shape: tuple[int, int, int]
    num_classes: int

    def sample(self, labels: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor: ...


def align_images(images: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """Resize (bilinear, antialiased), convert channels (RGB mean -> grey, grey -> repeated RGB) and clamp
    to [0, 1] so that generated images match the task's ``(C, H, W)``."""
    if images.dim() != 4:
        raise ValueError(f"images must be (N, C, H, W), got {tuple(images.shape)}")
    c, h, w = shape
    x = images.to(torch.float32)
    if tuple(x.shape[-2:]) != (h, w):
        x = F.interpolate(x, size=(h, w), mode="bilinear", antialias=True, align_corners=False)
    if x.shape[1] != c:
        if c == 1:
            x = x.mean(dim=1, keepdim=True)
        elif x.shape[1] == 1:
            x = x.expand(-1, c, -1, -1)
        else:
            raise ValueError(f"cannot map {x.shape[1]} channels to {c}")
    return x.clamp(0.0, 1.0).contiguous()


def check_labels(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    if labels.dim() != 1 or labels.dtype != torch.int64:
        raise ValueError(f"labels must be a 1-D int64 tensor, got {labels.dtype} {tuple(labels.shape)}")
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{labels.min()}, {labels.max()}]")
    return labels
