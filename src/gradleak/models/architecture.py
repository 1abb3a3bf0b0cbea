"""A model's architecture as data, so that no party ever unpickles another's module.

A pickled ``nn.Module`` runs whatever code its sender chose when it is unpickled. What travels instead
is a **spec** (plain JSON: which registered model with which options, or "the receiver's own model",
plus the layers a malicious server may put in front of it) and the weights as arrays. The receiver builds
the module from the spec out of a closed set of layer kinds, checked on the way (types, sizes, depth),
and loads the weights strictly.

Spec nodes (``{"format": FORMAT, "model": node}``):

- ``{"kind": "registered", "name", "input_shape", "num_classes", "seed", "options"}``: a model of the
  :data:`~gradleak.registry.MODELS` registry, as :func:`gradleak.models.build_model` built it (it records
  this spec on the module);
- ``{"kind": "own"}``: the receiver's own model (a deployment ClientApp's ``build_model()``);
- ``{"kind": "imprint", "block": block, "body": node}``: an imprint block in front of ``body`` (the
  malicious-server model of :mod:`gradleak.models.malicious`: Robbing the Fed, LOKI, Scale-MIA);
- a block: ``{"feature_dim", "num_bins", "groups", "front": layer}``; a layer: ``flatten``, ``relu``,
  ``linear`` (``in``, ``out``, ``bias``), ``sequential`` (``layers``), ``slots`` (LOKI's per-client
  separator: ``channels``, ``slots``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gradleak.models.malicious import GroupedLinear, ImprintBlock, MaliciousModel, SlotSeparator

FORMAT = "gradleak.architecture/1"
SPEC_ATTRIBUTE = "_gradleak_spec"  # where build_model records a registered model's spec on the module
MAX_DEPTH = 8
MAX_LAYERS = 32


class ArchitectureError(ValueError):
    """A spec that cannot be built (unknown kind, bad sizes, too large), or a module that has no spec."""


@dataclass(frozen=True)
class Limits:
    """How large a module a receiver builds from a spec it did not write: ``max_elements`` parameters and
    buffers in the layers the spec adds (the default, 2**26, is 256 MiB of float32)."""

    max_elements: int = 2**26
    allow_registered: bool = True  # False: only the receiver's own model may be the body

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_elements, bool)
            or not isinstance(self.max_elements, int)
            or self.max_elements < 1
        ):
            raise ValueError(f"max_elements must be a positive int, got {self.max_elements!r}")


@dataclass(frozen=True)
class RegisteredModel:
    """A registered model's spec: what :func:`gradleak.models.build_model` was called with."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    seed: int
    options: Mapping[str, Any] = field(default_factory=dict)

    def node(self) -> dict[str, Any]:
        return {"kind": "registered", "name": self.name, "input_shape": list(self.input_shape),
                "num_classes": self.num_classes, "seed": self.seed,
                "options": dict(self.options)}  # fmt: skip


