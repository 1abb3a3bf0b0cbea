"""One type for "a registered component by name, with its options": an attack, a defense, a generator.

Configs write it as a name or a table (``"ig"``, ``{ name = "ig", max_iterations = 100 }``), Python callers
as a name or a ``(name, options)`` pair; :func:`as_spec` turns each into a :class:`ComponentSpec`, so that
every layer (the config, the audit pipeline, the Flower wrappers, the in-loop defenses) reads one shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ComponentSpec:
    """A registered component by name plus its options (validated against its config dataclass when it is
    built); ``label``: the preset it was named by (:mod:`gradleak.defenses.presets`), its name in tables."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    label: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a component's name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.options, Mapping):
            raise ValueError(f"{self.name}: options must be a mapping, got {type(self.options).__name__}")


def as_spec(value: object) -> ComponentSpec:
    """``"ig"``, ``("ig", {options})`` or a :class:`ComponentSpec` as a :class:`ComponentSpec`."""
    if isinstance(value, ComponentSpec):
        return value
    if isinstance(value, str):
        return ComponentSpec(value)
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        return ComponentSpec(value[0], dict(value[1]))
    raise TypeError(f"a component is a name, a (name, options) pair or a ComponentSpec, got {value!r}"[:200])
