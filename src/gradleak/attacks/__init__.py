"""Attacks: each sees only an Observation and returns a Reconstruction. ``create_attack(name, **opts)``."""

from __future__ import annotations

from typing import Any

from gradleak.attacks import image as _image  # noqa: F401  (registers)
from gradleak.attacks import linear as _linear  # noqa: F401
from gradleak.attacks import text as _text  # noqa: F401
from gradleak.registry import ATTACKS
from gradleak.types import Attack


def create_attack(name: str, **overrides: Any) -> Attack:
    """Build a registered attack; unknown names and unknown options are clear errors."""
    attack: Attack = ATTACKS.create(name, **overrides)
    return attack


__all__ = ["create_attack"]
