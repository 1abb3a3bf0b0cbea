"""How a client's data is cut into local batches (``LocalTraining.batching``), registered in
:data:`gradleak.registry.SAMPLERS`.

Each entry is ``factory(n, labels, batch_size, *, shuffle, generator) -> list of index tensors``: one
epoch over the ``n`` samples, every sample in exactly one batch. FedSGD's one batch is the first batch of
an epoch, sorted.

- ``random``: a permutation cut into batches of ``batch_size`` (in order when ``shuffle`` is false).
- ``same_label``: Eloul et al. (arXiv 2204.12495): every batch holds samples of one label, so the updates of
  the last dense layer mix the batch's samples (with an MSE loss, :mod:`gradleak.tasks.losses`) instead of
  exposing one sample per class. Each class's samples (shuffled within the class) are cut into batches of
  at most ``batch_size``; the batches are then visited in a random order (by class otherwise).
"""

from __future__ import annotations

import torch

from gradleak.registry import SAMPLERS


def random_batches(
    n: int, labels: torch.Tensor | None, batch_size: int, *, shuffle: bool, generator: torch.Generator
) -> list[torch.Tensor]:
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    return list(order.split(batch_size))


def same_label_batches(
    n: int, labels: torch.Tensor | None, batch_size: int, *, shuffle: bool, generator: torch.Generator
) -> list[torch.Tensor]:
    if labels is None or labels.shape != (n,):
        raise ValueError("same-label batching needs one class label per sample (a classification task)")
    labels = labels.cpu()
    batches: list[torch.Tensor] = []
    for c in torch.unique(labels).tolist():
        members = torch.nonzero(labels == c).flatten()
        if shuffle:
            members = members[torch.randperm(len(members), generator=generator)]
        batches += list(members.split(batch_size))
    if shuffle:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    return batches


SAMPLERS.register("random", lambda: random_batches, summary="a random permutation cut into batches")
SAMPLERS.register("same_label", lambda: same_label_batches, summary="one label per batch (Eloul et al. 2022)")
