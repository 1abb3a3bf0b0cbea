"""Registered victim models; ``build_model(name, input_shape, num_classes, seed, **options)``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradleak.models import cnn as _cnn  # noqa: F401  (registers the CNNs)
from gradleak.models import resnet as _resnet  # noqa: F401  (registers)
from gradleak.models import text as _text  # noqa: F401  (registers the transformers)
from gradleak.models.adapters import AdapterConfig, apply_adapter
from gradleak.models.architecture import SPEC_ATTRIBUTE, RegisteredModel
from gradleak.models.text import TextModel
from gradleak.options import build_dataclass
from gradleak.registry import MODELS


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, *, seed: int, **options: Any
) -> nn.Module:
    """Build a registered model with weights drawn from a generator seeded with ``seed``.

    The global torch RNG is saved and restored so that building a model never disturbs other randomness.
    """
    factory = MODELS.get(name)
    with torch.random.fork_rng(devices=[]):  # restores the CPU generator; no accelerator's is touched
        torch.default_generator.manual_seed(seed)
        try:
            model: Any = factory(tuple(input_shape), num_classes, **options)  # a text factory: TextModel
        except TypeError as exc:
            raise ValueError(f"bad options {sorted(options)} for model {name!r}: {exc}") from None
    spec = RegisteredModel(
        name, tuple(int(d) for d in input_shape), int(num_classes), int(seed), dict(options)
    )
    setattr(model, SPEC_ATTRIBUTE, spec)  # so that it can travel as a spec (gradleak.models.architecture)
    return model


def build_module(spec: RegisteredModel) -> nn.Module:
    """The torch module a registered model's spec stands for: an image model, or a text model's network
    (its ``task`` an option) with the adapter its ``adapter`` option describes (LoRA, validated as
    :class:`~gradleak.models.adapters.AdapterConfig`, its ``A`` drawn from the spec's seed). A Flower node
    rebuilds the server's model this way and loads the sent weights into it."""
    options = dict(spec.options)
    adapter = options.pop("adapter", None)
    built = build_model(spec.name, spec.input_shape, spec.num_classes, seed=spec.seed, **options)
    module = built.model if isinstance(built, TextModel) else built
    if adapter is not None:
        if not isinstance(built, TextModel):
            raise ValueError(f"model {spec.name!r}: an adapter applies to the text models")
        config = build_dataclass(AdapterConfig, adapter, where="the model spec's adapter")
        module = apply_adapter(module, config, built.task, spec.seed)
    if not isinstance(module, nn.Module):
        raise TypeError(f"model {spec.name!r}: its factory gave a {type(module).__name__}, not a module")
    setattr(module, SPEC_ATTRIBUTE, spec)
    return module


__all__ = ["build_model", "build_module"]
