"""Adapters on the text models: federated LoRA fine-tuning, as FlowerTune and OpenFedLLM run it (issue 52),
and the bottleneck adapters UTR attacks.

LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022, Eq. 3) keeps a weight
``W`` frozen and trains ``h = W x + (alpha / r) B A x`` with ``A`` (r x in) drawn at random and ``B``
(out x r) at zero, so the first step's ``dL/dA = (alpha / r) B^T delta x^T`` is zero (DAGER's LoRA note).
peft does the adaptation; this module picks what it adapts through the transformer family map
(:mod:`gradleak.models.families`: ``target = ["attention"]``, ``["mlp"]`` or both) and whether the task's
head trains too (``train_head``: by default a classifier's new head does, a language model's tied head
does not). Only the parameters left trainable are updated, sent, checked, averaged and attacked
(:func:`gradleak.validation.trainable_of`): a client's update is the adapters (and the head).

A bottleneck adapter (Houlsby et al., "Parameter-Efficient Transfer Learning for NLP", ICML 2019, Sec. 2.1)
is a small MLP ``x + W_up relu(W_down x + b_down) + b_up`` with ``r`` hidden units; here one sits on the input
of every block (:class:`BottleneckAdapter`), so the first reads the embeddings and the others the blocks'
outputs. UTR's official attack scripts (github.com/shwksnshwowk-wq/GIA, ``model_with_adapter.py``) run two
blocks, with an adapter after the embeddings and one after block 0 (GPT-2, Qwen2) and after block 1 too
(BERT's ``BertManual``), and its adapters are not residual: ``relu(W_up relu(W_down x + b_down) + b_up)``
(``residual = false``). peft has no such adapter, so this module builds it. A residual adapter starts near
the identity (Houlsby): weights ``N(0, 0.01^2)``, biases zero. A non-residual one replaces its block's input,
so it starts as UTR's does, at ``nn.Linear``'s default initialisation (``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``
for weights and biases); both drawn from the adapter's seed.

In a config::

    [model]
    name = "gpt2_tiny"
    adapter = { kind = "lora", r = 16, alpha = 32, dropout = 0.0, target = ["attention"] }
    # or: adapter = { kind = "bottleneck", r = 32 }
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradleak.models.families import FAMILIES, TransformerFamily

TARGETS: dict[str, Callable[[TransformerFamily], str]] = {
    "attention": lambda family: family.attention,
    "mlp": lambda family: family.mlp,
}  # the parts of a family an adapter may target (regular expressions over module names)


INIT_STD = 1e-2  # a residual bottleneck adapter's weights: N(0, INIT_STD^2), Houlsby's near-identity start
ADAPTER_MARKERS = (".lora_", ".bottleneck.")  # what names an adapter's parameters, of every kind here


@dataclass(frozen=True)
class AdapterConfig:
    """An adapter on the model (module docstring): ``kind`` (:data:`ADAPTERS`), LoRA's rank or the
    bottleneck's width ``r``, LoRA's scale ``alpha`` (the update is scaled by ``alpha / r``), ``dropout`` on
    the adapter's input, the family parts LoRA adapts (``target``: :data:`TARGETS`; None: the attention;
    a bottleneck adapter sits on every block's input and takes none), whether a bottleneck adapter adds its
    output to its input (``residual``; UTR's official adapters do not), and ``train_head`` (None: a
    classifier's head trains, a language model's does not)."""

    kind: str = "lora"
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target: list[str] | None = None
    train_head: bool | None = None
    residual: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ADAPTERS:
            raise ValueError(f"adapter kind must be one of {sorted(ADAPTERS)}, got {self.kind!r}")
        if not isinstance(self.residual, bool):
            raise ValueError(f"adapter residual must be true or false, got {self.residual!r}")
        if self.kind == "bottleneck":
            if self.target is not None:
                raise ValueError(
                    "a bottleneck adapter sits on every block's input and takes no target (LoRA's option)"
                )
        else:
            if not self.residual:
                raise ValueError("adapter residual is the bottleneck adapter's option; LoRA's is additive")
            if self.target is None:
                object.__setattr__(self, "target", ["attention"])
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"adapter r must be an int >= 1, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int) or self.alpha < 1:
            raise ValueError(f"adapter alpha must be an int >= 1 (peft's lora_alpha), got {self.alpha!r}")
        if not (isinstance(self.dropout, int | float) and 0 <= self.dropout < 1):
            raise ValueError(f"adapter dropout must be in [0, 1), got {self.dropout!r}")
        if self.target is not None and (
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

    modules = target_modules(model, family, config.target or [])
    if not modules:
        raise ValueError(f"adapter target {config.target} names no layer of this {family.model_type} model")
    train_head, head = _head(family, config, task)
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


def _head(family: TransformerFamily, config: AdapterConfig, task: str) -> tuple[bool, str | None]:
    """Whether the task's head trains beside the adapters (module docstring), and its module name."""
    train_head = config.train_head if config.train_head is not None else task == "classification"
    head = family.heads.get(task)
    if train_head and head is None:
        raise ValueError(f"the {family.model_type} family has no {task} head to train")
    return train_head, head