def describe(model: nn.Module, *, own: bool = False) -> str:
    """The spec of ``model`` as JSON. ``own``: the model under any imprint block is the receiver's own
    (described as ``{"kind": "own"}``), else it must be a registered model built by ``build_model``."""
    spec = {"format": FORMAT, "model": _node(model, own)}
    try:
        return json.dumps(spec, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ArchitectureError(f"the model's spec is not plain JSON (its options?): {exc}") from None


def _node(model: nn.Module, own: bool) -> dict[str, Any]:
    if isinstance(model, MaliciousModel):
        return {"kind": "imprint", "block": _block(model.imprint), "body": _node(model.body, own)}
    if own:
        return {"kind": "own"}
    spec = getattr(model, SPEC_ATTRIBUTE, None)
    if not isinstance(spec, RegisteredModel):
        raise ArchitectureError(
            f"a {type(model).__name__} has no spec: build it with gradleak.models.build_model (a registered "
            "model) so that it can travel as data, not as a pickle"
        )
    return spec.node()


def _block(block: ImprintBlock) -> dict[str, Any]:
    lin = block.linear
    groups = lin.groups if isinstance(lin, GroupedLinear) else 1
    bins = int(lin.out_features) // groups
    front = _layer(block.front)
    return {"feature_dim": int(lin.in_features), "num_bins": bins, "groups": groups, "front": front}


def _layer(m: nn.Module) -> dict[str, Any]:
    if isinstance(m, nn.Flatten):
        return {"kind": "flatten", "start": m.start_dim, "end": m.end_dim}
    if isinstance(m, nn.ReLU):
        return {"kind": "relu"}
    if isinstance(m, nn.Linear):
        return {"kind": "linear", "in": m.in_features, "out": m.out_features, "bias": m.bias is not None}
    if isinstance(m, nn.Sequential):
        return {"kind": "sequential", "layers": [_layer(c) for c in m]}
    if isinstance(m, SlotSeparator):
        return {"kind": "slots", "channels": m.channels, "slots": m.slots}
    raise ArchitectureError(f"an imprint block's front of type {type(m).__name__} has no spec")


def build(
    spec: object,
    *,
    own: Callable[[], nn.Module] | None = None,
    registered: Callable[[RegisteredModel], nn.Module] | None = None,
    limits: Limits = Limits(),
) -> nn.Module:
    """The module ``spec`` (a JSON string from :func:`describe`) stands for, with fresh weights (load the
    sent ones strictly). ``own()`` builds the receiver's own model; ``registered`` a registered one
    (default :func:`gradleak.models.build_model`). Every field is checked before anything is built."""
    if isinstance(spec, bytes | bytearray):
        spec = spec.decode("utf-8", errors="replace")
    if not isinstance(spec, str) or len(spec) > 1_000_000:
        raise ArchitectureError("an architecture spec must be a JSON string of at most 1 MB")
    try:
        data = json.loads(spec)
    except ValueError as exc:
        raise ArchitectureError(f"the architecture spec is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or set(data) != {"format", "model"}:
        raise ArchitectureError(f"not a {FORMAT} spec")
    budget = [limits.max_elements]
    return _build(data["model"], own, registered, limits, budget, 0)


def _int(d: Mapping[str, Any], key: str, low: int = 1, high: int = 2**31) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ArchitectureError(f"spec field {key!r} must be an int in [{low}, {high}], got {v!r}"[:200])
    return v


def _keys(d: object, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(d, dict) or not set(d) <= allowed or "kind" in allowed and "kind" not in d:
        raise ArchitectureError(f"bad spec node (allowed fields {sorted(allowed)}): {str(d)[:200]}")
    return d


def _spend(budget: list[int], count: int) -> None:
    budget[0] -= count
    if budget[0] < 0:
        raise ArchitectureError("the spec's layers exceed the receiver's size limit (Limits.max_elements)")


def _build(
    node: object,
    own: Callable[[], nn.Module] | None,
    registered: Callable[[RegisteredModel], nn.Module] | None,
    limits: Limits,
    budget: list[int],
    depth: int,
) -> nn.Module:
    if depth > MAX_DEPTH:
        raise ArchitectureError("the spec nests too deep")
    kind = node.get("kind") if isinstance(node, dict) else None
    if kind == "own":
        _keys(node, {"kind"})
        if own is None:
            raise ArchitectureError("the spec asks for the receiver's own model, and none was given")
        return own()
    if kind == "imprint":
        d = _keys(node, {"kind", "block", "body"})
        block = _imprint(_keys(d["block"], {"feature_dim", "num_bins", "groups", "front"}), budget)
        return MaliciousModel(block, _build(d["body"], own, registered, limits, budget, depth + 1))
    if kind == "registered":
        if not limits.allow_registered:
            raise ArchitectureError("this receiver builds only its own model under a sent imprint block")
        d = _keys(node, {"kind", "name", "input_shape", "num_classes", "seed", "options"})
        shape = d.get("input_shape")
        if not isinstance(shape, list) or not 1 <= len(shape) <= 4:
            raise ArchitectureError(
                f"spec field 'input_shape' must be a list of 1-4 ints, got {shape!r}"[:200]
            )
        options = d.get("options")
        if not isinstance(d.get("name"), str) or not isinstance(options, dict):
            raise ArchitectureError("a registered model's spec needs a name and an options table")
        spec = RegisteredModel(
            d["name"], tuple(_int({"v": s}, "v", 1, 2**16) for s in shape), _int(d, "num_classes", 1, 2**20),
            _int(d, "seed", 0, 2**63), options,
        )  # fmt: skip
        if registered is None:
            from gradleak.models import build_module

            return build_module(spec)
        return registered(spec)
    raise ArchitectureError(f"unknown spec node kind {kind!r}"[:200])


def _imprint(d: Mapping[str, Any], budget: list[int]) -> ImprintBlock:
    dim, bins, groups = (
        _int(d, "feature_dim", 1, 2**24),
        _int(d, "num_bins", 1, 2**20),
        _int(d, "groups", 1, 2**12),
    )
    _spend(budget, (dim + 2) * bins * groups + dim * groups)  # weight, bias, open_bias; offset
    count = [0]
    front = _front(d["front"], budget, count, 0)
    return ImprintBlock(dim, bins, front=front, groups=groups)


def _front(node: object, budget: list[int], count: list[int], depth: int) -> nn.Module:
    count[0] += 1
    if count[0] > MAX_LAYERS or depth > MAX_DEPTH:
        raise ArchitectureError("the imprint block's front has too many layers")
    kind = node.get("kind") if isinstance(node, dict) else None
    if kind == "flatten":
        d = _keys(node, {"kind", "start", "end"})
        return nn.Flatten(_int(d, "start", -8, 8), _int(d, "end", -8, 8))
    if kind == "relu":
        _keys(node, {"kind"})
        return nn.ReLU()
    if kind == "linear":
        d = _keys(node, {"kind", "in", "out", "bias"})
        n_in, n_out = _int(d, "in", 1, 2**24), _int(d, "out", 1, 2**24)
        if not isinstance(d.get("bias"), bool):
            raise ArchitectureError("a linear layer's 'bias' must be true or false")
        _spend(budget, n_in * n_out + n_out)
        return nn.Linear(n_in, n_out, bias=d["bias"])
    if kind == "sequential":
        d = _keys(node, {"kind", "layers"})
        layers = d.get("layers")
        if not isinstance(layers, list):
            raise ArchitectureError("a sequential layer needs a list of layers")
        return nn.Sequential(*(_front(x, budget, count, depth + 1) for x in layers))
    if kind == "slots":
        d = _keys(node, {"kind", "channels", "slots"})
        channels, slots = _int(d, "channels", 1, 64), _int(d, "slots", 1, 2**12)
        _spend(budget, channels * channels * slots)
        return SlotSeparator(channels, slots)
    raise ArchitectureError(f"unknown layer kind {kind!r} in an imprint block's front"[:200])


__all__ = [
    "FORMAT",
    "ArchitectureError",
    "Limits",
    "RegisteredModel",
    "build",
    "describe",
]
