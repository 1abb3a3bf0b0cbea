"""Client-side defense hooks and the fail-closed rule.

A defense is a set of optional hooks called by the client's local training loop, in list order:

- ``setup(model, *, generator)`` once before local training (e.g. freeze attention); a defense that needs
  the client's private data (Aegis builds its synthetic cache from it) declares a keyword-only
  ``data: ImageDataset | None = None`` parameter on its ``setup``, and :meth:`DefenseChain.setup` passes
  the client's data to it (only to it: defenses whose ``setup`` has no ``data`` parameter are called as
  before, so existing subclasses and callers of ``setup(model, generator=g)`` keep working);
- ``on_gradients(model, step)`` after each backward, before the optimizer step (clipping + noise, pruning);
- ``on_epoch_end(model, optimizer)`` after each local epoch (e.g. Aegis' synthetic logical batch);
- ``on_update(update) -> Update`` on the outgoing payload (compression, noise on the delta).

If any hook raises, the client raises :class:`DefenseFailure` and sends nothing: a defense fails closed.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from gradleak.types import Update
from gradleak.validation import InvalidUpdateError, check_tensors

if TYPE_CHECKING:
    from gradleak.data.base import ImageDataset


class DefenseFailure(RuntimeError):
    """A defense hook failed; the client's update was withheld (fail closed)."""


class Defense:
    """Base class with no-op hooks; subclasses override what they need."""

    name: str = "defense"

    def setup(self, model: nn.Module, *, generator: torch.Generator) -> None:
        """Called once per local training run, before the first step. Subclasses may add a keyword-only
        ``data: ImageDataset | None = None`` parameter to receive the client's private data (see
        :func:`accepts_data`); it never leaves the client."""

    def on_gradients(self, model: nn.Module, step: int) -> None:
        """Called after each backward pass, before the optimizer step."""

    def on_epoch_end(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Called after each local epoch."""

    def on_update(self, update: Update) -> Update:
        """Transform the outgoing update."""
        return update


def accepts_data(defense: Defense) -> bool:
    """Whether ``defense.setup`` takes the client's data: it declares ``data`` (or ``**kwargs``)."""
    try:
        params = inspect.signature(defense.setup).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "data" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


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

    def setup(
        self, model: nn.Module, *, generator: torch.Generator, data: ImageDataset | None = None
    ) -> None:
        """Every defense's ``setup``; ``data`` (the client's private data, optional) goes only to the
        defenses whose ``setup`` accepts it (:func:`accepts_data`). A failure raises
        :class:`DefenseFailure`, as in every hook."""
        for d in self.defenses:
            kwargs: dict[str, object] = {"generator": generator}
            if data is not None and accepts_data(d):
                kwargs["data"] = data
            try:
                d.setup(model, **kwargs)  # type: ignore[arg-type]
            except Exception as exc:  # any failure withholds the update
                raise DefenseFailure(f"defense {d.name!r} failed in setup: {exc}") from exc

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
