"""Which attack, at which budget, fits the recipe an operator states; a warning when a budget is too small.

An audit that runs the wrong attack, or the right one at a small budget, reports little leakage and looks
like safety: Inverting Gradients at 20-100 iterations reconstructs noise on a Flower quickstart CNN (3.2 dB
*below* the null floor) where at 1,000 it is 4.9 dB above it. :func:`auto_attacks` picks by what the
server knows:

- a transformer (a ``transformers`` model): DAGER (exact sequences from the attention-gradient span;
  Petrov et al. 2024) and the embedding row-norm token set (paper 002, channel 2), for FedSGD and FedAvg;
- an image model trained with FedAvg (``training.protocol == "fedavg"``): PI-SME, the path-integral
  surrogate that leads on multi-step updates (paper 001, Table 1);
- an image model trained with FedSGD, or a recipe the server does not know: Inverting Gradients (Geiping
  et al. 2020; cosine matching is blind to the update's scale, so it reads a delta as well);

each at its registered default budget (tuned, with the source in its config's docstring).
:func:`budget_warnings` names every configured budget below a quarter of that default.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from torch import nn

from gradleak.registry import ATTACKS
from gradleak.spec import ComponentSpec
from gradleak.types import LocalTraining

log = logging.getLogger(__name__)

BUDGET_OPTIONS = ("max_iterations", "iterations", "steps")
BUDGET_SHARE = 0.25  # a configured budget below this share of the default is warned about


def is_transformer(model: nn.Module) -> bool:
    """A Hugging Face ``transformers`` model (or one wrapping it as ``.model``): a text audit."""
    inner = getattr(model, "model", model)
    return any(type(m).__module__.startswith("transformers.") for m in (model, inner))


def auto_attacks(
    model: nn.Module, training: LocalTraining | None, budget: int | None = None
) -> tuple[list[ComponentSpec], str]:
    """The attacks :mod:`this module <gradleak.audit.choice>` picks for ``model`` under ``training``, and
    the reason, in words. ``budget`` replaces the default budget of each picked attack that has one (its
    ``max_iterations``, ``iterations`` or ``steps``): a quicker audit, warned about below a quarter of the
    default (:func:`budget_warnings`)."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"the auto attacks' budget must be an int >= 1, got {budget!r}")
    if is_transformer(model):
        names = ["dager", "embedding_norm"]
        why = ("a transformer: DAGER (exact sequences from the attention-gradient span) and the embedding "
               "row-norm token set")  # fmt: skip
    elif training is not None and training.protocol == "fedavg":
        names = ["pisme"]
        why = ("an image model under FedAvg: PI-SME, the surrogate-path attack that leads on multi-step "
               "updates (paper 001)")  # fmt: skip
    else:
        recipe = "FedSGD" if training is not None else "a recipe the server does not know"
        names, why = ["ig"], f"an image model under {recipe}: Inverting Gradients"
    specs = []
    for name in names:
        default = default_budget(name)
        options = {} if budget is None or default is None else {default[0]: budget}
        specs.append(ComponentSpec(name, options))
    applied = [s.name for s in specs if s.options]
    return specs, why if not applied else f"{why}; budget {budget} ({', '.join(applied)})"


def resolve_attacks(
    attacks: str | Sequence[ComponentSpec], model: nn.Module, training: LocalTraining | None
) -> tuple[list[ComponentSpec], str]:
    """An audit's attacks as configured: ``"auto"``, or ``[ComponentSpec("auto", {"budget": n})]`` (the
    auto choice at budget ``n``), or the attacks themselves; with the reason for the choice."""
    if isinstance(attacks, str):
        if attacks != "auto":
            raise ValueError(f'attacks must be "auto" or a list of attacks, got {attacks!r}')
        return auto_attacks(model, training)
    autos = [s for s in attacks if s.name == "auto"]
    if not autos:
        return list(attacks), "configured"
    if len(attacks) != 1 or set(autos[0].options) - {"budget"}:
        raise ValueError(
            'an "auto" attack stands alone and takes one option, budget (the picked attacks\' iterations); '
            f"got {[(s.name, dict(s.options)) for s in attacks]}"
        )
    return auto_attacks(model, training, autos[0].options.get("budget"))


def default_budget(name: str) -> tuple[str, int] | None:
    """The registered default of attack ``name``'s budget option, if it has one."""
    config = ATTACKS.entry(name).config_cls if name in ATTACKS else None
    if config is None or not dataclasses.is_dataclass(config):
        return None
    for f in dataclasses.fields(config):
        if f.name in BUDGET_OPTIONS and isinstance(f.default, int):
            return f.name, f.default
    return None


def budget_warnings(specs: Sequence[ComponentSpec]) -> list[str]:
    """One sentence per attack whose configured budget is below a quarter of its default."""
    out = []
    for spec in specs:
        default = default_budget(spec.name)
        if default is None:
            continue
        key, value = default
        given = spec.options.get(key)
        if isinstance(given, int) and given < BUDGET_SHARE * value:
            out.append(
                f"{spec.name}: {key} = {given} is below a quarter of its default {value}; an attack that "
                "fails at a small budget shows its own limit, not that the updates are safe"
            )
    return out
