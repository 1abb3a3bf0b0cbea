"""Optimisation-based image attacks (gradient inversion)."""

from gradleak.attacks.image import ig as _ig  # noqa: F401  (registers)
