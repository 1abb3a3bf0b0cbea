"""Where the offline data lives, and one clear error when a file is missing.

The data root is resolved, first match wins:

1. the ``explicit`` argument (must exist);
2. the ``GRADLEAK_DATA`` environment variable (must exist);
3. ``../shared/data`` relative to the current working directory, then relative to the project root
   (the directory holding ``pyproject.toml`` above this source file), whichever exists first;
4. the user cache ``$XDG_CACHE_HOME/gradleak/data`` (default ``~/.cache/gradleak/data``), returned even
   when it does not exist so that a later :func:`require_file` names it in its error.

It also holds the argument checks every loader shares (:func:`check_split`, :func:`check_limit`) and the
"how to get it" text for each dataset family.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_VAR = "GRADLEAK_DATA"
_SHARED = Path("..") / "shared" / "data"

MEDMNIST_HOW_TO_GET = (
    "download the official MedMNIST v2 .npz files from https://zenodo.org/records/10519652 "
    "(or `pip install medmnist` then `python -m medmnist download`) and place them under <root>/medmnist/"
)
CIFAR10_HOW_TO_GET = (
    "download the CIFAR-10 python version from https://www.cs.toronto.edu/~kriz/cifar.html and export "
    "its test batch as JPEG files into one folder per class name: <root>/cifar10-test-jpeg/<class>/NNNN.jpg"
)
FEMNIST_HOW_TO_GET = (
    "generate LEAF FEMNIST json shards with https://github.com/TalwalkarLab/leaf "
    "(data/femnist: ./preprocess.sh -s niid --sf 0.05 -k 0 -t sample) and copy data/train and data/test "
    "to <root>/femnist-leaf/{train,test}/"
)


class DataFileMissingError(FileNotFoundError):
    """A data file (or the data root itself) is missing; the message says which and how to get it."""


def _project_root() -> Path | None:
    candidate = Path(__file__).resolve().parents[3]
    return candidate if (candidate / "pyproject.toml").is_file() else None


def _cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "gradleak" / "data"


def _checked(path: Path, source: str) -> Path:
    if not path.is_dir():
        raise DataFileMissingError(
            f"data root {str(path)!r} given by {source} does not exist or is not a directory"
        )
    return path.resolve()


def resolve_data_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The data root to read from (see the module docstring for the order of precedence)."""
    if explicit is not None:
        return _checked(Path(explicit).expanduser(), "the root argument")
    env = os.environ.get(ENV_VAR)
    if env:
        return _checked(Path(env).expanduser(), f"${ENV_VAR}")
    candidates = [Path.cwd() / _SHARED]
    project = _project_root()
    if project is not None:
        candidates.append(project / _SHARED)
    for candidate in candidates:
        if candidate.is_dir():
            logger.debug("data root: %s", candidate.resolve())
            return candidate.resolve()
    cache = _cache_dir()
    logger.debug("data root: %s (user cache; ../shared/data not found)", cache)
    return cache


def require_file(root: Path, relpath: str, how_to_get: str) -> Path:
    """``root / relpath`` if it exists, else a :class:`DataFileMissingError` naming it and its source."""
    path = Path(root) / relpath
    if not path.exists():
        raise DataFileMissingError(
            f"missing data file {str(path)!r} (data root in use: {str(root)!r}). To get it: {how_to_get}. "
            f"Pass root=... or set ${ENV_VAR} to use another data root."
        )
    return path


def check_split(dataset: str, split: str, valid: tuple[str, ...], note: str = "") -> str:
    """``split`` if it is one of ``valid``, else a ValueError naming the valid splits (plus ``note``)."""
    if split not in valid:
        extra = f" ({note})" if note else ""
        raise ValueError(f"{dataset}: unknown split {split!r}; valid splits: {list(valid)}{extra}")
    return split


def check_limit(limit: int | None) -> int | None:
    """``limit`` if it is None or a positive int, else a ValueError."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    return limit
