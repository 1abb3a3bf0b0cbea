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
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:  # what each registry builds (type checking only: the registries sit below them all)
    import numpy as np
    import torch
    from torch import nn

    from gradleak.data.base import ImageDataset
    from gradleak.data.text import TextDataset
    from gradleak.defenses.aegis.generators.base import ConditionalGenerator
    from gradleak.defenses.base import Defense
    from gradleak.defenses.presets import Preset
    from gradleak.federation.engines import EngineRunner
    from gradleak.models.text import TextModel
    from gradleak.tasks.base import Task
    from gradleak.types import Attack

from gradleak.device import DEVICE_TYPES
from gradleak.options import OptionError, build_dataclass

T = TypeVar("T")
log = logging.getLogger(__name__)
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
class Entry(Generic[T]):  # T: what the factory builds
    """One registered thing: a factory, its optional config dataclass, a one-line summary, the modality
    it works on (``"image"``, ``"text"``; ``None``: any), checked against the task before any work, and the
    device types it computes on (an attack: ``("cpu", "cuda")`` when it runs where the observation's model
    is; ``("cpu",)``, the default, runs on a CPU copy of the observation, :mod:`gradleak.device`)."""

    name: str
    factory: Callable[..., T]
    config_cls: type | None
    summary: str
    modality: str | None = None
    devices: tuple[str, ...] = ("cpu",)


class Registry(Generic[T]):
    """A named collection of factories of one kind ("dataset", "model", "attack", "defense", ...), each
    building a ``T``: ``ATTACKS.create("ig")`` is an :class:`~gradleak.types.Attack` to the type checker."""

    def __init__(
        self, kind: str, package: str | None = None, check: Callable[[str, object], None] | None = None
    ) -> None:
        self.kind = kind
        self.package = package  # imported on first lookup: its modules register the built-in entries
        self.check = check  # of each factory, when it is registered
        self._entries: dict[str, Entry[T]] = {}
        self._renamed: dict[str, tuple[str, str]] = {}  # old name -> (new name, why): an error
        self._aliases: dict[str, tuple[str, str]] = {}  # old name -> (new name, why): a warning
        self._populated = self._builtins_imported = package is None

    def _import_builtins(self) -> None:
        """The built-in package, whose modules register the built-in entries (a no-op while it is being
        imported: its own ``register`` calls come from there)."""
        if not self._builtins_imported:
            self._builtins_imported = True
            importlib.import_module(self.package)  # type: ignore[arg-type]

    def _populate(self) -> None:
        """Complete on first lookup: ``ATTACKS.create("sme")`` works without importing gradleak.attacks, and
        the installed plugins' entry points are loaded. Registering loads the built-ins only: a built-in
        module registers while it is imported, when a plugin that needs another package half imported
        must not run yet."""
        self._import_builtins()
        if not self._populated:
            self._populated = True
            from gradleak import plugins

            plugins.load_entry_points()

    def register(
        self,
        name: str,
        factory: Callable[..., T],
        *,
        config_cls: type | None = None,
        summary: str = "",
        modality: str | None = None,
        devices: tuple[str, ...] = ("cpu",),
    ) -> Callable[..., T]:
        self._import_builtins()  # the built-ins first: a plugin that reuses a built-in name is told so
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

    def alias(self, old: str, new: str, why: str) -> None:
        """``old`` is now ``new``: looking ``old`` up still works and logs a warning that says why, so that
        existing configs run while their authors are told."""
        if new.lower() not in self._entries:
            raise ValueError(f"{self.kind} {new!r} is not registered")
        if old.lower() in self._entries:
            raise ValueError(f"{self.kind} {old!r} is registered: it cannot also be an alias")
        self._aliases[old.lower()] = (new.lower(), why)

    def canonical(self, name: str) -> str:
        """The registered name ``name`` stands for (itself, or the new name of an alias, with its warning)."""
        self._populate()
        key = name.lower()
        if key in self._aliases and key not in self._entries:
            new, why = self._aliases[key]
            log.warning("%s %r is now called %r (%s); the old name still works", self.kind, name, new, why)
            return new
        return key

    def entry(self, name: str) -> Entry[T]:
        try:
            return self._entries[self.canonical(name)]
        except KeyError:
            if name.lower() in self._renamed:
                new, why = self._renamed[name.lower()]
                raise UnknownNameError(f"{self.kind} {name!r} was renamed {new!r}: {why}") from None
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; known {self.kind}s: {known}") from None

    def get(self, name: str) -> Callable[..., T]:
        return self.entry(name).factory

    def names(self) -> list[str]:
        self._populate()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        self._populate()
        return isinstance(name, str) and (name.lower() in self._entries or name.lower() in self._aliases)

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

    def create(self, name: str, **overrides: Any) -> T:
        """``factory(config)`` for entries with a config class, else ``factory(**overrides)``."""
        entry = self.entry(name)
        if entry.config_cls is None:
            return entry.factory(**overrides)
        return entry.factory(self.make_config(name, overrides))


DATASETS: Registry[ImageDataset | TextDataset] = Registry("dataset", "gradleak.data", check=check_loader)
MODELS: Registry[nn.Module | TextModel] = Registry("model", "gradleak.models", check=check_model)
ATTACKS: Registry[Attack] = Registry("attack", "gradleak.attacks")
DEFENSES: Registry[Defense] = Registry("defense", "gradleak.defenses")
# A defense at the settings a paper or a table names (``dp_sgd_eps8``, ``prune_90``): ``factory()`` -> Preset
PRESETS: Registry[Preset] = Registry("defense preset", "gradleak.defenses.presets")
ENGINES: Registry[EngineRunner] = Registry("engine", "gradleak.federation.engines")
# Conditional image generators for Aegis' synthetic cache: ``factory(data, config, *, generator, root)`` fits
# one on a client's data set (or a sanctioned public split read under the data ``root``)
GENERATORS: Registry[ConditionalGenerator] = Registry("generator", "gradleak.defenses.aegis.generators")
# Learning tasks: ``factory(**fields)`` (a frozen dataclass; ``mode`` train|eval), rebuilt by name on a node
TASKS: Registry[Task] = Registry("task", "gradleak.tasks")
# How a data set is split among clients: ``factory(dataset, num_clients, rng, **options)`` -> index arrays
PARTITIONERS: Registry[list[np.ndarray]] = Registry("partitioner", "gradleak.data.partition")
# A client's local optimiser: ``factory(params, lr=..., weight_decay=...[, momentum=...])`` (LocalTraining)
OPTIMIZERS: Registry[torch.optim.Optimizer] = Registry("optimizer", "gradleak.tasks.client")
# A client's classification loss: ``factory()`` -> ``loss(logits, target)`` (LocalTraining.loss)
LOSSES: Registry[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = Registry(
    "loss", "gradleak.tasks.losses"
)
# How a client cuts its data into local batches: ``factory()`` -> ``batches(n, labels, batch_size, *,
# shuffle, generator)`` (LocalTraining.batching)
SAMPLERS: Registry[Callable[..., list[torch.Tensor]]] = Registry("batching", "gradleak.tasks.batching")
# The server's adaptive FedOpt optimiser (fl.server_optimizer; "sgd" is FedAvg's plain step, no optimiser)
SERVER_OPTIMIZERS: Registry[torch.optim.Optimizer] = Registry(
    "server optimizer", "gradleak.federation.server"
)
