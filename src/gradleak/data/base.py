"""The in-memory image dataset every loader returns."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ImageDataset:
    """Images ``(N, C, H, W)`` float32 in [0, 1] with int64 labels ``(N,)``.

    ``groups`` (optional, ``(N,)`` int64) gives each sample's natural owner, e.g. the FEMNIST writer,
    for the natural partitioner.
    """

    name: str
    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    groups: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.images.dim() != 4:
            raise ValueError(f"{self.name}: images must be (N, C, H, W), got {tuple(self.images.shape)}")
        if self.images.dtype != torch.float32:
            raise ValueError(f"{self.name}: images must be float32, got {self.images.dtype}")
        if self.labels.shape != (self.images.shape[0],) or self.labels.dtype != torch.int64:
            raise ValueError(f"{self.name}: labels must be int64 of shape ({self.images.shape[0]},)")
        if self.groups is not None and self.groups.shape != self.labels.shape:
            raise ValueError(f"{self.name}: groups must have the labels' shape")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def input_shape(self) -> tuple[int, int, int]:
        c, h, w = self.images.shape[1:]
        return (int(c), int(h), int(w))

    def subset(self, indices: np.ndarray | torch.Tensor | list[int]) -> ImageDataset:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        groups = None if self.groups is None else self.groups[idx]
        return ImageDataset(self.name, self.images[idx], self.labels[idx], self.num_classes, groups)
