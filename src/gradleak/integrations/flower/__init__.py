"""Flower (flwr) integration; needs the ``flower`` extra (``pip install gradleak[flower]``).

- :class:`DefenseMod`: gradleak's update-level defenses as a Flower client mod.
- :class:`GuardMod`: the client's guard, refusing to train a malicious model.
- :class:`GateMod`: the client's leakage gate, attacking its own update and defending it when it leaks.
- :class:`AuditStrategy`: any Flower strategy, with gradleak's attacks on the updates its server receives.
- :class:`LegacyAuditStrategy`: the same for a legacy Flower strategy, as Flower's SecAgg+ workflow drives
  (under SecAgg+ only the unmasked aggregate is attacked).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradleak.lazy import lazy_exports

# imported on first use: loading gradleak's ``flower`` engine plugin (:mod:`.plugin`) must not import Flower
_EXPORTS = {
    "AuditStrategy": "gradleak.integrations.flower.audit",
    "LegacyAuditStrategy": "gradleak.integrations.flower.legacy",
    "DefenseMod": "gradleak.integrations.flower.mods",
    "GateMod": "gradleak.integrations.flower.mods",
    "GuardMod": "gradleak.integrations.flower.mods",
    "UnsupportedModError": "gradleak.integrations.flower.mods",
    "is_update_level": "gradleak.integrations.flower.mods",
}
__all__ = [  # the names of _EXPORTS (a test keeps the two equal)
    "AuditStrategy", "LegacyAuditStrategy", "DefenseMod", "GateMod", "GuardMod", "UnsupportedModError",
    "is_update_level",
]  # fmt: skip

if TYPE_CHECKING:
    from gradleak.integrations.flower.audit import AuditStrategy
    from gradleak.integrations.flower.legacy import LegacyAuditStrategy
    from gradleak.integrations.flower.mods import (
        DefenseMod,
        GateMod,
        GuardMod,
        UnsupportedModError,
        is_update_level,
    )


__getattr__ = lazy_exports(__name__, _EXPORTS)
