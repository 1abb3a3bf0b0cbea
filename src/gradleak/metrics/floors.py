"""No-information floors: what an image "reconstruction" scores that carries nothing of the client's update.

A privacy number means something only beside its floor: on low-variance medical images, random public
images of the right class already clear the 18 dB reconstruction-rate threshold for 49 % (PathMNIST) /
68 % (PneumoniaMNIST) of the images. Two floors are scored exactly like a reconstruction
(:func:`gradleak.metrics.score_images`, Hungarian matching included), from the server's public data only
and the true labels (an attacker that recovers labels, as iDLG does, has them too):

- ``class_mean``: each true image's class-mean public image (the global mean for a class the public data
  lack);
- ``random``: a random public image of each true image's class.

:func:`beyond_floor` is the headline leakage: the attack's score minus the higher of the two floors.
"""

from __future__ import annotations

from typing import Any

import torch

from gradleak.data.base import ImageDataset
from gradleak.metrics.image import score_images

FLOORS = ("class_mean", "random")
LEAKS_ABOVE_DB = 3.0
"""Mean PSNR over the higher floor (dB) above which an update counts as leaking: the deployment audit's
verdicts and the client's leakage gate use this one threshold."""
SCORED = ("psnr_mean", "ssim_mean", "reconstruction_rate")  # the scores floors are reported for


def class_means(images: torch.Tensor, labels: torch.Tensor) -> dict[int, torch.Tensor]:
    """The mean image ``(1, C, H, W)`` of every class present in ``labels`` (the server's public data)."""
    return {int(y): images[labels == y].float().mean(0, keepdim=True) for y in labels.unique()}


def class_prior_images(
    means: dict[int, torch.Tensor], labels: torch.Tensor, fallback: torch.Tensor
) -> torch.Tensor:
    """Per label the public mean image of that class (``fallback``, the global mean, for a class the public
    data lack); ``(0, C, H, W)`` for no labels."""
    if len(labels) == 0:
        return fallback[:0]
    return torch.cat([means.get(int(y), fallback) for y in labels])


def same_class_images(public: ImageDataset, labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """For each label a random public image of that class (any public image for a class they lack)."""
    picks = []
    for y in labels.tolist():
        pool = torch.nonzero(public.labels == y).reshape(-1)
        if pool.numel() == 0:
            pool = torch.arange(len(public))
        picks.append(int(pool[torch.randint(len(pool), (1,), generator=generator)]))
    return public.images[picks]


def null_floors(truth: ImageDataset, public: ImageDataset, generator: torch.Generator) -> dict[str, Any]:
    """``floor_<name>_<score>`` for each floor of :data:`FLOORS` and score of :data:`SCORED`."""
    if len(public) == 0:
        raise ValueError("the floors need public images")
    glob = public.images.mean(0, keepdim=True)
    guesses = {
        "class_mean": class_prior_images(class_means(public.images, public.labels), truth.labels, glob),
        "random": same_class_images(public, truth.labels, generator),
    }
    out: dict[str, Any] = {}
    for name, images in guesses.items():
        scores = score_images(images, truth.images, with_fsim=False).to_dict()  # SCORED holds no FSIM
        out.update({f"floor_{name}_{key}": scores[key] for key in SCORED if key in scores})
    return out


def beyond_floor(record: dict[str, Any]) -> dict[str, Any]:
    """``<score>_beyond_floor``: the attack's score minus the higher floor, for each score both have."""
    out = {}
    for key in SCORED:
        floors = [record.get(f"floor_{name}_{key}") for name in FLOORS]
        values = [float(f) for f in floors if isinstance(f, int | float)]
        if isinstance(record.get(key), int | float) and values:
            out[f"{key}_beyond_floor"] = float(record[key]) - max(values)
    return out
