"""Plugins: a user's own data sets, models, attacks and defenses, without editing gradleak.

A plugin is a Python module that registers its entries when imported, with the registries every built-in
uses (:mod:`gradleak.registry`)::

    # blood.py
    from gradleak.registry import DATASETS, MODELS

    def load_blood(split="train", root=None, limit=None):      # a DatasetLoader
        ...
        return ImageDataset("blood", images, labels, num_classes=8)

    DATASETS.register("blood", load_blood, summary="my blood-cell slides", modality="image")
    MODELS.register("blood_net", BloodNet, summary="my classifier", modality="image")  # a ModelFactory

It is loaded by ``gradleak run --plugin blood.py config.toml`` (or ``--plugin my_package.module``; the
flag repeats, and ``gradleak list --plugin ...`` shows what it registered), by the config's
``experiment.plugins = ["blood.py"]`` (paths relative to the config file), or, for an installed package,
by an entry point in the group ``gradleak.plugins`` (``[project.entry-points."gradleak.plugins"] blood =
"my_package.blood"``), loaded the first time any registry is used. A plugin that fails to import is an
error that names it, before any work.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "gradleak.plugins"
_loaded: dict[str, ModuleType] = {}  # by resolved file path or module name
_entry_points: set[str] = set()  # the names of the entry points already loaded


class PluginError(ValueError):
    """A plugin that cannot be found or raised while it was imported."""


def is_plugin_file(spec: str) -> bool:
    """Whether a plugin spec names a file (code that travels with a config) rather than a module name."""
    return spec.endswith(".py") or "/" in spec or "\\" in spec


def load_plugin(spec: str, *, base: Path | None = None, search_cwd: bool = True) -> ModuleType:
    """Import plugin ``spec``: a ``.py`` file (relative to ``base``, default the working directory) or a
    module name importable from the environment or, with ``search_cwd`` (a name the user typed on the
    command line), from the working directory. Loading one twice is a no-op; ``sys.path`` is left as
    it was (a working directory left at its front would shadow later imports: opacus, diffusers...)."""
    path = Path(spec)
    is_file = is_plugin_file(spec)
    if is_file:
        path = path if path.is_absolute() else (base or Path.cwd()) / path
        key = str(path.resolve())
    else:
        key = spec
    if key in _loaded:
        return _loaded[key]
    try:
        module = _import_file(path) if is_file else _import_name(spec, search_cwd)
    except PluginError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the plugin raised, named with the plugin
        reason = f"{type(exc).__name__}: {exc}"
        raise PluginError(f"plugin {spec!r} raised while it was imported: {reason}") from exc
    _loaded[key] = module
    log.info("plugin %s loaded", spec)
    return module


def loaded_sources() -> list[Path]:
    """The source files of the plugins loaded so far (a run's code includes them), sorted."""
    files = {getattr(m, "__file__", None) for m in _loaded.values()}
    return sorted(Path(f).resolve() for f in files if f)


def load_plugins(
    specs: Iterable[str], *, base: Path | None = None, search_cwd: bool = True
) -> list[ModuleType]:
    return [load_plugin(s, base=base, search_cwd=search_cwd) for s in specs]


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise PluginError(f"plugin file {path} does not exist")
    name = f"gradleak_plugin_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"plugin file {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_name(name: str, search_cwd: bool = True) -> ModuleType:
    cwd = str(Path.cwd())
    saved = list(sys.path)
    if search_cwd and cwd not in sys.path:  # `gradleak run --plugin my_module` beside my_module.py
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and name.startswith(exc.name):
            where = f"{cwd} and the environment" if search_cwd else "the environment"
            raise PluginError(
                f"plugin module {name!r} not found (looked in {where}); pass a file path (--plugin "
                "path/to/plugin.py) or install the package that provides it"
            ) from None
        raise
    finally:
        sys.path[:] = saved


def load_entry_points() -> list[str]:
    """Import every installed ``gradleak.plugins`` entry point once; their names."""
    names = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _entry_points:
            continue
        _entry_points.add(ep.name)  # before loading: a plugin that uses a registry must not reload itself
        try:
            loaded = ep.load()
        except Exception as exc:  # noqa: BLE001
            raise PluginError(
                f"plugin entry point {ep.name!r} ({ep.value}) raised while it was imported: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if callable(loaded) and not isinstance(loaded, ModuleType):
            loaded()  # an entry point may name a register() function instead of a module
        log.info("plugin entry point %s (%s) loaded", ep.name, ep.value)
        names.append(ep.name)
    return names
