"""One switch for every progress bar: FL rounds, clients, attack iterations, cache builds, DAGER search.

Library calls are quiet by default (a notebook or a test decides); the ``gradleak`` command turns bars on
for ``run`` and ``demo`` unless ``--quiet``. A component's own ``progress=True`` shows its bar whatever
the switch says. Bars are tqdm's, with rate and ETA, written to stderr and removed when done.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")
_enabled = False


def enabled() -> bool:
    """Whether progress bars are on for this process."""
    return _enabled


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


@contextmanager
def bars(on: bool) -> Iterator[None]:
    """Progress bars on (or off) inside the block, as they were after it."""
    before = _enabled
    enable(on)
    try:
        yield
    finally:
        enable(before)


def bar(iterable: Iterable[T] | None = None, *, desc: str, total: int | None = None, force: bool = False,
        **options: Any) -> tqdm:  # fmt: skip
    """A tqdm bar over ``iterable`` (or a manual one of ``total`` steps), shown when bars are on or
    ``force`` (the component's own ``progress`` option)."""
    return tqdm(iterable, desc=desc, total=total, leave=False, disable=not (force or _enabled), **options)
