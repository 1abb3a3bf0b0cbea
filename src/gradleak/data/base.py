"""The in-memory image dataset every loader returns."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ImageDataset:
    """Images ``(N, C, H, W)`` float32 in [0, 1] with int64 labels ``(N,)``.

    The pixel range is checked: attacks reconstruct pixels in [0, 1] and metrics score them there, so a
    loader that returns normalised images (mean 0, std 1) is refused rather than silently mis-scored; a
    model that expects normalised input normalises inside its ``forward`` (as a first layer).

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
        if self.images.numel():
            low, high = float(self.images.min()), float(self.images.max())
            if not (0.0 <= low and high <= 1.0):  # also NaN
                raise ValueError(
                    f"{self.name}: images must be pixels in [0, 1], got values in [{low:.4g}, {high:.4g}]; "
                    "a model that expects normalised inputs should normalise inside its forward"
                )
        if self.labels.shape != (self.images.shape[0],) or self.labels.dtype != torch.int64:
            raise ValueError(f"{self.name}: labels must be int64 of shape ({self.images.shape[0]},)")
        if self.groups is not None and self.groups.shape != self.labels.shape:
            raise ValueError(f"{self.name}: groups must have the labels' shape")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def inputs(self) -> torch.Tensor:
        """The model inputs (the images), as ``TokenDataset.inputs`` gives the token ids."""
        return self.images

    @property
    def input_shape(self) -> tuple[int, int, int]:
        c, h, w = self.images.shape[1:]
        return (int(c), int(h), int(w))

    @staticmethod
    def concat(parts: Sequence[ImageDataset]) -> ImageDataset:
        """The data sets one after the other (the data behind an aggregate of clients); groups dropped."""
        if not parts:
            raise ValueError("nothing to concatenate")
        images, labels = torch.cat([p.images for p in parts]), torch.cat([p.labels for p in parts])
        return ImageDataset(parts[0].name, images, labels, parts[0].num_classes)

    @staticmethod
    def from_batches(name: str, batches: Iterable[object], num_classes: int) -> ImageDataset:
        """The samples of a user's own data loader: batches of ``(images, labels)`` or mappings with one
        ``(B, C, H, W)`` float tensor and one ``(B,)`` integer tensor (e.g. ``{"img": ..., "label": ...}``,
        as Flower's quickstart loaders yield), in [0, 1] like every ``ImageDataset``."""
        images, labels = [], []
        for k, batch in enumerate(batches):
            values = list(batch.values()) if isinstance(batch, Mapping) else batch
            if not isinstance(values, list | tuple):
                raise ValueError(f"{name}: batch {k} is a {type(batch).__name__}, not (images, labels)")
            tensors = [v for v in values if isinstance(v, torch.Tensor)]
            x = [t for t in tensors if t.dim() == 4 and t.is_floating_point()]
            y = [t for t in tensors if t.dim() == 1 and not t.is_floating_point()]
            if len(x) != 1 or len(y) != 1:
                raise ValueError(
                    f"{name}: batch {k} needs one (B, C, H, W) float tensor and one (B,) integer tensor, "
                    f"got shapes {[tuple(t.shape) for t in tensors]}"
                )
            images.append(x[0].detach().cpu().float())
            labels.append(y[0].detach().cpu().long())
        if not images:
            raise ValueError(f"{name}: the loader gave no batches")
        return ImageDataset(name, torch.cat(images), torch.cat(labels), num_classes)

    def subset(self, indices: np.ndarray | torch.Tensor | list[int]) -> ImageDataset:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        groups = None if self.groups is None else self.groups[idx]
        return ImageDataset(self.name, self.images[idx], self.labels[idx], self.num_classes, groups)
