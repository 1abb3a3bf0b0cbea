"""Conditional image generators for Aegis' task-relevant synthetic cache (paper 000, "Task-Relevant
Synthetic Cache").

A :class:`ConditionalGenerator` maps class labels to images aligned with the task: ``(N, C, H, W)`` float32
in [0, 1], the client's size and channel layout. Paper 000 samples its cache from a conditional generator
driven by locally visible labels (default Stable Diffusion 2.0,
:mod:`gradleak.defenses.aegis.generators.diffusers_adapter`)
and allows generators adapted on a sanctioned client-side split
(:mod:`gradleak.defenses.aegis.generators.gaussian`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch.nn import functional as F

if TYPE_CHECKING:
    from gradleak.data.base import ImageDataset


class GeneratorRefusal(ValueError):
    """A generator that will not serve this client as configured (e.g. an oracle whose public split holds
    the client's own images): Aegis fails closed with the reason."""


@runtime_checkable
class ConditionalGenerator(Protocol):
    """labels ``(N,)`` int64 -> images ``(N, *image_shape)`` float32 in [0, 1]."""

    image_shape: tuple[int, int, int]
    num_classes: int

    def sample(self, labels: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor: ...


@runtime_checkable
class Fingerprinted(Protocol):
    """A generator whose samples are not fixed by its training data and options alone (weights reloaded from
    a store, possibly trained on another device; a shared pool's draws): ``fingerprint()`` names what it
    samples from, so that a cache built from it is stored under a name no other generator shares."""

    def fingerprint(self) -> str: ...


def fingerprint(source: object) -> str:
    """``source.fingerprint()`` where it has one (:class:`Fingerprinted`), else ``""``."""
    return source.fingerprint() if isinstance(source, Fingerprinted) else ""


@dataclass(frozen=True)
class PublicSplit:
    """A sanctioned public split a generator may use instead of (or as) real images the client does not
    hold: a registered data set's ``split``, its first ``limit`` images (None: all). Paper 000 (Appendix
    F.1) allows generators "adapted on a sanctioned client-side training split"; one generator fit on a
    public split may serve every client, one fit on a client's own share never leaves it."""

    dataset: str = ""
    split: str = "val"
    limit: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str) or not isinstance(self.split, str) or not self.split:
            raise ValueError(
                f"public split needs a data set and split name, got {self.dataset!r}/{self.split!r}"
            )
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"public split limit must be an int >= 1 or None, got {self.limit!r}")

    @property
    def named(self) -> bool:
        return bool(self.dataset)

    def load(self, root: str | os.PathLike[str] | None = None) -> ImageDataset:
        """The split, loaded by :func:`gradleak.data.load_dataset` from the data ``root`` (the experiment's
        ``data_root``, which a defense gets in its setup context; None: ``$GRADLEAK_DATA`` or
        ``../shared/data``)."""
        from gradleak.data import load_dataset

        if not self.named:
            raise ValueError("no public split named: set public = { dataset = ..., split = ... }")
        data: ImageDataset = load_dataset(self.dataset, self.split, root=root, limit=self.limit)
        return data

    def load_for(self, client: ImageDataset, root: str | os.PathLike[str] | None = None) -> ImageDataset:
        """The split under ``root``, checked to fit the client's task (image shape and classes)."""
        pool = self.load(root)
        if pool.input_shape != client.input_shape or pool.num_classes != client.num_classes:
            raise ValueError(
                f"public split {self.dataset}/{self.split} has {pool.input_shape} images of "
                f"{pool.num_classes} classes; the client's are {client.input_shape} of {client.num_classes}"
            )
        return pool


def data_digest(data: ImageDataset) -> bytes:
    """A hash of a data set's images and labels (a content key: memo and file names; never sent anywhere)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((tuple(data.images.shape), data.num_classes)).encode())
    h.update(data.images.detach().to(torch.float32).contiguous().numpy().tobytes())
    h.update(data.labels.detach().to(torch.int64).contiguous().numpy().tobytes())
    return h.digest()


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
