"""Registered victim models; ``build_model(name, input_shape, num_classes, seed, **options)``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradleak.models import cnn as _cnn  # noqa: F401  (registers the CNNs)
from gradleak.models import resnet as _resnet  # noqa: F401  (registers)
from gradleak.models import text as _text  # noqa: F401  (registers the transformers)
from gradleak.models.architecture import SPEC_ATTRIBUTE, RegisteredModel
from gradleak.registry import MODELS


def build_model(
    name: str, input_shape: tuple[int, int, int], num_classes: int, *, seed: int, **options: Any
) -> nn.Module:
    """Build a registered model with weights drawn from a generator seeded with ``seed``.

    The global torch RNG is saved and restored so that building a model never disturbs other randomness.
    """
    factory = MODELS.get(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model: Any = factory(tuple(input_shape), num_classes, **options)  # a text factory: TextModel
        except TypeError as exc:
            raise ValueError(f"bad options {sorted(options)} for model {name!r}: {exc}") from None
    spec = RegisteredModel(
        name, tuple(int(d) for d in input_shape), int(num_classes), int(seed), dict(options)
    )
    setattr(model, SPEC_ATTRIBUTE, spec)  # so that it can travel as a spec (gradleak.models.architecture)
    return model


__all__ = ["build_model"]
