"""The client's guard: check the model a server sent before training on it.

A malicious server leaks a client's data by sending it a model built to leak (Robbing the Fed, LOKI,
Scale-MIA, trap weights, class fishing); the SEER paper (Garov et al., ICLR 2024) notes that the attacks
of the literature are detectable by a client that looks. This module looks, in two steps:

1. **architecture**: the received arrays carry exactly the names, shapes and dtypes of the client's own
   model (an integer buffer may arrive as a float >= 0: Flower's FedAvg averages ``num_batches_tracked``
   in float64, often to no whole number), all finite. Every malicious model that inserts an imprint block
   fails here.
2. **weight signatures**, for malicious models that keep the client's architecture
   (:mod:`gradleak.attacks.linear.in_place`, :mod:`gradleak.attacks.text.peftleak`), each a registered
   check over every linear map (``nn.Linear`` and HF's ``Conv1D``; a LoRA adapter's ``B`` apart,
   :func:`linear_maps`):

   - ``parallel``: at least ``parallel_rows`` rows (or columns of a layer fed by hidden units) with a near
     parallel partner (|cos| >= ``parallel_cosine``): cumulative bins share one direction and the
     back-connection one column (Robbing the Fed, LOKI);
   - ``degenerate``: a zero or constant row (its spread below ``degenerate_ratio`` of its size): class
     fishing zeroes the output rows and makes the target's constant;
   - ``bias``: a bias that dwarfs what the layer computes on the client's own data (``|b_i|`` above
     ``bias_ratio`` times the spread of ``w_i x`` over the probe, and above 1): closed LOKI slots, fished
     classes;
   - ``balance``: more than ``max_balanced_rows`` of a layer's rows with exactly half of their weights
     negative: trap weights (Boenisch et al., EuroS&P 2023, Sec. IV) negate half of each row's entries
     (random rows hit the exact half with probability about ``sqrt(2 / (pi D))``, 3 % at D = 784);
   - ``drift``: a linear layer that moved by more than ``max_drift`` of its norm since the last model this
     client accepted (or its own trusted start): a rewritten layer moves by about its whole size, a round of
     FedAvg by a few percent (not read: a LoRA ``B`` and a bottleneck adapter's layers, which start at zero
     or small, N(0, 0.01^2) residual or nn.Linear's default, and move by more than their size under honest
     training). Activation sparsity, the trap's
     purpose, is no signature: honest trained layers are as sparse on a client's data (measured,
     docs/security.md);
   - ``frozen``: a parameter the client does not train (a LoRA model's base, norms and embeddings) that
     changed since that reference: in an honest federation it never moves (a pass-through backbone, a
     constant embedding coordinate: :mod:`gradleak.attacks.text.peftleak`).

``probe``: a batch of the client's own training inputs, which it is about to train on anyway; nothing of
it leaves the client. The thresholds are set so that honest models across FedAvg training raise no alarm
(measured by ``benchmarks/model_guard.py``: detection per attack and the false-alarm rate with its 95 %
upper bound, docs/security.md).

:func:`guard_model` (any PyTorch loop) raises :class:`MaliciousModelError` on a hit;
:class:`gradleak.integrations.flower.mods.GuardMod` refuses the train message in a Flower ClientApp.
"""

from __future__ import annotations

import copy
import logging
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from gradleak.models.adapters import BottleneckAdapter
from gradleak.registry import decorator_into

log = logging.getLogger(__name__)


class MaliciousModelError(ValueError):
    """The server's model failed the guard; the message lists what was found."""


@dataclass(frozen=True)
class GuardFinding:
    """One hit: which check, where (parameter or layer), and why."""

    check: str
    where: str
    reason: str

    def __str__(self) -> str:
        return f"{self.check} at {self.where}: {self.reason}"


@dataclass(frozen=True)
class GuardVerdict:
    """Everything the guard found; ``safe`` when nothing was."""

    findings: tuple[GuardFinding, ...] = ()

    @property
    def safe(self) -> bool:
        return not self.findings

    def reason(self, limit: int = 3) -> str:
        more = len(self.findings) - limit
        return "; ".join(map(str, self.findings[:limit])) + (f" (and {more} more)" if more > 0 else "")


