"""A pool of samples from a public generator, sampled once and drawn from by every client (issue 22).

A generator fit on a sanctioned public split may serve every client (paper 000 Appendix F.1;
:class:`~gradleak.defenses.aegis.generators.PublicSplit`). With the diffusion generator the cost of Aegis is
then its sampling: about 2,200 candidates per client for M = 2,048 (2 minutes on 2 cores, docs/defenses.md),
for each of a federation's 100 clients. A :class:`SamplePool` samples ``per_class`` images of every class the
generator knows once (seeded, saved as safetensors and reused by content); each client's :class:`PoolDraws`
hands out the pool's images of a requested class without replacement, in an order drawn from the client's own
seed, so one client's cache never holds an image twice while different clients' caches overlap.

Threat model: the pool is a federation secret. A server that holds it can recognise the synthetic member of a
mixed bin (and subtract it), which a server that only knows the public generator cannot, since it does not
know the clients' draws. Build the pool where the clients are, never on the server.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from gradleak.defenses.aegis.generators.base import ConditionalGenerator, check_labels
from gradleak.progress import bar
from gradleak.update_io import read_keyed, tensor_digest, write_keyed

log = logging.getLogger(__name__)

FORMAT = "gradleak-sample-pool/1"


class PoolExhausted(RuntimeError):
    """A client asked for more images of a class than the pool holds."""


class SamplePool:
    """``images (N, C, H, W)`` float32 in [0, 1] with their ``labels (N,)`` in [0, ``num_classes``): the
    samples of each class, class by class (checked on construction)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, num_classes: int, info: dict[str, Any]):
        if images.dim() != 4 or images.dtype != torch.float32 or labels.shape != (len(images),):
            raise ValueError(f"a pool needs float32 (N, C, H, W) images and (N,) labels, got {images.dtype} "
                             f"{tuple(images.shape)} and {tuple(labels.shape)}")  # fmt: skip
        check_labels(labels, num_classes)
        if not bool(torch.isfinite(images).all()) or float(images.min()) < 0 or float(images.max()) > 1:
            raise ValueError("pool images must be finite and in [0, 1]")
        self.images, self.labels = images, labels
        self.num_classes = num_classes
        self.image_shape: tuple[int, int, int] = (images.shape[1], images.shape[2], images.shape[3])
        self.info = dict(info)
        self._digest: str | None = None

    @staticmethod
    def layout(classes: list[int], per_class: int) -> torch.Tensor:
        """The labels of a pool of ``per_class`` images of each of ``classes``, class by class."""
        return torch.tensor(sorted(classes), dtype=torch.int64).repeat_interleave(per_class)

    @classmethod
    def draw(
        cls,
        source: ConditionalGenerator,
        classes: list[int],
        per_class: int,
        *,
        generator: torch.Generator,
        chunk: int = 256,
    ) -> SamplePool:
        """``per_class`` samples of each of ``classes`` from ``source``, in chunks of ``chunk`` labels (class
        by class), every draw from ``generator``."""
        if per_class < 1 or not classes:
            raise ValueError(f"a pool needs classes and per_class >= 1, got {classes} x {per_class}")
        labels = cls.layout(classes, per_class)
        start = time.perf_counter()
        parts = []
        with bar(desc="sample pool", total=len(labels), unit="img") as progress:
            for y in labels.split(chunk):
                parts.append(source.sample(y, generator=generator))
                progress.update(len(y))
        seconds = time.perf_counter() - start
        log.info("sample pool: %d images (%d per class) in %.1fs, once", len(labels), per_class, seconds)
        return cls(torch.cat(parts), labels, source.num_classes, {"pool_per_class": per_class})

    def digest(self) -> str:
        """A hash of the images and labels (stored with them, checked on load), computed once: a pool is
        not changed after construction."""
        if self._digest is None:
            self._digest = tensor_digest(self.images, self.labels)
        return self._digest

    def save(self, path: Path, key: str) -> Path:
        """Write images and labels, with ``key`` (what the pool was drawn from) and their digest as
        metadata, atomically."""
        meta = {"num_classes": str(self.num_classes), "info": json.dumps(self.info)}
        tensors = {"images": self.images, "labels": self.labels}
        return write_keyed(path, tensors, format=FORMAT, key=key, meta=meta)

    @classmethod
    def load(cls, path: Path, key: str, labels: torch.Tensor | None = None) -> SamplePool:
        """A pool written by :meth:`save` for the same ``key`` whose content matches its digest (and, given,
        the expected ``labels``); ValueError for any other file."""
        tensors, meta = read_keyed(path, format=FORMAT, key=key, what="sample pool")
        pool = cls(tensors["images"], tensors["labels"], int(meta["num_classes"]), json.loads(meta["info"]))
        if labels is not None and not torch.equal(pool.labels, labels):
            raise ValueError(f"{path}: the pool's classes or per-class size are not the ones asked for")
        return pool


class PoolDraws:
    """One client's view of a :class:`SamplePool`, a
    :class:`~gradleak.defenses.aegis.generators.ConditionalGenerator`:
    the pool's images of each requested class without replacement, in a per-class order drawn once from
    ``generator`` (the client's seed). ``sample``'s own generator is not consumed."""

    def __init__(self, pool: SamplePool, *, generator: torch.Generator, info: dict[str, Any] | None = None):
        self.pool = pool
        self.image_shape = pool.image_shape
        self.num_classes = pool.num_classes
        self.info = {**(info or {}), **pool.info}
        self._order: dict[int, torch.Tensor] = {}
        for c in pool.labels.unique().tolist():
            of_c = torch.nonzero(pool.labels == c).flatten()
            self._order[int(c)] = of_c[torch.randperm(len(of_c), generator=generator)]
        self._used = dict.fromkeys(self._order, 0)

    def fingerprint(self) -> str:
        """The pool's digest (:class:`~gradleak.defenses.aegis.generators.base.Fingerprinted`); the order of
        this client's draws comes from its seed."""
        return f"pool:{self.pool.digest()}"

    def sample(self, labels: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
        check_labels(labels, self.num_classes)
        out = torch.empty(len(labels), *self.image_shape)
        for c in labels.unique().tolist():
            at = torch.nonzero(labels == c).flatten()
            order = self._order.get(int(c))
            if order is None:
                known = sorted(self._order)
                raise ValueError(f"the sample pool holds no image of class {c}; it holds {known}")
            used = self._used[int(c)]
            if used + len(at) > len(order):
                raise PoolExhausted(
                    f"the sample pool holds {len(order)} images of class {c}; this client asked for "
                    f"{used + len(at)}: raise the pool's per-class size"
                )
            out[at] = self.pool.images[order[used : used + len(at)]]
            self._used[int(c)] = used + len(at)
        return out
