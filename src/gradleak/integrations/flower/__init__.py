"""Flower (flwr) integration; needs the ``flower`` extra (``pip install gradleak[flower]``).

- :class:`DefenseMod`: gradleak's update-level defenses as a Flower client mod.
- :class:`GuardMod`: the client's guard, refusing to train a malicious model.
- :class:`GateMod`: the client's leakage gate, attacking its own update and defending it when it leaks.
- :class:`AuditStrategy`: any Flower strategy, with gradleak's attacks on the updates its server receives.
- :class:`LegacyAuditStrategy`: the same for a legacy Flower strategy, as Flower's SecAgg+ workflow drives
  (under SecAgg+ only the unmasked aggregate is attacked).
"""

from gradleak.integrations.flower.audit import AuditStrategy
from gradleak.integrations.flower.legacy import LegacyAuditStrategy
from gradleak.integrations.flower.mods import (
    DefenseMod,
    GateMod,
    GuardMod,
    UnsupportedModError,
    is_update_level,
)

__all__ = [
    "AuditStrategy",
    "LegacyAuditStrategy",
    "DefenseMod",
    "GateMod",
    "GuardMod",
    "UnsupportedModError",
    "is_update_level",
]
