"""Client-side defense hooks and the fail-closed rule.

A defense is a set of optional hooks called by the client's local training loop, in list order:

- ``setup(model)`` once before local training (e.g. freeze attention);
- ``on_gradients(model, step)`` after each backward, before the optimizer step (clipping + noise, pruning);
- ``on_epoch_end(model, optimizer)`` after each local epoch (e.g. Aegis' synthetic logical batch);
- ``on_update(update) -> Update`` on the outgoing payload (compression, noise on the delta).

If any hook raises, the client raises :class:`DefenseFailure` and sends nothing: a defense fails closed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gradleak.types import Update


class DefenseFailure(RuntimeError):
    """A defense hook failed; the client's update was withheld (fail closed)."""


class Defense:
    """Base class with no-op hooks; subclasses override what they need."""

    name: str = "defense"

    def setup(self, model: nn.Module, *, generator: torch.Generator) -> None:
        """Called once per local training run, before the first step."""

    def on_gradients(self, model: nn.Module, step: int) -> None:
        """Called after each backward pass, before the optimizer step."""

    def on_epoch_end(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Called after each local epoch."""

    def on_update(self, update: Update) -> Update:
        """Transform the outgoing update."""
        return update


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

    def setup(self, model: nn.Module, *, generator: torch.Generator) -> None:
        self._call("setup", model, generator=generator)

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
            bad = [n for n, t in out.tensors.items() if not torch.isfinite(t).all()]
            if bad:
                raise DefenseFailure(f"defense {d.name!r} produced non-finite values in {bad[:3]}")
            update = out
        return update
