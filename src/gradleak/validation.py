"""The one validation point for untrusted updates: names, shapes, dtypes and finiteness against the model.

Every update passes :func:`check_update` before it is aggregated or attacked: the client checks what it is
about to send (:func:`gradleak.tasks.client.train_client`), the server screens what it received
(:func:`gradleak.federation.server.screen`), and an :class:`~gradleak.types.Observation` checks what an
attack reads (the Python API). An update loaded from a file (:mod:`gradleak.update_io`) passes the same check.

Weights a party sends back whole (a Flower train reply: ``w_T``, BatchNorm buffers included) pass
:func:`check_weights`, the one rule for every array of a reply: the names, shapes and dtypes of the model the
server audits (whatever dtype a strategy turned the sent arrays into in between: Flower's FedAvg averages an
int64 counter into float64), finite floating values, and integer buffers that hold whole numbers within
what local training can have added to what was sent.

The error names the update's source (a client id, a round, a file) and the offending tensor, so a rejected
update can be traced and recorded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from gradleak.update import Update

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=-]{0,199}")
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=-]{0,254}")
"""Names that become file and folder names (a run's name, its id): no separator, no leading dot, no
``..``; a name from a config or a store cannot point a write or a read outside its folder."""


ERROR_TEXT_LIMIT = 4000
"""The most characters of an error text a record keeps (a client's reason is untrusted and unbounded)."""


def error_text(error: BaseException | str, limit: int = ERROR_TEXT_LIMIT) -> str:
    """An error's text for a record, at most ``limit`` characters: ``Type: message`` for an exception, the
    text itself otherwise. A longer text keeps its first quarter and its end, where a traceback (a Ray
    actor's, a ClientApp's) names the error that was raised."""
    if limit < 100:
        raise ValueError(f"error_text: limit must be at least 100 characters, got {limit}")
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    if len(text) <= limit:
        return text
    left = len(text) - limit
    while True:  # the marker's own length decides how many characters are left out
        marker = f"\n[... {left} characters left out ...]\n"
        if len(text) - (limit - len(marker)) == left:
            break
        left = len(text) - (limit - len(marker))
    head = max(0, limit // 4 - len(marker))
    return text[:head] + marker + text[len(text) - (limit - head - len(marker)) :]


def safe_name(value: object, what: str) -> str:
    """``value`` if it is a :data:`SAFE_NAME`; else a ValueError naming ``what`` and the rule."""
    if not isinstance(value, str) or not SAFE_NAME.fullmatch(value) or ".." in value:
        raise ValueError(
            f"{what} must be 1-200 letters, digits, '.', '_', '=' or '-' (starting with a letter or digit, "
            f"no '..'), got {value!r}"[:300]
        )
    return value


class InvalidUpdateError(ValueError):
    """An update that must not be aggregated or attacked; the message names its source and the tensor."""


def reference_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's named parameters: the names an update may carry, with their shapes and dtypes."""
    return dict(model.named_parameters())


def trainable_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's trainable parameters (``requires_grad``): what a complete update carries. Every parameter
    of a model trained whole; the adapters (and a trained head) of a LoRA model, whose base weights are
    frozen when it is broadcast (:mod:`gradleak.models.adapters`)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


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


DEFAULT_MAX_LOCAL_STEPS = 10_000
"""The most local steps a reply's integer buffers (BatchNorm's ``num_batches_tracked``) may add to what was
sent, unless the operator states another bound."""


def check_weights(
    received: object,
    model_state: Mapping[str, torch.Tensor],
    sent: Mapping[str, torch.Tensor],
    *,
    max_steps: int = DEFAULT_MAX_LOCAL_STEPS,
    source: str = "reply",
) -> dict[str, torch.Tensor]:
    """Raise :class:`InvalidUpdateError` unless ``received`` is a whole model state a client may send back.

    ``model_state`` is the audited model's ``state_dict()`` (the reference for names, shapes and dtypes:
    an honest client loads what it was sent into its own model, so its reply has the model's dtypes);
    ``sent`` the arrays the server sent this client (same names; any dtype). Every array must be a tensor
    of the model's name, shape and dtype; floating arrays finite; an integer array (BatchNorm's
    ``num_batches_tracked``) within ``[floor(sent), ceil(sent) + max_steps]`` elementwise (a counter moves
    by one per local step). Returns ``received`` as a plain dict.
    """
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0:
        raise ValueError(f"max_steps must be an int >= 0, got {max_steps!r}")
    if set(sent) != set(model_state):
        raise ValueError(
            f"{source}: the arrays sent do not match the audited model's state: "
            f"{sorted(set(sent) ^ set(model_state))[:5]}"
        )  # the server's own configuration, not the client's fault
    if not isinstance(received, Mapping):
        raise InvalidUpdateError(
            f"{source}: arrays must be a mapping name -> tensor, got {type(received).__name__}"
        )
    unknown = sorted(str(k) for k in set(received) - set(model_state))
    if unknown:
        raise InvalidUpdateError(f"{source}: carries arrays the model lacks: {unknown[:5]}")
    missing = [n for n in model_state if n not in received]
    if missing:
        raise InvalidUpdateError(f"{source}: lacks arrays of the model: {missing[:5]}")
    for name, ref in model_state.items():
        t = received[name]
        if not isinstance(t, torch.Tensor):
            raise InvalidUpdateError(f"{source}: array {name!r} is a {type(t).__name__}, not a tensor")
        if t.shape != ref.shape:
            raise InvalidUpdateError(
                f"{source}: array {name!r} has shape {tuple(t.shape)}, the model's is {tuple(ref.shape)}"
            )
        if t.dtype != ref.dtype:
            raise InvalidUpdateError(
                f"{source}: array {name!r} has dtype {t.dtype}, the model's is {ref.dtype}"
            )
    for name in model_state:
        t = received[name]
        if t.is_floating_point() or t.is_complex():
            if not bool(torch.isfinite(t).all()):
                count = int((~torch.isfinite(t)).sum())
                raise InvalidUpdateError(
                    f"{source}: array {name!r} has {count} non-finite entries (NaN or Inf)"
                )
        elif t.dtype != torch.bool and t.numel():
            base = sent[name].detach().to(torch.float64)
            low, high = torch.floor(base), torch.ceil(base) + max_steps
            value = t.detach().to(torch.float64)
            outside = ~((value >= low) & (value <= high))
            if bool(outside.any()):
                i = int(outside.reshape(-1).nonzero()[0])
                raise InvalidUpdateError(
                    f"{source}: integer array {name!r} holds {int(t.reshape(-1)[i])} where "
                    f"{float(base.reshape(-1)[i]):g} was sent: outside [sent, sent + {max_steps} local steps]"
                )
    return dict(received)


def check_update(
    update: Update,
    reference: Mapping[str, torch.Tensor] | nn.Module,
    *,
    source: str = "update",
    complete: bool = True,
) -> None:
    """Raise :class:`InvalidUpdateError` unless ``update`` is a valid :class:`~gradleak.types.Update` for the
    model (or parameter mapping) ``reference``: its type, its sample count, then :func:`check_tensors`."""
    if not isinstance(update, Update):
        raise InvalidUpdateError(f"{source}: expected an Update, got {type(update).__name__}")
    n = update.num_samples
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InvalidUpdateError(f"{source}: num_samples must be an int >= 0, got {n!r}")
    if isinstance(reference, nn.Module):  # any of its parameters; complete: every trainable one
        check_tensors(update.tensors, reference_of(reference), source=source, complete=False)
        missing = [n for n in trainable_of(reference) if n not in update.tensors] if complete else []
        if missing:
            raise InvalidUpdateError(f"{source}: lacks parameters of the model: {missing[:5]}")
    else:
        check_tensors(update.tensors, reference, source=source, complete=complete)
    if update.buffers:
        buffers = dict(reference.named_buffers()) if isinstance(reference, nn.Module) else None
        check_buffers(update.buffers, buffers, source=source)


def check_buffers(
    buffers: object, reference: Mapping[str, torch.Tensor] | None, *, source: str = "update"
) -> None:
    """Raise :class:`InvalidUpdateError` unless ``buffers`` maps buffer names of the model (``reference``,
    when known) to tensors of their shape and dtype, the floating ones finite, a running variance never
    negative and an integer buffer (BatchNorm's batch counter) never below the model's (it only counts up:
    a server reads the local steps off it, :func:`gradleak.attacks.image.bn_prior.read_batch_statistics`)."""
    if not isinstance(buffers, Mapping):
        raise InvalidUpdateError(
            f"{source}: buffers must be a mapping name -> tensor, got {type(buffers).__name__}"
        )
    for name, t in buffers.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise InvalidUpdateError(f"{source}: buffer {name!r} is not a named tensor")
        if reference is not None:
            ref = reference.get(name)
            if ref is None:
                raise InvalidUpdateError(f"{source}: carries a buffer the model lacks: {name!r}")
            if t.shape != ref.shape or t.dtype != ref.dtype:
                raise InvalidUpdateError(
                    f"{source}: buffer {name!r} is {t.dtype} {tuple(t.shape)}, the model's {ref.dtype} "
                    f"{tuple(ref.shape)}"
                )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise InvalidUpdateError(f"{source}: buffer {name!r} holds non-finite values")
        if name.endswith("running_var") and bool((t < 0).any()):
            raise InvalidUpdateError(f"{source}: buffer {name!r} holds a negative variance")
        if not t.is_floating_point():
            floor = reference[name] if reference is not None else torch.zeros((), dtype=t.dtype)
            if bool((t < floor).any()):
                raise InvalidUpdateError(f"{source}: counter {name!r} went back (below the model's)")


def describe(metadata: Mapping[str, object], default: str = "update") -> str:
    """A source label from an update's metadata: ``client 7, round 2``."""
    parts = [f"{key.replace('_id', '')} {metadata[key]}" for key in ("client_id", "round") if key in metadata]
    return ", ".join(parts) or default