class BottleneckAdapter(nn.Module):
    """A bottleneck adapter on a block's input (module docstring): ``x + up(relu(down(x)))``, or
    ``relu(up(relu(down(x))))`` where not ``residual`` (UTR's official form). Applied by
    :meth:`pre_hook`, a bound method, so that a deep copy of the model hooks the copied adapter."""

    def __init__(
        self, width: int, r: int, *, dropout: float, residual: bool, generator: torch.Generator,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        super().__init__()
        self.residual = residual
        self.dropout = nn.Dropout(dropout)
        self.down = nn.Linear(width, r, dtype=dtype, device=device)
        self.up = nn.Linear(r, width, dtype=dtype, device=device)
        with torch.no_grad():
            for layer in (self.down, self.up):
                if residual:  # Houlsby's near-identity start
                    draw = torch.randn(layer.weight.shape, generator=generator, dtype=torch.float64)
                    layer.weight.copy_(draw * INIT_STD)
                    layer.bias.zero_()
                else:  # nn.Linear's default (UTR's adapters): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
                    bound = 1.0 / math.sqrt(layer.in_features)
                    for param in (layer.weight, layer.bias):
                        draw = torch.rand(param.shape, generator=generator, dtype=torch.float64)
                        param.copy_((2 * draw - 1) * bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(torch.relu(self.down(self.dropout(x))))
        return x + h if self.residual else torch.relu(h)

    def pre_hook(
        self, _block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The block's hidden states (its first argument, or ``hidden_states``) passed through the adapter."""
        if args:
            return (self(args[0]), *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise TypeError(
                f"a bottleneck adapter reads its block's hidden states, the first argument or hidden_states; "
                f"{type(_block).__name__} got only {sorted(kwargs)}"
            )
        return args, {**kwargs, "hidden_states": self(kwargs["hidden_states"])}


def bottleneck(
    model: nn.Module, family: TransformerFamily, config: AdapterConfig, task: str, seed: int
) -> nn.Module:
    """``model`` with a :class:`BottleneckAdapter` of width ``config.r`` on every block's input (child
    ``bottleneck`` of the block), everything but the adapters (and a trained head) frozen; the adapters'
    weights drawn from ``seed``, block by block."""
    pattern = re.compile(family.block_pattern)
    blocks = [m for name, m in model.named_modules() if pattern.search(name)]
    if not blocks:
        raise ValueError(f"no blocks of this {family.model_type} model are mapped for a bottleneck adapter")
    if any(hasattr(block, "bottleneck") for block in blocks):
        raise ValueError("this model has bottleneck adapters already; apply an adapter once")
    train_head, head = _head(family, config, task)
    if train_head and head is not None:
        embedding = re.compile(family.embedding_pattern)
        inputs = [m for name, m in model.named_modules() if embedding.search(name)]
        tied = {id(p) for p in model.get_submodule(head).parameters()} & {
            id(p) for m in inputs for p in m.parameters()
        }
        if tied:
            raise ValueError(
                f"the {task} head is tied to the input embedding: training it would train (and send) the "
                "embedding; set train_head = false or untie the head (gpt2_*: tie_word_embeddings = false)"
            )
    width = int(getattr(model, "config").hidden_size)  # noqa: B009 (nn.Module's __getattr__)
    reference = next(model.parameters())
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    for block in blocks:
        adapter = BottleneckAdapter(
            width, config.r, dropout=config.dropout, residual=config.residual, generator=generator,
            dtype=reference.dtype, device=reference.device,
        )  # fmt: skip
        block.add_module("bottleneck", adapter)
        block.register_forward_pre_hook(adapter.pre_hook, with_kwargs=True)
    if train_head and head is not None:
        for p in model.get_submodule(head).parameters():
            p.requires_grad_(True)
    return model


def is_adapter_parameter(name: str) -> bool:
    """Whether ``name`` is an adapter's parameter (of any kind built here)."""
    return any(marker in name for marker in ADAPTER_MARKERS)


ADAPTERS: dict[str, Callable[[nn.Module, TransformerFamily, AdapterConfig, str, int], nn.Module]] = {
    "lora": lora,
    "bottleneck": bottleneck,
}


def apply_adapter(model: nn.Module, config: AdapterConfig, task: str, seed: int) -> nn.Module:
    """``model`` with the adapter of ``config`` (:data:`ADAPTERS`), its family read from its config."""
    family = FAMILIES.create(str(getattr(model, "config").model_type))  # noqa: B009 (nn.Module's __getattr__)
    return ADAPTERS[config.kind](model, family, config, task, seed)


__all__ = [
    "ADAPTERS",
    "TARGETS",
    "AdapterConfig",
    "BottleneckAdapter",
    "apply_adapter",
    "bottleneck",
    "is_adapter_parameter",
    "lora",
    "target_modules",
]
