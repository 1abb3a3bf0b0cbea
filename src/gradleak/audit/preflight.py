"""Checks before round 1: one entry point that every pre-flight check joins.

An audit that finds out in round 1's aggregation (or after an hour of training) that its attack cannot
read the protocol, its budget is too small to mean anything, or the model expects other inputs than the
attack reconstructs, has wasted the run, and on a Flower server it has stopped the ServerApp. Each check
here is registered in :data:`CHECKS` and reads a :class:`Preflight` (what is known before round 1: the
attacks, the recipe, the model, sample images where the operator has some: ``truth`` or a public split),
returning :class:`Finding` s: an ``error`` stops the audit before any work, a ``warning`` is logged and
shown in the report. ``gradleak check CONFIG`` runs them on a config
(:mod:`gradleak.cli.check`); the Flower audit wrappers run them when they are built.

Registered here: the attack's budget (:func:`gradleak.audit.choice.budget_warnings`), the attack's fit
for the update it will see (a surrogate-path attack needs a multi-step FedAvg delta; a text attack a
transformer), and the model's input range (the attacks reconstruct pixels in [0, 1]: a model that
expects normalised inputs must normalise inside ``forward``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from gradleak.audit.choice import budget_warnings, is_transformer
from gradleak.registry import ATTACKS, decorator_into
from gradleak.spec import ComponentSpec
from gradleak.types import AttackNeeds, LocalTraining
from gradleak.update import DEFAULT_BATCHING

log = logging.getLogger(__name__)

NORMALISE = (
    "the attacks reconstruct pixels in [0, 1] and feed them to the model: normalise inside the model "
    "instead (a subclass whose forward applies (x - mean) / std with mean and std as non-persistent "
    "buffers keeps the state_dict, docs/deployment.md)"
)


@dataclass(frozen=True)
class Finding:
    """What one check found: ``error`` (the audit cannot mean anything as configured) or ``warning``."""

    level: Literal["error", "warning"]
    check: str
    message: str


@dataclass
class Preflight:
    """What is known before round 1. ``update_kind``: what the attacks will read (``"gradient"``, a FedSGD
    gradient; ``"delta"``, ``w_T - w_0``, what a Flower server computes from any reply); ``images``: sample
    inputs of the task (the operator's ``truth`` or public split), when there are some."""

    attacks: Sequence[ComponentSpec]
    model: nn.Module
    update_kind: str
    recipe_known: bool = True
    images: torch.Tensor | None = None
    recipe: LocalTraining | None = None  # the clients' recipe, where stated


Check = Callable[[Preflight], list[Finding]]
CHECKS: dict[str, Check] = {}


register_check = decorator_into(CHECKS, "pre-flight check")
"""``@register_check(name)``: add a pre-flight check (a plugin's too)."""


def run_checks(context: Preflight) -> list[Finding]:
    """Every registered check on ``context``, in registration order; a check that raises is an error
    finding that names it (a broken check must not pass silently)."""
    out: list[Finding] = []
    for name, check in CHECKS.items():
        try:
            out += check(context)
        except Exception as exc:  # noqa: BLE001 - reported as the check's own failure
            out.append(Finding("error", name, f"the check itself failed: {type(exc).__name__}: {exc}"))
    return out


@register_check("budget")
def _budget(context: Preflight) -> list[Finding]:
    return [Finding("warning", "budget", w) for w in budget_warnings(context.attacks)]


@register_check("attack fit")
def _fit(context: Preflight) -> list[Finding]:
    out = []
    text = is_transformer(context.model)
    for spec in context.attacks:
        if spec.name not in ATTACKS:
            out.append(Finding("error", "attack fit", f"unknown attack {spec.name!r}"))
            continue
        entry = ATTACKS.entry(spec.name)
        needs = getattr(entry.factory, "needs", AttackNeeds())  # what the attack class declares
        if context.update_kind not in needs.update_kinds:
            reads = " or ".join(needs.update_kinds)
            out.append(Finding("error", "attack fit", (
                f"{spec.name} reads {reads} updates, but this audit sees a {context.update_kind} (FedSGD "
                "sends a gradient; use ig or dlg, or audit a FedAvg round)")))  # fmt: skip
        recipe = context.recipe
        sgd = context.recipe_known and recipe is not None and recipe.plain_sgd
        if needs.sgd_delta and context.update_kind == "delta" and not sgd:
            out.append(Finding("error", "attack fit", (
                f"{spec.name} reads a FedAvg delta as plain SGD's mean gradient: state a plain SGD recipe "
                "(training=; no momentum, weight decay or same-label batches) or audit FedSGD")))  # fmt: skip
        if needs.public_recipe and not context.recipe_known:
            out.append(Finding("error", "attack fit", (
                f"{spec.name} needs the clients' training recipe (lr, epochs, batch size): state it "
                "(training=) or pick an attack that does not (ig)")))  # fmt: skip
        modality = entry.modality
        if modality is not None and (modality == "text") != text:
            what = "a transformer" if text else "an image model"
            out.append(
                Finding("error", "attack fit", f"{spec.name} is a {modality} attack; the model is {what}")
            )
    return out


@register_check("recipe model")
def _recipe_model(context: Preflight) -> list[Finding]:
    """An attack that simulates the clients' local steps (it needs the recipe) models plain SGD on random
    batches: say so where the stated recipe adds momentum or same-label batches (the attack then reads a
    path it does not model; expect it to be weaker than it could be, not the update to be safer)."""
    recipe = context.recipe
    if recipe is None or (not recipe.momentum and recipe.batching == DEFAULT_BATCHING):
        return []
    extras = [f"momentum {recipe.momentum:g}"] if recipe.momentum else []
    extras += [f"batching {recipe.batching!r}"] if recipe.batching != DEFAULT_BATCHING else []
    out = []
    for spec in context.attacks:
        if spec.name not in ATTACKS:
            continue  # "attack fit" names it
        if getattr(ATTACKS.entry(spec.name).factory, "needs", AttackNeeds()).public_recipe:
            out.append(Finding("warning", "recipe model", (
                f"{spec.name} models the local steps as plain SGD on random batches; the recipe's "
                f"{' and '.join(extras)} is not modelled: a weak result shows the attack's limit, not "
                "safety")))  # fmt: skip
    return out


@register_check("input range")
def _input_range(context: Preflight) -> list[Finding]:
    images = context.images
    if images is None or is_transformer(context.model) or not images.is_floating_point():
        return []
    low, high = float(images.min()), float(images.max())
    if low < -1e-6 or high > 1 + 1e-6:
        span = f"the task's images span [{low:.3g}, {high:.3g}], not [0, 1]: "
        return [Finding("error", "input range", span + NORMALISE)]
    return []


class PreflightError(ValueError):
    """An audit that cannot mean anything as configured; the message lists every error found."""


def enforce(findings: Sequence[Finding], where: str) -> list[str]:
    """Raise :class:`PreflightError` listing the errors; log the warnings and return them as sentences."""
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise PreflightError(f"{where}: " + "; ".join(f"[{f.check}] {f.message}" for f in errors))
    warnings = [f"[{f.check}] {f.message}" for f in findings if f.level == "warning"]
    for w in warnings:
        log.warning("%s: %s", where, w)
    return warnings
