"""Name -> factory registries for datasets, models, attacks and defenses.

One registry per kind, with a duplicate-name check and an error that lists the known names, instead of
if/elif factories. Attacks and defenses pair a config dataclass with the class it configures, so that
``create("ig", max_iterations=100)`` validates its overrides through the dataclass.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from gradleak.options import OptionError, build_dataclass

T = TypeVar("T")
MODALITIES = (None, "image", "text")


class UnknownNameError(KeyError):
    """A name that no registry entry carries; the message lists the names that exist."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered thing: a factory, its optional config dataclass, a one-line summary, and the modality
    it works on (``"image"``, ``"text"``; ``None``: any), checked against the task before any work."""

    name: str
    factory: T
    config_cls: type | None
    summary: str
    modality: str | None = None


class Registry(Generic[T]):
    """A named collection of factories of one kind ("dataset", "model", "attack", "defense")."""

    def __init__(self, kind: str, package: str | None = None) -> None:
        self.kind = kind
        self.package = package  # imported on first lookup: its modules register the built-in entries
        self._entries: dict[str, Entry[T]] = {}
        self._populated = package is None

    def _populate(self) -> None:
        """Complete on first use: ``ATTACKS.create("sme")`` works without importing gradleak.attacks."""
        if not self._populated:
            self._populated = True
            importlib.import_module(self.package)  # type: ignore[arg-type]

    def register(
        self,
        name: str,
        factory: T,
        *,
        config_cls: type | None = None,
        summary: str = "",
        modality: str | None = None,
    ) -> T:
        key = name.lower()
        if modality not in MODALITIES:
            raise ValueError(
                f"modality of {self.kind} {name!r} must be one of {MODALITIES}, got {modality!r}"
            )
        if key in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        if config_cls is not None and not dataclasses.is_dataclass(config_cls):
            raise TypeError(f"config_cls for {self.kind} {name!r} must be a dataclass, got {config_cls!r}")
        self._entries[key] = Entry(key, factory, config_cls, summary, modality)
        return factory

    def entry(self, name: str) -> Entry[T]:
        self._populate()
        try:
            return self._entries[name.lower()]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; known {self.kind}s: {known}") from None

    def get(self, name: str) -> T:
        return self.entry(name).factory

    def names(self) -> list[str]:
        self._populate()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        self._populate()
        return isinstance(name, str) and name.lower() in self._entries

    def __iter__(self) -> Iterator[Entry[T]]:
        self._populate()
        return iter(self._entries[k] for k in sorted(self._entries))

    def make_config(self, name: str, overrides: Mapping[str, Any] | None = None) -> Any:
        """Build the entry's config dataclass from ``overrides``; unknown keys are a clear error."""
        entry = self.entry(name)
        if entry.config_cls is None:
            if overrides:
                raise OptionError(f"{self.kind} {name!r} takes no options, got {sorted(overrides)}")
            return None
        return build_dataclass(entry.config_cls, overrides or {}, where=f"{self.kind} {name!r}")

    def create(self, name: str, **overrides: Any) -> Any:
        """``factory(config)`` for entries with a config class, else ``factory(**overrides)``."""
        entry = self.entry(name)
        factory: Callable[..., Any] = entry.factory  # type: ignore[assignment]
        if entry.config_cls is None:
            return factory(**overrides)
        return factory(self.make_config(name, overrides))


DATASETS: Registry[Callable[..., Any]] = Registry("dataset", "gradleak.data")
MODELS: Registry[Callable[..., Any]] = Registry("model", "gradleak.models")
ATTACKS: Registry[Callable[..., Any]] = Registry("attack", "gradleak.attacks")
DEFENSES: Registry[Callable[..., Any]] = Registry("defense", "gradleak.defenses")
ENGINES: Registry[Callable[..., Any]] = Registry("engine", "gradleak.fl.engines")
