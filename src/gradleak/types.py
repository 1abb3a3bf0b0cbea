"""Core types that cross module boundaries: what a client sends, what an attacker sees, what it returns.

The attacker sees an :class:`Observation` and nothing else; ground truth meets a :class:`Reconstruction`
only in :mod:`gradleak.metrics` (the separation that makes results honest).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from gradleak.update import MODE, MODES, LocalTraining, OptimizerName, Protocol_, Update, UpdateKind
from gradleak.validation import InvalidUpdateError, check_update, describe

__all__ = [  # LocalTraining, Update and their names are defined in gradleak.update, re-exported here
    "MODE", "MODES", "AttackInputError", "Attack", "AttackNeeds", "ClientCustomizingAttack", "LocalTraining",
    "ModelModifyingAttack", "Observation", "OptimizerName", "Protocol_", "Reconstruction", "Update",
    "UpdateKind",
]  # fmt: skip


@dataclass(frozen=True)
class Observation:
    """Everything an attack may read, nothing more.

    ``model`` holds the architecture at the broadcast weights w_0 (attacks must not modify it in place;
    they copy it, with :meth:`client_model`). ``training`` is ``None`` when the threat model hides the
    client's recipe; ``labels`` only when the threat model grants them. ``secrets`` are what a malicious
    server planted itself. ``aggregated`` is true when the server sees only a secure-aggregation sum over
    ``num_clients`` clients. ``mode`` is the module mode the client computed the update in (``"train"``:
    BatchNorm normalises with the batch's statistics, dropout is on; ``"eval"``), part of the public
    recipe: by default the update's ``metadata["mode"]`` (gradleak's clients set it), else ``"train"``, how
    a PyTorch training loop runs. On a model with BatchNorm the two modes' gradients of the same images
    differ (cosine 0.08 on a BatchNorm ConvNet), so an attack that differentiates the other mode inverts
    another function.

    ``views`` are further updates of the same client on the same data from the same broadcast model, each
    with fresh client randomness (its own noise draw): what a server sees that broadcasts one model several
    times (``audit.views``; a malicious server's replay, or a client whose local data set is one batch in
    successive FedSGD rounds of a model that barely moves). Empty by default; attacks that do not average
    views read ``update`` alone.

    ``lengths``: each text sample's number of real tokens, only where the threat model grants them
    (``audit.grant_lengths``; LAMP's ``know_padding``, its official default); never under secure aggregation.
    """

    model: nn.Module
    update: Update
    input_shape: tuple[int, ...]
    num_classes: int
    training: LocalTraining | None = None
    labels: torch.Tensor | None = None
    secrets: Mapping[str, object] = field(default_factory=dict)
    aggregated: bool = False
    num_clients: int = 1
    mode: str | None = None
    views: tuple[Update, ...] = ()
    lengths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        """An attack never reads an invalid update: names and shapes must match the model's parameters
        (a subset is allowed: frozen parameters may be absent), dtypes must be floating point and every
        entry finite; otherwise :class:`AttackInputError` naming the tensor. Every view is checked so, and
        must carry the first update's tensor names and kind."""
        for k, update in enumerate((self.update, *self.views)):
            try:
                check_update(update, self.model, source=describe(update.metadata), complete=False)
            except InvalidUpdateError as exc:
                raise AttackInputError(str(exc)) from None
            if k and (set(update.tensors) != set(self.update.tensors) or update.kind != self.update.kind):
                raise AttackInputError(
                    f"view {k} carries other tensors or another kind ({update.kind!r}) than the first "
                    f"update ({self.update.kind!r}): views must be updates of the same model and recipe"
                )
        if not self.input_shape or any(not isinstance(d, int) or d < 1 for d in self.input_shape):
            raise AttackInputError(f"input_shape must be positive ints, got {self.input_shape!r}")
        if self.lengths is not None and (
            len(self.lengths) != self.update.num_samples
            or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.input_shape[0]
                   for n in self.lengths)
        ):  # fmt: skip
            raise AttackInputError(
                f"lengths must be one int in [1, {self.input_shape[0]}] per sample "
                f"({self.update.num_samples}), got {self.lengths!r}"
            )
        mode = self.mode if self.mode is not None else self.update.metadata.get(MODE, "train")
        if mode not in MODES:
            raise AttackInputError(f"mode must be one of {MODES}, got {mode!r}")
        object.__setattr__(self, "mode", mode)

    def to(self, device: torch.device | str) -> Observation:
        """The same observation computed on ``device``: the model there (copied only when it is elsewhere),
        the updates, views and granted labels with it (:mod:`gradleak.device`); itself when all are there."""
        device = torch.device(device)
        model_there = all(t.device == device for t in (*self.model.parameters(), *self.model.buffers()))
        rest = [t for u in (self.update, *self.views) for t in (*u.tensors.values(), *u.buffers.values())]
        if self.labels is not None:
            rest.append(self.labels)
        if model_there and all(t.device == device for t in rest):
            return self
        moved = copy.copy(self)  # checked on construction; moving changes no value, so no second check
        for name, value in (
            ("model", self.model if model_there else copy.deepcopy(self.model).to(device)),
            ("update", self.update.to(device)),
            ("views", tuple(v.to(device) for v in self.views)),
            ("labels", None if self.labels is None else self.labels.to(device)),
        ):
            object.__setattr__(moved, name, value)
        return moved

    def client_model(self) -> nn.Module:
        """A copy of the model in the mode the client computed the update in: what an attack
        differentiates (its BatchNorm running statistics may change; the observation's model does not)."""
        model = copy.deepcopy(self.model)
        return model.train(self.mode == "train")


