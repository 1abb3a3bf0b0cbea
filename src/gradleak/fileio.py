"""Writing files so that a reader or a concurrent writer never sees half of one."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def atomic_write(path: Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp_path)`` to a unique temporary file beside ``path``, then rename it over ``path``:
    readers see the old file or the new one, never a half-written one; concurrent writers never share a
    temporary name. The file is its owner's alone (0600, as ``mkstemp`` makes it): gradleak's exports
    hold clients' images, texts and updates (a reconstruction is the client's data); share one on purpose
    with ``chmod``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # on disk before the rename makes it visible
        finally:
            os.close(fd)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def kept(
    path: Path | None,
    load: Callable[[Path], _T],
    make: Callable[[], _T],
    save: Callable[[_T, Path], object],
) -> _T:
    """``load(path)`` where that file exists and reads; else ``make()``, saved to ``path`` (when given). A
    damaged or foreign file is logged and made again: it must not stop every later run."""
    if path is not None and path.exists():
        try:
            found = load(path)
        except Exception as exc:
            log.warning("cannot reuse %s (%s); making it again", path, exc)
        else:
            log.info("reused %s", path)
            return found
    made = make()
    if path is not None:
        save(made, path)
    return made
