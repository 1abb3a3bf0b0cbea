"""The one validation point for untrusted updates: names, shapes, dtypes and finiteness against the model.

Every update passes :func:`check_update` before it is aggregated or attacked: the client checks what it is
about to send (:func:`gradleak.fl.client.train_client`), the server screens what it received
(:func:`gradleak.fl.server.screen`), and an :class:`~gradleak.types.Observation` checks what an attack reads
(the Python API). An update loaded from a file (:mod:`gradleak.update_io`) passes the same check.

The error names the update's source (a client id, a round, a file) and the offending tensor, so a rejected
update can be traced and recorded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from gradleak.types import Update


class InvalidUpdateError(ValueError):
    """An update that must not be aggregated or attacked; the message names its source and the tensor."""


def reference_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's named parameters: what an update's tensors are checked against."""
    return dict(model.named_parameters())


def check_tensors(
    tensors: object,
    reference: Mapping[str, torch.Tensor],
    *,
    source: str = "update",
    complete: bool = True,
) -> None:
    """Raise :class:`InvalidUpdateError` unless ``tensors`` is a valid payload for ``reference``.

    Valid: a mapping from parameter names (str) of ``reference`` to tensors of the same shape and dtype
    with only finite entries; with ``complete``, every parameter of ``reference`` is present. (An
    integration that receives another precision, e.g. a float64 secure aggregate, casts it first.)
    Checks run in that order (cheap structure first, then the values).
    """
    if not isinstance(tensors, Mapping):
        raise InvalidUpdateError(
            f"{source}: tensors must be a mapping name -> tensor, got {type(tensors).__name__}"
        )
    bad_keys = [k for k in tensors if not isinstance(k, str)]
    if bad_keys:
        raise InvalidUpdateError(f"{source}: parameter names must be strings, got {bad_keys[:3]!r}")
    unknown = sorted(set(tensors) - set(reference))
    if unknown:
        raise InvalidUpdateError(f"{source}: carries parameters the model lacks: {unknown[:5]}")
    if complete:
        missing = [n for n in reference if n not in tensors]
        if missing:
            raise InvalidUpdateError(f"{source}: lacks parameters of the model: {missing[:5]}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InvalidUpdateError(f"{source}: tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        ref = reference[name]
        if t.shape != ref.shape:
            raise InvalidUpdateError(
                f"{source}: tensor {name!r} has shape {tuple(t.shape)}, the model's is {tuple(ref.shape)}"
            )
        if t.dtype != ref.dtype:  # mixed precisions would sum in the first update's dtype (float16: Inf)
            raise InvalidUpdateError(
                f"{source}: tensor {name!r} has dtype {t.dtype}, the model's is {ref.dtype}"
            )
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            count = int((~torch.isfinite(t)).sum())
            raise InvalidUpdateError(f"{source}: tensor {name!r} has {count} non-finite entries (NaN or Inf)")


def check_update(
    update: Update,
    reference: Mapping[str, torch.Tensor] | nn.Module,
    *,
    source: str = "update",
    complete: bool = True,
) -> None:
    """Raise :class:`InvalidUpdateError` unless ``update`` is a valid :class:`~gradleak.types.Update` for the
    model (or parameter mapping) ``reference``: its type, its sample count, then :func:`check_tensors`."""
    from gradleak.types import Update

    if not isinstance(update, Update):
        raise InvalidUpdateError(f"{source}: expected an Update, got {type(update).__name__}")
    n = update.num_samples
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InvalidUpdateError(f"{source}: num_samples must be an int >= 0, got {n!r}")
    ref = reference_of(reference) if isinstance(reference, nn.Module) else reference
    check_tensors(update.tensors, ref, source=source, complete=complete)


def describe(metadata: Mapping[str, object], default: str = "update") -> str:
    """A source label from an update's metadata: ``client 7, round 2``."""
    parts = [f"{key.replace('_id', '')} {metadata[key]}" for key in ("client_id", "round") if key in metadata]
    return ", ".join(parts) or default
