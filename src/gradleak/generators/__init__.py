"""Conditional generators for Aegis' synthetic cache (paper 000); diffusers is imported lazily."""

from gradleak.generators.base import ConditionalGenerator, align_images
from gradleak.generators.gaussian import ClassGaussianGenerator, GaussianGeneratorConfig

__all__ = ["ClassGaussianGenerator", "ConditionalGenerator", "GaussianGeneratorConfig", "align_images"]
