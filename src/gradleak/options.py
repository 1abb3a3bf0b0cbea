"""Building config dataclasses from plain values (TOML tables, keyword overrides) with type checks.

One implementation for every config: experiment sections and the options of registered attacks, defenses
and generators. A value of the wrong type, an unknown key or a value that the dataclass' own validation
refuses is an :class:`OptionError` whose message names the key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any


class OptionError(ValueError):
    """A bad option value or key; the message names it."""


def check_value(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against a dataclass field's type hint (ints are accepted, as floats, where floats
    are); :class:`OptionError` naming ``where`` otherwise."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in typing.get_args(hint):
            if arm is type(None):
                if value is None:
                    return None
                continue
            try:
                return check_value(value, arm, where)
            except OptionError as exc:
                errors.append(str(exc))
        if len(errors) == 1:  # e.g. ``float | None``: the one arm's reason
            raise OptionError(errors[0])
        raise OptionError(f"{where}: expected {hint}, got {type(value).__name__} {value!r}")
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise OptionError(f"{where}: must be one of {list(typing.get_args(hint))}, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):  # no option of gradleak means anything with NaN or Inf
                raise OptionError(f"{where}: must be a finite number, got {value!r}")
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint in (str, bool):
        if type(value) is hint:
            return value
    elif origin in (Mapping, dict) or hint in (Mapping, dict):
        if isinstance(value, Mapping):
            return dict(value)
    else:
        return value
    raise OptionError(
        f"{where}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__} {value!r}"
    )


def repr_without_defaults(obj: Any, *later: str) -> str:
    """``obj``'s dataclass repr leaving out the fields named in ``later`` while they hold their defaults. For
    a config whose repr keys stored files: fields added after those files were written keep their names."""
    shown = [
        f for f in dataclasses.fields(obj) if not (f.name in later and getattr(obj, f.name) == f.default)
    ]
    return f"{type(obj).__name__}({', '.join(f'{f.name}={getattr(obj, f.name)!r}' for f in shown)})"


def build_dataclass(cls: type, values: Mapping[str, Any], *, where: str) -> Any:
    """Instantiate dataclass ``cls`` from a mapping: unknown keys (with the valid ones), wrong types and the
    dataclass' own validation errors are :class:`OptionError` naming ``where`` and the key. Fields whose
    type is a dataclass (or a dataclass or None) are built from nested mappings the same way."""
    if not isinstance(values, Mapping):
        raise OptionError(f"{where}: expected a table of options, got {type(values).__name__}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise OptionError(f"unknown option(s) {unknown} for {where}; valid options: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        hint = hints[key]
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and isinstance(value, Mapping):
            tables = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]  # ``Gate | None``
            hint = tables[0] if len(tables) == 1 else hint
        if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
            kwargs[key] = build_dataclass(hint, value, where=f"{where}.{key}")  # type: ignore[arg-type]
        elif dataclasses.is_dataclass(hint) and isinstance(value, hint):  # type: ignore[arg-type]
            kwargs[key] = value
        else:
            kwargs[key] = check_value(value, hint, f"{where} option {key}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, OptionError):
            raise
        raise OptionError(f"{where}: {exc}") from None
