"""Client-side defense hooks and the fail-closed rule.

A defense is a set of optional hooks called by the client's local training loop, in list order:

- ``setup(model, *, generator)`` once before local training (e.g. freeze attention); a defense that needs
  the client's private data (Aegis builds its synthetic cache from it) declares a keyword-only
  ``data: ImageDataset | None = None`` parameter on its ``setup``, and :meth:`DefenseChain.setup` passes
  the client's data to it (only to it: defenses whose ``setup`` has no ``data`` parameter are called as
  before, so existing subclasses and callers of ``setup(model, generator=g)`` keep working); likewise a
  ``train_data`` parameter receives the samples local training draws from (DP-SGD's sampling rate),
  which is a subset of ``data`` when an audit trains on part of a client's share;
- ``on_gradients(model, step)`` after each backward, before the optimizer step (clipping + noise, pruning);
- ``on_epoch_end(model, optimizer)`` after each local epoch (e.g. Aegis' synthetic logical batch);
- ``on_update(update) -> Update`` on the outgoing payload (compression, noise on the delta).

If any hook raises, the client raises :class:`DefenseFailure` and sends nothing: a defense fails closed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from gradleak.types import Update
from gradleak.validation import InvalidUpdateError, check_tensors

if TYPE_CHECKING:
    from gradleak.data.base import ImageDataset
    from gradleak.data.text import TokenDataset


CLAIMS = ("epsilon", "delta")  # what a defense may state about the update it formed


def _statements(metadata: Mapping[str, object]) -> dict[str, dict[str, float]]:
    """The numbers defenses stated in an update's metadata, by defense: ``<defense>/<name>`` entries."""
    stated: dict[str, dict[str, float]] = {}
    for key, value in metadata.items():
        prefix, _, name = key.rpartition("/")
        if prefix and isinstance(value, int | float):
            stated.setdefault(prefix, {})[name] = float(value)
    return stated


def claims(metadata: Mapping[str, object]) -> dict[str, float]:
    """The formal privacy a defense stated for an update: the ``<defense>/epsilon`` and ``<defense>/delta``
    entries of its metadata (dp_sgd, update_noise), as ``{"epsilon": ..., "delta": ...}``; empty when none
    did. When two chained defenses state one, each holds for the update (the later one post-processes the
    earlier's output, and each bounds the whole mechanism alone), so the smaller epsilon is reported with
    its own delta."""
    full = [{k: c[k] for k in CLAIMS} for c in _statements(metadata).values() if set(CLAIMS) <= set(c)]
    return min(full, key=lambda c: c["epsilon"]) if full else {}


# How a defense's formal claims compose over several releases of one client's data (e.g. the views of a
# replayed round): its metadata prefix -> a function of the releases' metadata returning (epsilon, delta).
# A defense that states an epsilon registers one beside itself (dp_sgd: the accountant; update_noise: basic
# composition).
Composition = Callable[[Sequence[Mapping[str, object]]], tuple[float, float]]
COMPOSITIONS: dict[str, Composition] = {}


def composed_claims(metadatas: Sequence[Mapping[str, object]]) -> dict[str, float]:
    """The formal privacy of several releases of one client's data: ``{"epsilon", "delta"}`` composed by
    each stating defense's rule (:data:`COMPOSITIONS`), the smallest epsilon when several state one (as
    :func:`claims`); empty when none states one. A stating defense without a rule is an error: a claim
    that cannot be composed must not be reported for one release."""
    stating = {d for m in metadatas for d, c in _statements(m).items() if set(CLAIMS) <= set(c)}
    missing = sorted(stating - set(COMPOSITIONS))
    if missing:
        raise ValueError(f"no composition rule for the claims of {missing}")
    composed = [COMPOSITIONS[d](metadatas) for d in sorted(stating)]
    if not composed:
        return {}
    eps, delta = min(composed)
    return {"epsilon": eps, "delta": delta}


NOISE_STD = "noise_std"  # metadata key: the per-entry std of the Gaussian noise in the sent tensors


def stated_noise_std(metadata: Mapping[str, object]) -> float | None:
    """The per-entry standard deviation of the Gaussian noise the defenses say they put in the sent tensors
    (their ``<defense>/noise_std`` entries; the scale is part of a DP configuration, which is public), or
    None when none did. Noises of chained defenses are independent, so their variances add; a later
    defense's clipping only shrinks an earlier one's noise, so the root of the sum of squares is an upper
    bound."""
    stds = noise_stds(metadata).values()
    return sum(s * s for s in stds) ** 0.5 if stds else None


def noise_stds(metadata: Mapping[str, object]) -> dict[str, float]:
    """Each defense's stated per-entry noise standard deviation, by its metadata key
    (``<defense>/noise_std``)."""
    return {f"{d}/{NOISE_STD}": c[NOISE_STD] for d, c in _statements(metadata).items() if NOISE_STD in c}


class DefenseFailure(RuntimeError):
    """A defense hook failed; the client's update was withheld (fail closed)."""


