"""Flower (flwr) integration; needs the ``flower`` extra (``pip install gradleak[flower]``).

- :class:`DefenseMod`: gradleak's update-level defenses as a Flower client mod.
- :class:`AuditStrategy`: any Flower strategy, with gradleak's attacks on the updates its server receives.
"""

from gradleak.integrations.flower.audit import AuditStrategy
from gradleak.integrations.flower.mods import DefenseMod, UnsupportedModError, is_update_level

__all__ = ["AuditStrategy", "DefenseMod", "UnsupportedModError", "is_update_level"]