@dataclass(frozen=True)
class GuardConfig:
    """The checks to run (registered names, :data:`GUARD_CHECKS`; the architecture check always runs first)
    and their thresholds (module docstring). ``probe_size``: how many of the client's inputs the data
    checks read."""

    checks: tuple[str, ...] = ("parallel", "degenerate", "bias", "balance", "drift", "frozen")
    parallel_cosine: float = 0.99
    parallel_rows: int = 3
    degenerate_ratio: float = 1e-3
    bias_ratio: float = 50.0
    max_balanced_rows: float = 0.5
    max_drift: float = 0.5
    frozen_ulps: float = 16.0  # Flower's FedAvg averages equal frozen arrays to within a few ulps
    probe_size: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "checks", tuple(self.checks))
        unknown = [c for c in self.checks if c not in GUARD_CHECKS]
        if unknown:
            raise ValueError(f"unknown guard checks {unknown}; known: {sorted(GUARD_CHECKS)}")
        for key in ("parallel_cosine", "degenerate_ratio", "max_balanced_rows"):
            v = getattr(self, key)
            if not (isinstance(v, int | float) and 0 < v <= 1):
                raise ValueError(f"{key} must be in (0, 1], got {v!r}")
        for key in ("bias_ratio", "max_drift", "frozen_ulps"):
            v = getattr(self, key)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"{key} must be a positive finite number, got {v!r}")
        for key in ("parallel_rows", "probe_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 2:
                raise ValueError(f"{key} must be an int >= 2, got {v!r}")


@dataclass(frozen=True)
class LinearMap:
    """A layer the checks read as ``y = W x + b``, ``weight`` (out, in). It is the module's own weight, or
    its transpose for HF's ``Conv1D`` (stored (in, out)), or for a LoRA layer the merged map
    ``W + s B A`` (``adapters``: the state-dict keys of each adapter's ``A`` and ``B`` and its scale ``s``),
    so that what a server writes into the adapters is read as part of the layer it changes. ``adapter`` is
    ``"A"`` or ``"B"`` for a LoRA adapter's own matrix, ``"bottleneck"`` for a bottleneck adapter's layer."""

    name: str
    module: nn.Module
    weight: torch.Tensor
    bias: torch.Tensor | None
    weight_key: str  # the state-dict key of the (base) weight
    transposed: bool = False
    adapters: tuple[tuple[str, str, float], ...] = ()
    adapter: str | None = None

    def weight_in(self, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This map's weight (out, in) in another state dict of the same model (``drift``'s reference)."""
        w = state[self.weight_key].to(torch.float64)
        w = w.T if self.transposed else w
        for a, b, scale in self.adapters:
            w = w + scale * state[b].to(torch.float64) @ state[a].to(torch.float64)
        return w


@dataclass
class Inspection:
    """What the checks read: the received model (loaded into a copy of the client's own), its linear maps
    in order, and what each computes on the probe (``w x`` without bias, (N, out))."""

    model: nn.Module
    linears: list[LinearMap]
    probe: torch.Tensor
    products: dict[str, torch.Tensor] = field(default_factory=dict)
    previous: Mapping[str, torch.Tensor] | None = None


MIN_ROWS = 16
"""Vectors of fewer entries are too short for the row statistics: random ones are often near parallel
(``parallel``), and a row of few weights hits the exact half by chance (``balance``)."""


GuardCheck = Callable[[Inspection, GuardConfig], list[GuardFinding]]
GUARD_CHECKS: dict[str, GuardCheck] = {}


register_guard_check = decorator_into(GUARD_CHECKS, "guard check")
"""``@register_guard_check(name)``: add a weight check (a plugin's too)."""


def architecture_findings(
    received: Mapping[str, object], expected: Mapping[str, torch.Tensor]
) -> list[GuardFinding]:
    """The received arrays against the client's own state: names, shapes, dtypes, finite values."""
    out = []
    extra = sorted(str(n) for n in set(received) - set(expected))
    missing = [n for n in expected if n not in received]
    if extra:
        out.append(GuardFinding("architecture", extra[0], f"arrays the client's model lacks: {extra[:5]}"))
    if missing:
        out.append(
            GuardFinding("architecture", missing[0], f"arrays of the client's model missing: {missing[:5]}")
        )
    for name, ref in expected.items():
        t = received.get(name)
        if t is None or name in extra:
            continue
        if not isinstance(t, torch.Tensor):
            out.append(GuardFinding("architecture", name, f"a {type(t).__name__}, not a tensor"))
        elif t.shape != ref.shape:
            out.append(
                GuardFinding("architecture", name, f"shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
            )
        elif t.is_floating_point() and not bool(torch.isfinite(t).all()):
            out.append(GuardFinding("architecture", name, "non-finite values"))
        elif t.dtype != ref.dtype and not (
            not ref.is_floating_point() and t.is_floating_point() and bool((t >= 0).all())
        ):  # Flower's FedAvg averages an integer counter in float64: any finite count >= 0 is one
            out.append(GuardFinding("architecture", name, f"dtype {t.dtype}, expected {ref.dtype}"))
    return out


class ModelGuard:
    """Checks the models a server sends to a client whose own model is ``own`` (its architecture; copied,
    never trained here). The guard remembers the last model it accepted, for the ``drift`` check;
    ``trusted_start=True`` makes ``own``'s weights the first reference (a checkpoint or seeded initial model
    the client verified), else the first model is checked without drift."""

    def __init__(
        self, own: nn.Module, config: GuardConfig | None = None, *, trusted_start: bool = False
    ) -> None:
        self.config = config or GuardConfig()
        self._own = copy.deepcopy(own).cpu().eval()
        self._expected = {n: t.detach().clone() for n, t in self._own.state_dict().items()}
        self.accepted: dict[str, torch.Tensor] | None = dict(self._expected) if trusted_start else None

    def inspect(
        self, received: Mapping[str, object], probe: torch.Tensor, *, remember: bool = True
    ) -> GuardVerdict:
        """The verdict on ``received`` (a state dict) given the client's own inputs ``probe``; a safe model
        becomes the drift reference when ``remember``."""
        found = architecture_findings(received, self._expected)
        if found:
            return GuardVerdict(tuple(found))
        model = copy.deepcopy(self._own)
        state = {
            n: (t.detach().cpu() if self._expected[n].is_floating_point() else t.detach().cpu().round()).to(
                self._expected[n].dtype
            )
            for n, t in received.items()
            if isinstance(t, torch.Tensor)  # every one is: checked above
        }
        model.load_state_dict(state)
        inspection = Inspection(
            model,
            linear_maps(model),
            probe[: self.config.probe_size].detach().cpu(),
            previous=self.accepted,
        )
        inspection.products = linear_products(inspection)
        for name in self.config.checks:
            found += GUARD_CHECKS[name](inspection, self.config)
        if not found and remember:
            self.accepted = state
        return GuardVerdict(tuple(found))


ADAPTER_MATRICES = {"lora_A": "A", "lora_B": "B"}  # peft's LoRA layer keeps its matrices in these ModuleDicts
BOTTLENECK = "bottleneck"  # the role of a bottleneck adapter's layers: every check but drift reads them


def linear_maps(model: nn.Module) -> list[LinearMap]:
    """Every linear map of ``model`` in order: ``nn.Linear`` layers and HF's ``Conv1D`` (GPT-2), each LoRA
    layer's merged map too, each adapter matrix marked with its role. The checks read an adapter's ``B`` only
    through the merged map: peft starts it at zero, and a trained ``B``'s short rows lie in the few
    directions of its batches."""
    # HF's Conv1D, imported already wherever a model uses it (no transformers import for the image models)
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    roles = {
        id(sub): role
        for module in model.modules()
        for key, role in ADAPTER_MATRICES.items()
        if isinstance(getattr(module, key, None), nn.ModuleDict)
        for sub in getattr(module, key).modules()
    }
    roles.update(  # a bottleneck adapter's layers: trained from a small start (models/adapters.py)
        {
            id(sub): BOTTLENECK
            for m in model.modules()
            if isinstance(m, BottleneckAdapter)
            for sub in m.modules()
        }
    )
    maps = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            maps.append(
                LinearMap(name, m, m.weight, m.bias, key_of(name, "weight"), adapter=roles.get(id(m)))
            )
        elif conv1d is not None and isinstance(m, conv1d):
            maps.append(
                LinearMap(name, m, m.weight.T, m.bias, key_of(name, "weight"), True, adapter=roles.get(id(m)))
            )
        elif isinstance(getattr(m, "lora_A", None), nn.ModuleDict) and hasattr(m, "base_layer"):
            maps.extend(merged_map(name, m, conv1d))
    return maps


def key_of(module_name: str, leaf: str) -> str:
    """A parameter's state-dict key (the root module's own parameters have no prefix)."""
    return f"{module_name}.{leaf}" if module_name else leaf


@torch.no_grad()
def merged_map(name: str, layer: nn.Module, conv1d: type | None) -> list[LinearMap]:
    """A peft LoRA linear layer's ``W + s B A`` (its active, unmerged adapters; ``s b_B`` added to the bias
    where an adapter has one), as one map. Not read this way (empty): a LoRA embedding (not a linear map)
    and DoRA adapters (their magnitude vector rescales the rows; their layer's base and ``A`` are read)."""
    base = getattr(layer, "base_layer", None)
    transposed = conv1d is not None and isinstance(base, conv1d)
    lora_a, lora_b = getattr(layer, "lora_A", None), getattr(layer, "lora_B", None)
    if (
        not (isinstance(base, nn.Linear) or transposed)
        or not isinstance(lora_a, nn.ModuleDict)
        or not (isinstance(lora_b, nn.ModuleDict))
    ):
        return []
    if any(key in getattr(layer, "lora_magnitude_vector", {}) for key in lora_a):
        return []
    active = set(getattr(layer, "active_adapters", ())) - set(getattr(layer, "merged_adapters", ()))
    keys = [
        k for k in lora_a if k in lora_b and k in active and not getattr(layer, "disable_adapters", False)
    ]
    scaling = getattr(layer, "scaling", {})
    adapters = tuple(
        (key_of(name, f"lora_A.{k}.weight"), key_of(name, f"lora_B.{k}.weight"), float(scaling[k]))
        for k in keys
    )
    weight = base.weight  # type: ignore[union-attr]
    view = LinearMap(name, layer, weight, None, key_of(name, "base_layer.weight"), transposed, adapters)
    merged = view.weight_in(dict(layer.state_dict(prefix=key_of(name, "")))).to(weight.dtype)
    bias = base.bias if isinstance(base.bias, torch.Tensor) else None  # type: ignore[union-attr]
    for k in keys:
        b_bias = getattr(lora_b[k], "bias", None)
        if isinstance(b_bias, torch.Tensor):
            bias = (0 if bias is None else bias) + float(scaling[k]) * b_bias
    return [LinearMap(name, layer, merged, bias, view.weight_key, transposed, adapters)]


@torch.no_grad()
def linear_products(inspection: Inspection) -> dict[str, torch.Tensor]:
    """``w x`` (no bias) of every linear layer on the probe, from one forward pass."""
    out: dict[str, torch.Tensor] = {}
    hooks = [
        layer.module.register_forward_hook(
            lambda _m, args, _o, layer=layer: out.__setitem__(
                layer.name, nn.functional.linear(args[0], layer.weight).flatten(0, -2)
            )
        )
        for layer in inspection.linears
    ]
    try:
        inspection.model(inspection.probe)
    finally:
        for h in hooks:
            h.remove()
    return out


def guard_model(
    model: nn.Module, probe: torch.Tensor, *, own: nn.Module | None = None, config: GuardConfig | None = None
) -> GuardVerdict:
    """Check ``model`` (the one the server sent, loaded) before training; raise :class:`MaliciousModelError`
    with the reasons on a hit. ``own``: the client's own architecture (default: ``model``'s, i.e. only the
    weight checks, for a loop that built the model itself and loaded the server's weights)."""
    verdict = ModelGuard(own if own is not None else model, config).inspect(model.state_dict(), probe)
    if not verdict.safe:
        raise MaliciousModelError(f"the server's model looks malicious: {verdict.reason()}")
    return verdict


def near_parallel(
    matrix: torch.Tensor, cosine: float, chunk: int = 1024, sketch: int = 256, candidates: int = 16
) -> int:
    """How many non-zero rows of ``matrix`` have another row with |cos| >= ``cosine``.

    Rows longer than ``sketch`` are first compared through a fixed random projection to ``sketch``
    dimensions (parallel rows stay exactly parallel under any linear map; a pair at cosine 0.99 projects to
    about 0.99 +- 0.01); each row's ``candidates`` closest rows there, when the closest is above 0.8, are
    measured exactly. No row is counted without an exact partner.
    """
    m = matrix.detach().to(torch.float64)
    norms = m.norm(dim=1)
    m = m[norms > 1e-12 * float(norms.max().clamp_min(1e-300))]
    if len(m) < 2:
        return 0
    m = m / m.norm(dim=1, keepdim=True)
    short = m
    if m.shape[1] > sketch:
        projection = torch.randn(
            m.shape[1], sketch, generator=torch.Generator().manual_seed(0), dtype=m.dtype
        )
        short = (m @ projection).to(torch.float32)
        short = short / short.norm(dim=1, keepdim=True).clamp_min(1e-30)
    if short is m:  # short rows: the exact cosines directly
        found = torch.zeros(len(m), dtype=torch.bool)
        for start in range(0, len(m), chunk):
            c = (m[start : start + chunk] @ m.T).abs()
            c[torch.arange(len(c)), torch.arange(start, start + len(c))] = 0
            found[start : start + len(c)] = c.max(dim=1).values >= cosine
        return int(found.sum())
    found = torch.zeros(len(m), dtype=torch.bool)
    for start in range(0, len(m), chunk):
        c = (short[start : start + chunk] @ short.T).abs()
        c[torch.arange(len(c)), torch.arange(start, start + len(c))] = 0
        best, partners = c.topk(min(candidates, len(m) - 1), dim=1)  # the closest in the sketch
        for i in torch.nonzero(best[:, 0] >= 0.8).reshape(-1).tolist():
            found[start + i] = bool(((m[partners[i]] @ m[start + i]).abs() >= cosine).any())
    return int(found.sum())


@register_guard_check("parallel")
def _parallel(inspection: Inspection, config: GuardConfig) -> list[GuardFinding]:
    out = []
    for i, layer in enumerate(inspection.linears):
        if layer.adapter == "B":  # read through the merged map (linear_maps)
            continue
        name, w = layer.name, layer.weight
        views = [("rows", w)] + ([("columns", w.T)] if i > 0 else [])  # first-layer columns: constant pixels
        for what, matrix in views:
            if matrix.shape[1] < MIN_ROWS:  # in a few dimensions random vectors are often near parallel
                continue
            n = near_parallel(matrix, config.parallel_cosine)
            if n >= config.parallel_rows:
                out.append(GuardFinding("parallel", name, (
                    f"{n} {what} have a near-parallel partner (|cos| >= {config.parallel_cosine}): "
                    "cumulative bins (Robbing the Fed, LOKI)"
                )))  # fmt: skip
    return out


@register_guard_check("degenerate")
def _degenerate(inspection: Inspection, config: GuardConfig) -> list[GuardFinding]:
    out = []
    for layer in inspection.linears:
        name, w = layer.name, layer.weight.detach().to(torch.float64)
        if layer.adapter == "B":  # read through the merged map (linear_maps)
            continue
        size = w.pow(2).mean(dim=1).sqrt()
        flat = w.std(dim=1) <= config.degenerate_ratio * size.clamp_min(1e-300)
        bad = int((flat | (size == 0)).sum())
        if bad:
            out.append(GuardFinding("degenerate", name, f"{bad} zero or constant rows (class fishing)"))
    return out


@register_guard_check("bias")
def _bias(inspection: Inspection, config: GuardConfig) -> list[GuardFinding]:
    out = []
    for layer in inspection.linears:
        name = layer.name
        if layer.bias is None or name not in inspection.products:
            continue
        spread = inspection.products[name].to(torch.float64).std(dim=0)
        b = layer.bias.detach().to(torch.float64).abs()
        bad = int(((b > config.bias_ratio * spread) & (b > 1.0)).sum())
        if bad:
            out.append(GuardFinding("bias", name, (
                f"{bad} biases exceed {config.bias_ratio:g}x the spread of what the layer computes on the "
                "client's data (closed LOKI slots, fished classes)"
            )))  # fmt: skip
    return out


@register_guard_check("balance")
def _balance(inspection: Inspection, config: GuardConfig) -> list[GuardFinding]:
    out = []
    for layer in inspection.linears:
        name, (rows, cols) = layer.name, layer.weight.shape
        if rows < MIN_ROWS or cols < MIN_ROWS or layer.adapter == "B":
            continue
        negative = (layer.weight.detach() < 0).sum(dim=1)
        balanced = float(((negative == cols // 2) | (negative == (cols + 1) // 2)).float().mean())
        if balanced > config.max_balanced_rows:
            out.append(GuardFinding("balance", name, (
                f"{balanced:.0%} of the rows have exactly half negative weights (random rows: about "
                f"{math.sqrt(2 / (math.pi * cols)):.0%}): trap weights"
            )))  # fmt: skip
    return out


@register_guard_check("frozen")
def _frozen(inspection: Inspection, config: GuardConfig) -> list[GuardFinding]:
    """A parameter the client does not train (a LoRA model's base, norms and embeddings) does not move in an
    honest federation beyond the rounding of an average of equal arrays (Flower's FedAvg averages in the
    arrays' dtype): ``frozen_ulps`` units in the last place of its dtype, per entry. One that moved further
    since the last model this client accepted was rewritten (a pass-through backbone, a constant embedding
    coordinate). Needs that reference, as ``drift``."""
    if inspection.previous is None:
        return []
    moved = [
        name
        for name, p in inspection.model.named_parameters()
        if not p.requires_grad and name in inspection.previous and p.is_floating_point()
        and beyond_rounding(inspection.previous[name], p, config.frozen_ulps)
    ]  # fmt: skip
    if not moved:
        return []
    return [GuardFinding("frozen", moved[0], f"{len(moved)} frozen parameters changed, e.g. {moved[:3]}")]


def beyond_rounding(before: torch.Tensor, after: torch.Tensor, ulps: float) -> bool:
    """Whether some entry of ``after`` differs from ``before`` by more than ``ulps`` units in the last place
    of ``after``'s dtype (relative to the entry, or to the tensor's largest entry near zero)."""
    b, a = before.detach().to(torch.float64), after.detach().to(torch.float64)
    eps = torch.finfo(after.dtype).eps
    scale = torch.maximum(b.abs(), torch.full_like(b, 1e-3 * float(b.abs().max()) if b.numel() else 0.0))
    return bool(((a - b).abs() > ulps * eps * scale).any())


def relative_change(before: torch.Tensor, after: torch.Tensor) -> float:
    """``||after - before|| / ||before||``: how far a layer moved, in units of its own size."""
    b = before.detach().to(torch.float64)
    return float((after.detach().to(torch.float64) - b).norm() / b.norm().clamp_min(1e-300))


@register_guard_check("drift")
def _drift(inspection: Inspection, config: GuardConfig) -> list[GuardFinding]:
    if inspection.previous is None:
        return []
    out = []
    for layer in inspection.linears:
        name = layer.name
        if layer.adapter in ("B", BOTTLENECK):  # they grow from zero / a small start: drift is no sign
            continue
        change = relative_change(layer.weight_in(inspection.previous), layer.weight)
        if change > config.max_drift:
            out.append(GuardFinding("drift", name, (
                f"the weights moved by {change:.2f} of their size since the last model this client accepted "
                f"(bound {config.max_drift:g}): rewritten, not trained"
            )))  # fmt: skip
    return out


__all__ = [
    "GUARD_CHECKS",
    "GuardConfig",
    "GuardFinding",
    "GuardVerdict",
    "MaliciousModelError",
    "ModelGuard",
    "guard_model",
    "register_guard_check",
    "relative_change",
]
