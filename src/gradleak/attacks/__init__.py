"""Attacks: each sees only an Observation and returns a Reconstruction. ``create_attack(name, **opts)``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradleak.attacks import image as _image  # noqa: F401  (registers)
from gradleak.attacks import linear as _linear  # noqa: F401
from gradleak.attacks import text as _text  # noqa: F401
from gradleak.registry import ATTACKS
from gradleak.types import Attack, ModelModifyingAttack


def create_attack(name: str, **overrides: Any) -> Attack:
    """Build a registered attack; unknown names and unknown options are clear errors."""
    attack: Attack = ATTACKS.create(name, **overrides)
    return attack


def model_modifying(name: str, options: Mapping[str, Any] | None = None) -> bool:
    """Whether the attack ``name`` with ``options`` modifies the model the server broadcasts (a malicious
    server, :class:`~gradleak.types.ModelModifyingAttack`); False for a name no longer registered."""
    if name not in ATTACKS:
        return False
    return isinstance(create_attack(name, **(options or {})), ModelModifyingAttack)


__all__ = ["create_attack", "model_modifying"]
