"""Name -> factory registries for datasets, models, attacks and defenses.

One registry per kind, with a duplicate-name check and an error that lists the known names, instead of
if/elif factories. Attacks and defenses pair a config dataclass with the class it configures, so that
``create("ig", max_iterations=100)`` validates its overrides through the dataclass.

Users add their own entries from a plugin module (:mod:`gradleak.plugins`); a registry is complete on
first use: its built-in package and the installed ``gradleak.plugins`` entry points are imported then. The
data set and model registries check, when an entry is registered, that its factory has the call signature
the runner uses (:class:`DatasetLoader`, :class:`ModelFactory`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from torch import nn

    from gradleak.data.base import ImageDataset

from gradleak.device import DEVICE_TYPES
from gradleak.options import OptionError, build_dataclass

T = TypeVar("T")
MODALITIES = (None, "image", "text")


class DatasetLoader(Protocol):
    """A data set's loader: ``split`` of it under the data ``root``, its first ``limit`` samples. Entries
    registered with a ``config_cls`` also receive ``config=`` (the experiment's ``data.options``)."""

    def __call__(
        self, *, split: str = ..., root: str | os.PathLike[str] | None = None, limit: int | None = None
    ) -> ImageDataset: ...


class ModelFactory(Protocol):
    """A model: built for ``input_shape`` (C, H, W) and ``num_classes`` with the config's model options."""

    def __call__(self, input_shape: tuple[int, int, int], num_classes: int, **options: Any) -> nn.Module: ...


def _check_signature(kind: str, name: str, factory: object, *args: Any, **kwargs: Any) -> None:
    """A registered factory must accept the call the runner makes (checked when it is registered)."""
    if not callable(factory):
        raise TypeError(f"{kind} {name!r}: the factory must be callable, got {type(factory).__name__}")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    try:
        signature.bind_partial(*args, **kwargs)
    except TypeError as exc:
        call = ", ".join([*map(repr, args), *(f"{k}=..." for k in kwargs)])
        raise TypeError(f"{kind} {name!r}: the factory must accept ({call}): {exc}") from None


def check_loader(name: str, factory: object) -> None:
    _check_signature("dataset", name, factory, split="train", root=None, limit=None)


def check_model(name: str, factory: object) -> None:
    _check_signature("model", name, factory, (1, 28, 28), 2)


def decorator_into(table: dict[str, T], kind: str) -> Callable[[str], Callable[[T], T]]:
    """``@register(name)`` adding a function to ``table`` (checks of the pre-flight, of the client's guard);
    a name registered twice is an error that names the ``kind``."""

    def register(name: str) -> Callable[[T], T]:
        def add(item: T) -> T:
            if name in table:
                raise ValueError(f"{kind} {name!r} is already registered")
            table[name] = item
            return item

        return add

    return register


class UnknownNameError(KeyError):
    """A name that no registry entry carries; the message lists the names that exist."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered thing: a factory, its optional config dataclass, a one-line summary, the modality
    it works on (``"image"``, ``"text"``; ``None``: any), checked against the task before any work, and the
    device types it computes on (an attack: ``("cpu", "cuda")`` when it runs where the observation's model
    is; ``("cpu",)``, the default, runs on a CPU copy of the observation, :mod:`gradleak.device`)."""

    name: str
    factory: T
    config_cls: type | None
    summary: str
    modality: str | None = None
    devices: tuple[str, ...] = ("cpu",)


class Registry(Generic[T]):
    """A named collection of factories of one kind ("dataset", "model", "attack", "defense")."""

    def __init__(
        self, kind: str, package: str | None = None, check: Callable[[str, object], None] | None = None
    ) -> None:
        self.kind = kind
        self.package = package  # imported on first lookup: its modules register the built-in entries
        self.check = check  # of each factory, when it is registered
        self._entries: dict[str, Entry[T]] = {}
        self._renamed: dict[str, tuple[str, str]] = {}  # old name -> (new name, why)
        self._populated = package is None

    def _populate(self) -> None:
        """Complete on first use: ``ATTACKS.create("sme")`` works without importing gradleak.attacks, and
        the installed plugins' entry points are loaded."""
        if not self._populated:
            self._populated = True
            importlib.import_module(self.package)  # type: ignore[arg-type]
            from gradleak import plugins

            plugins.load_entry_points()

    def register(
        self,
        name: str,
        factory: T,
        *,
        config_cls: type | None = None,
        summary: str = "",
        modality: str | None = None,
        devices: tuple[str, ...] = ("cpu",),
    ) -> T:
        self._populate()  # the built-ins first: a plugin that reuses a built-in name is told so
        key = name.lower()
        if modality not in MODALITIES:
            raise ValueError(
                f"modality of {self.kind} {name!r} must be one of {MODALITIES}, got {modality!r}"
            )
        if key in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        if config_cls is not None and not dataclasses.is_dataclass(config_cls):
            raise TypeError(f"config_cls for {self.kind} {name!r} must be a dataclass, got {config_cls!r}")
        if "cpu" not in devices or not set(devices) <= set(DEVICE_TYPES):
            raise ValueError(
                f"devices of {self.kind} {name!r} must include 'cpu', of {DEVICE_TYPES}: {devices!r}"
            )
        if self.check is not None:
            self.check(name, factory)
        self._entries[key] = Entry(key, factory, config_cls, summary, modality, tuple(devices))
        return factory

    def rename(self, old: str, new: str, why: str) -> None:
        """``old`` was renamed ``new``: looking ``old`` up is an error that says so (and why), not a
        silent alias, so that a config that used it is read again."""
        if new.lower() not in self._entries:
            raise ValueError(f"{self.kind} {new!r} is not registered")
        self._renamed[old.lower()] = (new.lower(), why)

    def entry(self, name: str) -> Entry[T]:
        self._populate()
        try:
            return self._entries[name.lower()]
        except KeyError:
            if name.lower() in self._renamed:
                new, why = self._renamed[name.lower()]
                raise UnknownNameError(f"{self.kind} {name!r} was renamed {new!r}: {why}") from None
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


DATASETS: Registry[Callable[..., Any]] = Registry("dataset", "gradleak.data", check=check_loader)
MODELS: Registry[Callable[..., Any]] = Registry("model", "gradleak.models", check=check_model)
ATTACKS: Registry[Callable[..., Any]] = Registry("attack", "gradleak.attacks")
DEFENSES: Registry[Callable[..., Any]] = Registry("defense", "gradleak.defenses")
ENGINES: Registry[Callable[..., Any]] = Registry("engine", "gradleak.fl.engines")
# Conditional image generators for Aegis' synthetic cache: ``factory(data, config, *, generator)`` fits one
# on a client's (or a sanctioned public) data set and returns a ConditionalGenerator
GENERATORS: Registry[Callable[..., Any]] = Registry("generator", "gradleak.generators")
