"""Locate or prepare WordNet 3.0 for NLTK's METEOR, offline (paper 002 reports METEOR, Sec. VI-A).

NLTK reads WordNet from ``$NLTK_DATA/corpora/wordnet/``. Debian's ``wordnet-base`` package installs the
WordNet 3.0 dict files in ``/usr/share/wordnet`` but lacks ``lexnames``, which the data root provides
(``<data root>/wordnet/lexnames``), and ``index.sense`` (package ``wordnet-sense-index``), which NLTK >= 3.9
opens when it loads WordNet only to map OMW synsets between WordNet versions; when absent an empty one is
written, which leaves synsets, lemmas and METEOR unchanged. :func:`ensure_wordnet` builds an NLTK data
folder from these, inside the project's ``.venv/nltk_data`` when the project has a venv, else
``~/.cache/gradleak/nltk_data``, and puts it on ``nltk.data.path``. When the dict files are missing it
raises :class:`WordNetMissingError` naming the fix (``apt-get install wordnet-base``, or
``scripts/setup_wordnet.sh``).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

from gradleak.data.root import resolve_data_root

log = logging.getLogger(__name__)

DEBIAN_DICT = Path("/usr/share/wordnet")
DICT_FILES = (
    "data.noun", "data.verb", "data.adj", "data.adv",
    "index.noun", "index.verb", "index.adj", "index.adv",
    "noun.exc", "verb.exc", "adj.exc", "adv.exc",
)  # fmt: skip
OPTIONAL_FILES = ("cntlist.rev",)
FIX = (
    "install Debian's WordNet 3.0 dict files with `apt-get install wordnet-base` (as root), or run "
    "`scripts/setup_wordnet.sh`; set GRADLEAK_WORDNET_DICT to use dict files elsewhere"
)


class WordNetMissingError(FileNotFoundError):
    """WordNet cannot be found or prepared; the message names the fix."""


def dict_dir() -> Path:
    return Path(os.environ.get("GRADLEAK_WORDNET_DICT", str(DEBIAN_DICT)))


def nltk_data_dir() -> Path:
    """``<venv>/nltk_data`` when running inside a virtual environment, else the user cache."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "nltk_data"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "gradleak" / "nltk_data"


def _complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in (*DICT_FILES, "lexnames", "index.sense"))


def ensure_wordnet(target: Path | None = None, data_root: str | os.PathLike[str] | None = None) -> Path:
    """Return an NLTK data folder holding ``corpora/wordnet`` (building it if needed) on nltk's path."""
    import nltk

    base = Path(target) if target is not None else nltk_data_dir()
    wn_dir = base / "corpora" / "wordnet"
    if not _complete(wn_dir):
        src = dict_dir()
        missing = [f for f in DICT_FILES if not (src / f).is_file()]
        if missing:
            raise WordNetMissingError(f"WordNet dict files {missing[:3]} are missing from {src}: {FIX}")
        lexnames = Path(resolve_data_root(data_root)) / "wordnet" / "lexnames"
        if not lexnames.is_file():
            raise WordNetMissingError(
                f"{lexnames} is missing (Debian's wordnet-base lacks it): copy WordNet 3.0's dict/lexnames "
                "into <data root>/wordnet/"
            )
        wn_dir.mkdir(parents=True, exist_ok=True)
        for f in (*DICT_FILES, *OPTIONAL_FILES):
            if (src / f).is_file():
                shutil.copyfile(src / f, wn_dir / f)
        shutil.copyfile(lexnames, wn_dir / "lexnames")
        sense = src / "index.sense"  # Debian's wordnet-sense-index; NLTK >= 3.9 opens it on load
        if sense.is_file():
            shutil.copyfile(sense, wn_dir / "index.sense")
        else:  # only NLTK's WordNet-version mapping (for OMW) reads it; synsets and METEOR do not
            (wn_dir / "index.sense").write_text("")
            log.info("no index.sense in %s: wrote an empty one (only OMW version mapping needs it)", src)
        log.info("prepared WordNet for NLTK in %s", wn_dir)
    if str(base) not in nltk.data.path:
        nltk.data.path.insert(0, str(base))
    return base
