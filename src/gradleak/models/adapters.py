"""Adapters on the text models: federated LoRA fine-tuning, as FlowerTune and OpenFedLLM run it (issue 52).

LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022, Eq. 3) keeps a weight
``W`` frozen and trains ``h = W x + (alpha / r) B A x`` with ``A`` (r x in) drawn at random and ``B``
(out x r) at zero, so the first step's ``dL/dA = (alpha / r) B^T delta x^T`` is zero (DAGER's LoRA note).
peft does the adaptation; this module picks what it adapts through the transformer family map
(:mod:`gradleak.models.families`: ``target = ["attention"]``, ``["mlp"]`` or both) and whether the task's
head trains too (``train_head``: by default a classifier's new head does, a language model's tied head
does not). Only the parameters left trainable are updated, sent, checked, averaged and attacked
(:func:`gradleak.validation.trainable_of`): a client's update is the adapters (and the head).

In a config::

    [model]
    name = "gpt2_tiny"
    adapter = { kind = "lora", r = 16, alpha = 32, dropout = 0.0, target = ["attention"] }
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from gradleak.models.families import FAMILIES, TransformerFamily

TARGETS: dict[str, Callable[[TransformerFamily], str]] = {
    "attention": lambda family: family.attention,
    "mlp": lambda family: family.mlp,
}  # the parts of a family an adapter may target (regular expressions over module names)


@dataclass(frozen=True)
class AdapterConfig:
    """An adapter on the model (module docstring): ``kind`` (:data:`ADAPTERS`), LoRA's rank ``r``, scale
    ``alpha`` (the update is scaled by ``alpha / r``), ``dropout`` on the adapter's input, the family parts
    it adapts (``target``: :data:`TARGETS`), and ``train_head`` (None: a classifier's head trains, a
    language model's does not)."""

    kind: str = "lora"
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target: list[str] = field(default_factory=lambda: ["attention"])
    train_head: bool | None = None

    def __post_init__(self) -> None:
        if self.kind not in ADAPTERS:
            raise ValueError(f"adapter kind must be one of {sorted(ADAPTERS)}, got {self.kind!r}")
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"adapter r must be an int >= 1, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int) or self.alpha < 1:
            raise ValueError(f"adapter alpha must be an int >= 1 (peft's lora_alpha), got {self.alpha!r}")
        if not (isinstance(self.dropout, int | float) and 0 <= self.dropout < 1):
            raise ValueError(f"adapter dropout must be in [0, 1), got {self.dropout!r}")
        if (
            not self.target
            or any(t not in TARGETS for t in self.target)
            or len(set(self.target)) < len(self.target)
        ):
            raise ValueError(
                f"adapter target must be distinct parts of {sorted(TARGETS)}, got {self.target!r}"
            )


def target_modules(model: nn.Module, family: TransformerFamily, parts: list[str]) -> list[str]:
    """The names of ``model``'s modules in the family's ``parts`` (each a layer with a weight)."""
    patterns = [re.compile(TARGETS[p](family)) for p in parts]
    return [
        name
        for name, module in model.named_modules()
        if any(p.search(name) for p in patterns) and isinstance(getattr(module, "weight", None), torch.Tensor)
    ]


def lora(
    model: nn.Module, family: TransformerFamily, config: AdapterConfig, task: str, seed: int
) -> nn.Module:
    """``model`` wrapped by peft with LoRA on the family's ``config.target`` layers (module docstring);
    the adapters' random ``A`` drawn from ``seed``."""
    from peft import LoraConfig, get_peft_model

    modules = target_modules(model, family, config.target)
    if not modules:
        raise ValueError(f"adapter target {config.target} names no layer of this {family.model_type} model")
    train_head = config.train_head if config.train_head is not None else task == "classification"
    head = family.heads.get(task)
    if train_head and head is None:
        raise ValueError(f"the {family.model_type} family has no {task} head to train")
    peft_config = LoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=modules,
        fan_in_fan_out=family.conv1d,  # GPT-2's Conv1D stores (in, out)
        modules_to_save=[head] if train_head and head is not None else None,
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):  # peft initialises A from the global generator: seed it here
        torch.manual_seed(seed)
        return get_peft_model(model, peft_config)


ADAPTERS: dict[str, Callable[[nn.Module, TransformerFamily, AdapterConfig, str, int], nn.Module]] = {
    "lora": lora
}


def apply_adapter(model: nn.Module, config: AdapterConfig, task: str, seed: int) -> nn.Module:
    """``model`` with the adapter of ``config`` (:data:`ADAPTERS`), its family read from its config."""
    family = FAMILIES.create(str(getattr(model, "config").model_type))  # noqa: B009 (nn.Module's __getattr__)
    return ADAPTERS[config.kind](model, family, config, task, seed)


__all__ = ["ADAPTERS", "TARGETS", "AdapterConfig", "apply_adapter", "lora", "target_modules"]
