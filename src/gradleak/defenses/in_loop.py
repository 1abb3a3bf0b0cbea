"""Defenses in any PyTorch training loop: the user keeps their loop, gradleak applies every hook at its place.

The shape of Opacus' ``make_private``: :func:`defend` takes the model, an optimizer *factory* (the
optimizer is built after the defenses' ``setup``, which may freeze parameters, e.g. AEGIS freezes
attention) and the defenses, and returns a :class:`DefendedLoop`. Then, in the user's own loop::

    loop = defend(model, lambda ps: torch.optim.Adam(ps, lr=1e-3), ["batch_noise"], generator=g)
    for epoch in range(E):
        for x, y in batches:
            loop.optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            loop.optimizer.step()          # the defenses' on_gradients run first, on what backward left
        loop.end_epoch()                   # on_epoch_end (Aegis' synthetic logical batch)
    update = loop.update(num_samples=n)    # w_T - w_0 through on_update, validated

or, FedSGD, ``loss.backward(); update = loop.gradient(num_samples=n)``. Anything that goes wrong (a hook
raises, produces non-finite values, or the update is invalid) raises :class:`DefenseFailure`: the caller
sends nothing. A failure is sticky: after one, every later step and update raises too, so an unprotected
update cannot leave by catching the first error and carrying on. Inside a Flower ``@app.train()`` function,
reply with :meth:`DefendedLoop.weights` (``w_0`` + the defended update), never the raw ``state_dict()``.
Not supported (refused): ``optimizer.step(closure)`` (the closure recomputes the gradient after the
defenses ran) and fused optimizers (they step on AMP-scaled gradients). gradleak's own clients
(:func:`gradleak.tasks.client.train_client`, the text :class:`~gradleak.tasks.text_client.LocalTrainer`) train
through it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from gradleak.data.base import ImageDataset
    from gradleak.data.text import TokenDataset

from gradleak.defenses.base import (
    Defense,
    DefenseChain,
    DefenseFailure,
    SetupContext,
    check_statistics,
    statistics_note,
)
from gradleak.defenses.presets import resolve
from gradleak.registry import DEFENSES
from gradleak.types import Update
from gradleak.validation import InvalidUpdateError, check_update, trainable_of

log = logging.getLogger(__name__)

DefenseSpec = Defense | str | tuple[str, Mapping[str, Any]]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def build_defenses(specs: Sequence[DefenseSpec]) -> list[Defense]:
    """Defense instances from instances, registered names or preset names (:mod:`~gradleak.defenses.presets`),
    or ``(name, options)`` pairs."""
    out: list[Defense] = []
    for spec in specs:
        if isinstance(spec, Defense):
            out.append(spec)
            continue
        try:
            component = resolve(spec)
        except TypeError:
            raise TypeError(
                f"a defense is a Defense, a registered name or (name, options), got {spec!r}"
            ) from None
        out.append(DEFENSES.create(component.name, **dict(component.options)))
    return out


class DefendedLoop:
    """A model, its optimizer and a defense chain; see the module docstring. Use :func:`defend`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory | None,
        defenses: Sequence[DefenseSpec],
        *,
        generator: torch.Generator,
        data: ImageDataset | TokenDataset | None = None,
        train_data: object | None = None,
        data_root: str | os.PathLike[str] | None = None,
        source: str = "client",
        criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.model, self.source = model, source
        self.chain = DefenseChain(build_defenses(defenses))
        self.failure: DefenseFailure | None = None
        self.steps = 0
        self._in_epoch_end = False
        # what the update carries: the parameters trainable before any defense's setup (a LoRA model's
        # adapters; every parameter of a model trained whole, frozen ones by AEGIS included, sending zeros)
        self.reference = {n: p.detach() for n, p in trainable_of(model).items()}  # names, shapes, dtypes
        # w_0 for the FedAvg delta (FedSGD needs no copy of the weights)
        self.w0 = {n: p.detach().clone() for n, p in self.reference.items()} if optimizer else None
        params = {n for n, _ in model.named_parameters()}
        self.b0 = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in params}
        context = SetupContext(generator, data, train_data, data_root, criterion)
        self._guard(lambda: self.chain.setup(model, context))
        self.optimizer: torch.optim.Optimizer | None = None
        if optimizer is not None:
            self.optimizer = optimizer([p for p in model.parameters() if p.requires_grad])
            if any(g.get("fused") for g in self.optimizer.param_groups):
                raise ValueError(
                    "fused optimizers step on loss-scaled gradients under AMP before any hook can unscale "
                    "them: build the optimizer with fused=False"
                )
            self._hook = self.optimizer.register_step_pre_hook(self._before_step)

    def _guard(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; any failure becomes (and stays) a :class:`DefenseFailure`."""
        if self.failure is not None:
            raise self.failure
        try:
            return fn()
        except DefenseFailure as exc:
            self.failure = exc
        except InvalidUpdateError as exc:
            self.failure = DefenseFailure(str(exc))
            self.failure.__cause__ = exc
        raise self.failure

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The optimizer's step pre-hook: the defenses see the gradient first (not inside Aegis' own
        synthetic step at epoch end, which is the defense's)."""
        if self._in_epoch_end:
            return
        if len(args) > 1 or kwargs.get("closure") is not None:  # args[0] is the optimizer; a closure
            self.failure = self.failure or DefenseFailure(
                "optimizer.step(closure) recomputes gradients after the defenses ran; use a closure-free "
                "optimizer in a defended loop"
            )
            raise self.failure
        self._guard(lambda: self.chain.on_gradients(self.model, self.steps))
        self.steps += 1

    def end_epoch(self) -> None:
        """After each local epoch: the defenses' ``on_epoch_end`` (with this loop's optimizer)."""
        if self.optimizer is None:
            raise ValueError("end_epoch needs an optimizer: pass one to defend()")
        self._in_epoch_end = True
        try:
            self._guard(lambda: self.chain.on_epoch_end(self.model, self.optimizer))  # type: ignore[arg-type]
        finally:
            self._in_epoch_end = False

    def _send(self, update: Update) -> Update:
        def finish() -> Update:
            out = self.chain.on_update(update)
            if update.buffers:  # statistics pass the defenses as trained (they defend the parameters)
                out = dataclasses.replace(out, buffers=update.buffers)
            check_update(out, self.reference, source=self.source)
            return out

        result: Update = self._guard(finish)
        return result

    def update(
        self, num_samples: int, metadata: Mapping[str, object] | None = None, *, statistics: str = "send"
    ) -> Update:
        """FedAvg: ``delta = w_T - w_0`` for every parameter, through the defenses' ``on_update``, with the
        model's buffers as trained (``statistics="send"``, what a FedAvg reply carries) or none
        (``"withhold"``, FedBN)."""
        if self.w0 is None:
            raise ValueError("update() needs the optimizer given to defend(); FedSGD sends gradient()")
        check_statistics(statistics)
        w0 = self.w0
        delta = {n: p.detach() - w0[n] for n, p in self.model.named_parameters() if n in w0}
        meta = {"local_steps": self.steps, **dict(metadata or {})}
        buffers = (
            {n: b.detach().clone() for n, b in self.model.named_buffers()} if statistics == "send" else {}
        )
        return self._send(Update(delta, num_samples, kind="delta", metadata=meta, buffers=buffers))

    def weights(self, num_samples: int, *, statistics: str = "send") -> dict[str, torch.Tensor]:
        """What a Flower ClientApp replies with: ``w_0 +`` the defended update (so ``on_update`` and the
        validation run, as for :meth:`update`) for every parameter, and the model's buffers as trained
        (``statistics="send"``) or as they were when :func:`defend` was called (``"withhold"``, FedBN:
        the running statistics of this client's data stay here). A differentially private defense's
        epsilon covers the parameters only: with ``send`` and BatchNorm statistics, a warning says so."""
        check_statistics(statistics)
        defended = self.update(num_samples)
        w0 = self.w0 or {}
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        for name, delta in defended.tensors.items():
            state[name] = w0[name] + delta
        floating = [k for k, v in self.b0.items() if v.is_floating_point()]
        note = statistics_note(self.chain.defenses, floating, statistics)
        if note is not None:
            log.warning("%s: %s", self.source, note)
        if statistics == "withhold":
            state.update({k: v.clone() for k, v in self.b0.items()})
        return state

    def gradient(self, num_samples: int, metadata: Mapping[str, object] | None = None) -> Update:
        """FedSGD: the gradient of the one backward pass, after ``on_gradients``, through ``on_update``
        (frozen or unused parameters send zeros; a defense that cleared every gradient, i.e. skipped the
        step, sends nothing rather than an all-zero "gradient")."""
        self._guard(lambda: self.chain.on_gradients(self.model, 0))
        if self.chain.defenses and all(p.grad is None for p in self.model.parameters()):
            self.failure = DefenseFailure(
                "every gradient was cleared by a defense (step skipped); nothing is sent"
            )
            raise self.failure
        grads = {
            n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in self.model.named_parameters()
            if n in self.reference
        }
        return self._send(Update(grads, num_samples, kind="gradient", metadata=dict(metadata or {})))


def defend(
    model: nn.Module,
    optimizer: OptimizerFactory | None,
    defenses: Sequence[DefenseSpec],
    *,
    generator: torch.Generator | None = None,
    data: ImageDataset | TokenDataset | None = None,
    train_data: object | None = None,
    data_root: str | os.PathLike[str] | None = None,
    copy_model: bool = False,
    source: str = "client",
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> DefendedLoop:
    """Apply ``defenses`` to training ``model`` in the caller's loop (see the module docstring).

    ``optimizer`` builds the optimizer from the parameters left trainable after ``setup`` (``None`` for
    FedSGD, which takes no step). ``generator`` drives the defenses' randomness (noise); by default it is
    seeded from the operating system (:func:`private_generator`), since noise drawn from a seed the server
    can guess can be subtracted. ``data`` is the client's private data for data-aware defenses (Aegis);
    it stays on the client. ``train_data`` is what local training draws its batches from, when not all
    of ``data`` (DP-SGD accounts its sampling rate from it). ``data_root``: where this party's data files
    are, for a defense that reads a public split (Aegis' generators; default ``$GRADLEAK_DATA``).
    ``criterion``: the loss the caller's loop minimises, when not cross-entropy (a ``(logits, labels) ->
    mean loss`` callable; Aegis' synthetic step descends it too). ``copy_model`` trains a private copy (then
    use ``loop.model``). ``source`` names the client in errors. Raises :class:`DefenseFailure` if a
    ``setup`` fails.
    """
    work = copy.deepcopy(model) if copy_model else model
    return DefendedLoop(work, optimizer, defenses, generator=generator or private_generator(), data=data,
                        train_data=train_data, data_root=data_root, source=source,
                        criterion=criterion)  # fmt: skip


def private_generator() -> torch.Generator:
    """A generator seeded from the operating system's randomness: a defense's noise that nobody, the
    server included, can regenerate. Pass a seeded generator only for reproducible experiments."""
    return torch.Generator().manual_seed(secrets.randbits(63))
