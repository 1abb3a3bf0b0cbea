"""Conditional generators for Aegis' synthetic cache (paper 000), registered in
:data:`gradleak.registry.GENERATORS`: ``gaussian`` (built in), ``diffusion`` (needs ``diffusers``, imported
only when one is built), ``oracle`` (diagnostic: real public images)."""

from gradleak.defenses.aegis.generators import diffusion, oracle  # noqa: F401  (registration)
from gradleak.defenses.aegis.generators.base import ConditionalGenerator, PublicSplit, align_images
from gradleak.defenses.aegis.generators.gaussian import ClassGaussianGenerator, GaussianGeneratorConfig

__all__ = [
    "ClassGaussianGenerator",
    "ConditionalGenerator",
    "GaussianGeneratorConfig",
    "PublicSplit",
    "align_images",
]