@dataclass(frozen=True)
class SetupContext:
    """What a defense's ``setup`` receives besides the model, once per local training run (the same object
    for every defense of a chain, so a new field reaches them all without changing a signature):

    ``generator``: the client's randomness (OS-seeded in deployment, :func:`~gradleak.defenses.in_loop.
    private_generator`; seeded per client and round in simulations). ``data``: the client's private data,
    for data-aware defenses (Aegis builds its synthetic cache from it); it never leaves the client.
    ``train_data``: what local training draws its batches from (``data`` when not given; DP-SGD accounts
    its sampling rate from it). ``data_root``: where this party's data files are (``experiment.data_root``;
    None: ``$GRADLEAK_DATA`` or ``../shared/data``), for a defense that reads a public split.
    ``criterion``: the classification loss local training minimises (``LocalTraining.loss``, a
    ``(logits, labels) -> mean loss`` callable; None: cross-entropy), for a defense that takes steps of its
    own (Aegis' synthetic step must descend the loss the real steps descend)."""

    generator: torch.Generator
    data: ImageDataset | TokenDataset | None = None
    train_data: object | None = None
    data_root: str | os.PathLike[str] | None = None
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.generator, torch.Generator):
            raise TypeError(f"a defense's setup needs a torch.Generator, got {type(self.generator).__name__}")
        if self.train_data is None and self.data is not None:
            object.__setattr__(self, "train_data", self.data)


class Defense:
    """Base class with no-op hooks; subclasses override what they need. ``differential_privacy``: the
    defense's noise is calibrated to a stated guarantee on the model's *parameters* (DP-SGD, update DP);
    buffers such as BatchNorm's running statistics are outside it (:func:`statistics_note`).
    ``adapters``: whether it means anything on a model that trains adapters only (LoRA, bottleneck; False:
    refused at config time, with the reason its ``setup`` gives)."""

    name: str = "defense"
    differential_privacy: bool = False
    adapters: bool = True

    def setup(self, model: nn.Module, context: SetupContext) -> None:
        """Called once per local training run, before the first step, with the run's :class:`SetupContext`
        (its generator, the client's private data, the data root)."""

    def on_gradients(self, model: nn.Module, step: int) -> None:
        """Called after each backward pass, before the optimizer step."""

    def on_epoch_end(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Called after each local epoch."""

    def on_update(self, update: Update) -> Update:
        """Transform the outgoing update."""
        return update


STATISTICS = ("send", "withhold")
"""What a Flower reply does with a model's floating buffers (BatchNorm's running mean and variance):
``send`` them as trained (the default: the global statistics follow the clients'), or ``withhold`` them
(reply with the statistics the server sent; FedBN's choice, Li et al. 2021, where they stay local)."""


def check_statistics(statistics: str) -> str:
    if statistics not in STATISTICS:
        raise ValueError(f"statistics must be one of {STATISTICS}, got {statistics!r}")
    return statistics


def statistics_note(defenses: Sequence[Defense], buffers: Sequence[str], statistics: str) -> str | None:
    """The warning due when a differentially private defense protects the parameters while floating
    buffers computed from the client's data (BatchNorm's running statistics) leave the client un-noised:
    the stated epsilon does not cover them. None when nothing is uncovered."""
    private = [d.name for d in defenses if d.differential_privacy]
    if not private or not buffers or statistics != "send":
        return None
    return (
        f"{', '.join(private)}: the stated epsilon covers the model's parameters only; the buffers "
        f"{list(buffers)[:4]} (running statistics of this client's data) leave un-noised. Use GroupNorm "
        "instead of BatchNorm, or statistics='withhold' (FedBN: the statistics stay on the client)"
    )


def is_update_level(defense: Defense) -> bool:
    """Whether ``defense`` acts on the outgoing update only (``on_update``; ``setup`` may keep a seed): the
    defenses a Flower mod or the leakage gate can apply to a finished update."""
    cls = type(defense)
    in_loop = cls.on_gradients is not Defense.on_gradients or cls.on_epoch_end is not Defense.on_epoch_end
    return not in_loop and cls.on_update is not Defense.on_update


class DefenseChain:
    """Applies a list of defenses in order, wrapping every failure into :class:`DefenseFailure`."""

    def __init__(self, defenses: Sequence[Defense] = ()) -> None:
        self.defenses = list(defenses)

    def _call(self, hook: str, *args: object, **kwargs: object) -> None:
        for d in self.defenses:
            try:
                getattr(d, hook)(*args, **kwargs)
            except Exception as exc:  # any failure withholds the update
                raise DefenseFailure(f"defense {d.name!r} failed in {hook}: {exc}") from exc

    def setup(self, model: nn.Module, context: SetupContext) -> None:
        """Every defense's ``setup`` with the one ``context``. A failure raises :class:`DefenseFailure`, as
        in every hook."""
        self._call("setup", model, context)

    def on_gradients(self, model: nn.Module, step: int) -> None:
        self._call("on_gradients", model, step)

    def on_epoch_end(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._call("on_epoch_end", model, optimizer)

    def on_update(self, update: Update) -> Update:
        for d in self.defenses:
            try:
                out = d.on_update(update)
            except Exception as exc:
                raise DefenseFailure(f"defense {d.name!r} failed in on_update: {exc}") from exc
            if not isinstance(out, Update):
                raise DefenseFailure(f"defense {d.name!r} returned {type(out).__name__}, not an Update")
            try:  # what a defense returns must still be an update of these tensors: names, shapes, finite
                check_tensors(out.tensors, update.tensors, source=f"defense {d.name!r} on_update")
            except InvalidUpdateError as exc:
                raise DefenseFailure(str(exc)) from exc
            update = out
        return update
