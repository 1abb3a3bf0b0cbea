"""Tensors and updates on disk: safetensors only (no pickle, so a file cannot run code when loaded).

An update file holds the tensors and, in its safetensors metadata, ``kind`` and ``num_samples`` (and the
JSON of the update's metadata); the update's buffers (a FedAvg reply's BatchNorm statistics) are stored as
tensors ``buffer:<name>``, listed in the metadata's ``buffers``. :func:`load_update` passes what it read
through the same validation as every other update (:func:`gradleak.validation.check_update`) before
anyone can aggregate or attack it.
:func:`save_tree` / :func:`load_tree` store a nested structure of JSON values and tensors (a resumable
benchmark state: round rows and model state dicts) the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from gradleak.fileio import atomic_write
from gradleak.types import Update, UpdateKind
from gradleak.validation import InvalidUpdateError, check_update

BUFFER = "buffer:"  # an update file's key prefix of a buffer (parameter names hold no ':')


def tensors_to_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """safetensors bytes of ``tensors`` (copied contiguous, so views and shared storage are fine)."""
    plain = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    return st_save(plain, metadata=dict(metadata) if metadata else None)


def tensors_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    try:
        return st_load(data)
    except (SafetensorError, ValueError) as exc:
        raise InvalidUpdateError(f"not a safetensors payload: {exc}") from None


def write_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> Path:
    """Write ``tensors`` and string ``metadata`` to ``path`` (safetensors, atomically: a reader never sees
    half a file)."""
    data = tensors_to_bytes(tensors, metadata)
    return atomic_write(Path(path), lambda tmp: tmp.write_bytes(data))


def save_update(update: Update, path: str | Path) -> Path:
    """Write ``update`` to ``path`` (safetensors, atomically: a reader never sees half a file)."""
    meta = {"kind": update.kind, "num_samples": str(update.num_samples),
            "metadata": json.dumps(dict(update.metadata), default=str),
            "buffers": json.dumps(sorted(update.buffers))}  # fmt: skip
    tensors = {**update.tensors, **{f"{BUFFER}{n}": b for n, b in update.buffers.items()}}
    return write_tensors(path, tensors, meta)


def load_update(path: str | Path, model: nn.Module, *, complete: bool = True) -> Update:
    """Read an update written by :func:`save_update` and validate it against ``model``'s parameters.

    Raises :class:`~gradleak.validation.InvalidUpdateError` naming the file (and the tensor) for anything
    that is not a valid safetensors update of this model.
    """
    source = f"update file {path}"
    tensors, meta = read_tensors(Path(path), source)
    try:
        kind = cast(UpdateKind, meta["kind"])  # Update checks it
        num_samples = int(meta["num_samples"])
        extra = json.loads(meta.get("metadata", "{}"))
        names = json.loads(meta.get("buffers", "[]"))
        if not isinstance(names, list) or any(f"{BUFFER}{n}" not in tensors for n in names):
            raise ValueError(f"the listed buffers {names!r} are not all in the file")
        buffers = {n: tensors.pop(f"{BUFFER}{n}") for n in names}
        update = Update(tensors, num_samples, kind, extra, buffers)
    except (KeyError, ValueError, TypeError) as exc:
        raise InvalidUpdateError(f"{source}: missing or bad update metadata ({exc})") from None
    check_update(update, model, source=source, complete=complete)  # the buffers too
    return update


_TENSOR, _PAIRS = "__tensor__", "__pairs__"


def _split(value: object, tensors: dict[str, torch.Tensor]) -> object:
    """``value`` as JSON with every tensor moved to ``tensors`` (a reference left in its place); dicts with
    keys other than strings become key-value pair lists, so int keys come back as ints."""
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value
        return {_TENSOR: key}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {k: _split(v, tensors) for k, v in value.items()}
        return {_PAIRS: [[k, _split(v, tensors)] for k, v in value.items()]}
    if isinstance(value, list | tuple):
        return [_split(v, tensors) for v in value]
    return value


def _join(value: object, tensors: Mapping[str, torch.Tensor]) -> object:
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return tensors[value[_TENSOR]]
        if set(value) == {_PAIRS}:
            return {k: _join(v, tensors) for k, v in value[_PAIRS]}
        return {k: _join(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_join(v, tensors) for v in value]
    return value


def save_tree(path: str | Path, tree: Mapping[str, object]) -> Path:
    """Write a nested mapping of JSON values and tensors to ``path`` (safetensors, atomically)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = json.dumps(_split(dict(tree), tensors))
    return write_tensors(path, tensors, {"tree": skeleton})


def read_tensors(path: Path, source: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors (on the CPU) and metadata, in one read; ``InvalidUpdateError`` naming
    ``source`` for a file that is missing, unreadable or not safetensors (a pickle, say)."""
    if not path.is_file():
        raise InvalidUpdateError(f"{source}: no such file")
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, OSError, ValueError) as exc:
        raise InvalidUpdateError(f"{source}: not a safetensors file ({exc})") from None
    return tensors, meta


def load_tree(path: str | Path) -> dict[str, object]:
    """The mapping written by :func:`save_tree` (tensors on the CPU)."""
    p = Path(path)
    tensors, meta = read_tensors(p, str(p))
    if "tree" not in meta:
        raise InvalidUpdateError(f"{p}: a safetensors file without a saved tree")
    out = _join(json.loads(meta["tree"]), tensors)
    if not isinstance(out, dict):
        raise InvalidUpdateError(f"{p}: the saved tree is not a mapping")
    return out


def tensor_digest(*tensors: torch.Tensor, digest_size: int = 16) -> str:
    """A hex hash (blake2b of ``digest_size`` bytes) of the tensors' bytes, in order: a content key, or stored
    beside them in a file and checked on load."""
    h = hashlib.blake2b(digest_size=digest_size)
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def write_keyed(
    path: Path, tensors: Mapping[str, torch.Tensor], *, format: str, key: str, meta: Mapping[str, str]
) -> Path:
    """Write ``tensors`` (atomically) with ``meta``, the file's ``format``, the ``key`` of what they were
    made from and their digest (in name order) as metadata: a stored artefact :func:`read_keyed` checks."""
    digest = tensor_digest(*(tensors[k] for k in sorted(tensors)))
    return write_tensors(path, tensors, {**meta, "format": format, "key": key, "digest": digest})


def read_keyed(
    path: Path, *, format: str, key: str, what: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a file :func:`write_keyed` wrote in ``format`` for the same ``key``, whose
    content matches its digest; ValueError naming ``what`` for any other file."""
    tensors, meta = read_tensors(path, f"{what} {path}")
    if meta.get("format") != format or meta.get("key") != key:
        raise ValueError(f"{path} is not the {what} of {key!r}")
    if tensor_digest(*(tensors[k] for k in sorted(tensors))) != meta.get("digest"):
        raise ValueError(f"{path}: the {' and '.join(sorted(tensors))} do not match their digest")
    return tensors, meta
