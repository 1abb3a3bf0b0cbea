"""Lazy exports for a package's ``__init__``: names imported from their modules on first use.

``__getattr__ = lazy_exports(__name__, {"Name": "package.module", ...})`` in a package makes
``package.Name`` import ``package.module`` only when it is read (PEP 562), so importing the package stays
cheap; the value is then cached as a plain attribute.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` resolving each name of ``exports`` (name -> module)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # the next read is a plain attribute
        return value

    return __getattr__
