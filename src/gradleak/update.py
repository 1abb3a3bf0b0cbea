"""What a client sends: its local training recipe (:class:`LocalTraining`) and its :class:`Update`.

The lowest of the core types: :mod:`gradleak.validation` checks an Update against a model, and
:mod:`gradleak.types` (what an attacker sees and returns) builds on both.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from gradleak.registry import LOSSES, OPTIMIZERS, SAMPLERS

Protocol_ = Literal["fedsgd", "fedavg"]
OptimizerName = str  # a name in gradleak.registry.OPTIMIZERS: sgd, adam, adamw, or a plugin's
DEFAULT_LOSS, DEFAULT_BATCHING = "cross_entropy", "random"


@dataclass(frozen=True)
class LocalTraining:
    """A client's local training recipe (public or hidden according to the threat model).

    ``fedsgd``: one gradient on one batch of ``batch_size`` samples, sent as is.
    ``fedavg``: ``epochs`` passes over the client's data in batches of ``batch_size`` with ``optimizer``
    (SGD, Adam or AdamW; ``weight_decay`` is the optimizer's, decoupled for AdamW; ``momentum`` is SGD's
    heavy-ball momentum, for an optimizer whose factory takes one, as Flower's PyTorch quickstart trains).
    ``loss`` (:data:`~gradleak.registry.LOSSES`: ``cross_entropy``, ``mse``) and ``batching``
    (:data:`~gradleak.registry.SAMPLERS`: ``random``, ``same_label``) change what the client differentiates
    and how it cuts its data into batches: Eloul et al.'s same-label batching with an MSE loss is
    ``loss="mse", batching="same_label"``. An attacker who knows the recipe knows both.
    """

    protocol: Protocol_ = "fedavg"
    epochs: int = 1
    batch_size: int = 64
    lr: float = 1e-3
    optimizer: OptimizerName = "sgd"
    shuffle: bool = True
    weight_decay: float = 0.0
    momentum: float = 0.0
    loss: str = DEFAULT_LOSS
    batching: str = DEFAULT_BATCHING

    def __post_init__(self) -> None:
        if self.protocol not in ("fedsgd", "fedavg"):
            raise ValueError(f"protocol must be 'fedsgd' or 'fedavg', got {self.protocol!r}")
        if not isinstance(self.optimizer, str) or self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS.names()}, got {self.optimizer!r}")
        if not (isinstance(self.weight_decay, int | float) and 0 <= self.weight_decay < math.inf):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if not (isinstance(self.momentum, int | float) and not isinstance(self.momentum, bool)) or not (
            0 <= self.momentum < 1
        ):
            raise ValueError(f"momentum must be a number in [0, 1), got {self.momentum!r}")
        for key, registry in (("loss", LOSSES), ("batching", SAMPLERS)):
            value = getattr(self, key)
            if not isinstance(value, str) or value not in registry:
                raise ValueError(f"{key} must be one of {registry.names()}, got {value!r}")
        if self.momentum and "momentum" not in inspect.signature(OPTIMIZERS.get(self.optimizer)).parameters:
            raise ValueError(f"momentum = {self.momentum} but optimizer {self.optimizer!r} takes no momentum")
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs must be a positive int, got {self.epochs!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if not (
            isinstance(self.lr, int | float) and not isinstance(self.lr, bool) and 0 < self.lr < math.inf
        ):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")

    @property
    def plain_sgd(self) -> bool:
        """Whether each local step moves the weights by -lr times the batch's gradient and nothing else
        (SGD without momentum or weight decay, random batches of known count), so that a FedAvg delta over
        K steps is -lr K times the mean of its steps' gradients."""
        return (
            self.optimizer == "sgd"
            and not self.momentum
            and not self.weight_decay
            and self.batching == DEFAULT_BATCHING
        )

    def steps(self, num_samples: int) -> int:
        """The local steps this recipe takes on ``num_samples`` samples: 1 for FedSGD, else ``epochs`` x
        ceil(num_samples / batch_size) (at least one batch). With ``batching = "same_label"`` each label's
        samples are batched apart, so the client may take more steps than this (up to one more per label)."""
        if self.protocol == "fedsgd":
            return 1
        return self.epochs * max(1, -(-num_samples // self.batch_size))


UpdateKind = Literal["gradient", "delta"]


@dataclass(frozen=True)
class Update:
    """What leaves one client.

    ``kind == "gradient"`` (FedSGD): ``tensors[name]`` is dL/dw at the broadcast weights.
    ``kind == "delta"`` (FedAvg): ``tensors[name]`` is w_T - w_0.
    ``num_samples`` is the sample count the server weights by; ``metadata`` holds what a server really sees
    besides the payload (client id, round). ``buffers``: the module's buffers after local training
    (BatchNorm's running statistics and batch counter), as a FedAvg reply carries them whole; empty when
    the client withholds them (FedBN) or sends a FedSGD gradient. They are statistics of the client's
    data, outside what any defense of the parameters covers (:func:`gradleak.defenses.base.statistics_note`).
    """

    tensors: Mapping[str, torch.Tensor]
    num_samples: int
    kind: UpdateKind = "delta"
    metadata: Mapping[str, object] = field(default_factory=dict)
    buffers: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.tensors, Mapping):
            raise TypeError(
                f"Update.tensors must map parameter names to tensors (e.g. {{n: p.grad for n, p in "
                f"model.named_parameters()}}), got a {type(self.tensors).__name__}"
            )
        if self.kind not in ("gradient", "delta"):
            raise ValueError(f"Update.kind must be 'gradient' or 'delta', got {self.kind!r}")
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {self.num_samples}")

    def flat(self) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in self.tensors.values()])

    def to(self, device: torch.device | str) -> Update:
        """The same update with its tensors and buffers on ``device`` (itself when all are there)."""
        device = torch.device(device)
        if all(t.device == device for t in (*self.tensors.values(), *self.buffers.values())):
            return self
        return dataclasses.replace(
            self,
            tensors={n: t.to(device) for n, t in self.tensors.items()},
            buffers={n: b.to(device) for n, b in self.buffers.items()},
        )

    @property
    def gradient_sign(self) -> float:
        """+1 where the tensors point along the loss gradient (a FedSGD ``gradient``), -1 for a FedAvg
        ``delta`` ``w_T - w_0``, which points against it: ``gradient_sign * tensor`` is a descent signal
        read the same way for both (the one place this sign is written)."""
        return -1.0 if self.kind == "delta" else 1.0

    def replace(self, tensors: Mapping[str, torch.Tensor]) -> Update:
        if set(tensors) != set(self.tensors):
            raise ValueError("replacement tensors must carry the same parameter names")
        return Update(dict(tensors), self.num_samples, self.kind, dict(self.metadata), dict(self.buffers))


MODE = "mode"  # Update.metadata key: the module mode ("train" or "eval") the client computed it in
MODES = ("train", "eval")