@dataclass
class Reconstruction:
    """An attack's output: images (N, C, H, W) in [0, 1] and/or token ids, recovered labels, statistics.

    ``ordered``: ``token_ids`` are sequences (DAGER); false for an unordered token set returned as one list
    (the row-norm and MLP side channels), scored as a set against the batch's tokens.
    """

    images: torch.Tensor | None = None
    token_ids: list[list[int]] | None = None
    labels: torch.Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)
    ordered: bool = True

    def __post_init__(self) -> None:
        if self.images is not None and self.images.dim() != 4:
            raise ValueError(
                f"Reconstruction.images must be (N, C, H, W), got shape {tuple(self.images.shape)}"
            )

    def to(self, device: torch.device | str) -> Reconstruction:
        """The same reconstruction with its images and labels on ``device``."""
        return dataclasses.replace(
            self,
            images=None if self.images is None else self.images.to(device),
            labels=None if self.labels is None else self.labels.to(device),
        )


@dataclass(frozen=True)
class AttackNeeds:
    """What an attack needs from the audited round; an attack class may declare ``needs = AttackNeeds(...)``
    and the experiment config is checked against it before any work.

    ``update_kinds``: the update kinds it inverts (FedSGD sends ``"gradient"``, FedAvg ``"delta"``);
    ``public_recipe``: whether it needs the client's training recipe (``Observation.training``);
    ``sgd_delta``: whether it reads a FedAvg delta as plain SGD's mean gradient, so a delta needs the recipe
    public and plain SGD (:attr:`~gradleak.update.LocalTraining.plain_sgd`).
    """

    update_kinds: tuple[UpdateKind, ...] = ("gradient", "delta")
    public_recipe: bool = False
    sgd_delta: bool = False


class AttackInputError(ValueError):
    """The Observation lacks what an attack needs (e.g. labels hidden and not recoverable)."""


@runtime_checkable
class Attack(Protocol):
    """An attack reads only an Observation and returns a Reconstruction."""

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction: ...


@runtime_checkable
class ModelModifyingAttack(Attack, Protocol):
    """A malicious-server attack: it first modifies the model the server broadcasts.

    ``prepare`` receives a private copy of the honest global model and the server's public auxiliary images
    ``(N, C, H, W)`` (never client data; may be ``None``), and returns the model to broadcast plus the secrets
    it planted (e.g. imprint-layer positions and bins). The clients train the returned model unchanged; the
    secrets reach the attack again only through ``Observation.secrets``.
    """

    def prepare(
        self, model: nn.Module, public_images: torch.Tensor | None, *, generator: torch.Generator
    ) -> tuple[nn.Module, Mapping[str, object]]: ...


@runtime_checkable
class ClientCustomizingAttack(ModelModifyingAttack, Protocol):
    """A malicious server that sends each audited client its own variant of the prepared model (LOKI).

    ``customize(broadcast, slot)`` returns the model for the ``slot``-th audited client; the Observation still
    carries ``broadcast`` (the server's reference model) and the secrets from ``prepare``.
    """

    def customize(self, broadcast: nn.Module, slot: int) -> nn.Module: ...
