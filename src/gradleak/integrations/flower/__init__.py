"""Flower (flwr) integration; needs the ``flower`` extra (``pip install gradleak[flower]``).

- :class:`DefenseMod`: gradleak's update-level defenses as a Flower client mod.
"""

from gradleak.integrations.flower.mods import DefenseMod, UnsupportedModError, is_update_level

__all__ = ["DefenseMod", "UnsupportedModError", "is_update_level"]
