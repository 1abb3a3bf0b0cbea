"""Malicious models that keep the client's architecture: the weights, not the layers, carry the attack.

Every other malicious-server attack here inserts an imprint block, which a client that checks the model's
names and shapes refuses at once. These four write the attack into the client's own layers, so only the
weights can give them away (the client's guard, :mod:`gradleak.defenses.guard`, looks for exactly that):

- ``rtf_in_place``: Robbing the Fed (Fowl et al., ICLR 2022) in the model's own first linear layer: its
  first ``k`` rows become cumulative bins ``h_i = ReLU(s <a, f> - s (c_i + <a, o>))`` (one direction ``a``,
  cuts ``c_i`` at the quantiles of the public measurement, the public mean ``o`` folded into the biases),
  and the next linear layer's columns for those rows are set to one shared vector, so that every bin of a
  sample receives the same gradient (the paper's back-connection). Recovery: differences of consecutive
  bins, weight update over bias update (:func:`~gradleak.attacks.linear.imprint.invert_bins`).
- ``loki_in_place``: LOKI's per-client slots (Zhao et al., IEEE S&P 2024) without its 1x1 convolution: the
  rows split into ``slots`` groups of bins; client ``j``'s model (:meth:`LokiInPlace.customize`) has every
  other slot's biases closed (:data:`~gradleak.models.malicious.CLOSED_BIAS`), so the secure-aggregation sum
  keeps each client's data in its own rows.
- ``trap_weights``: Boenisch et al., "When the Curious Abandon Honesty: Federated Learning Is Not Private"
  (EuroS&P 2023), Sec. IV: each row of the first linear layer gets random magnitudes, half of its entries
  made negative and scaled by ``negative_scale > 1``, zero bias, so that on non-negative inputs each neuron
  fires for few samples; a neuron fired by one sample ``n`` gives ``dW_i / db_i = x_n`` exactly.
- ``class_fishing``: Wen et al., "Fishing for User Data in Large-Batch Federated Learning via Gradient
  Magnification" (ICML 2022), class fishing as the breaching library configures it: the output layer's rows
  are zeroed except the target class's, set to a constant ``class_multiplier``, and every other class's bias
  is raised to ``bias_multiplier``; the other classes then win every sample, so only target-class samples
  send gradient into the body, and an inversion (here Inverting Gradients with one image of the target label)
  attacks that magnified gradient.

The first three recover images only when the first linear layer reads the raw input (an MLP, ``mlp``); on
a CNN they are still built (the guard is measured on them) but recover features, which ``reconstruct``
refuses to score as images.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from gradleak.attacks.checks import require_image_input
from gradleak.attacks.image.ig import IGConfig, InvertingGradients
from gradleak.attacks.linear.imprint import (
    MEASUREMENTS,
    features_to_images,
    invert_bins,
    local_step_count,
    place_bins,
)
from gradleak.attacks.linear.robbing_the_fed import output_classes, require_public
from gradleak.models.malicious import CLOSED_BIAS
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation, Reconstruction, Update

log = logging.getLogger(__name__)


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The model's ``nn.Linear`` layers in registration order (the order of a feed-forward model)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def first_and_next(model: nn.Module) -> tuple[tuple[str, nn.Linear], tuple[str, nn.Linear] | None]:
    """The first linear layer and the next one that reads its outputs (None if there is none)."""
    layers = linear_layers(model)
    if not layers:
        raise AttackInputError("the model has no linear layer to write the attack into")
    first = layers[0]
    nxt = next((lay for lay in layers[1:] if lay[1].in_features == first[1].out_features), None)
    return first, nxt


@torch.no_grad()
def layer_inputs(model: nn.Module, layer: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """What ``layer`` reads when ``model`` sees ``images``, flattened to (N, D)."""
    seen: list[torch.Tensor] = []
    handle = layer.register_forward_hook(lambda _m, args, _out: seen.append(args[0].detach()))
    try:
        model(images)
    finally:
        handle.remove()
    return seen[0].flatten(1)


def reads_input(model: nn.Module, layer: nn.Module, images: torch.Tensor) -> bool:
    """Whether ``layer`` reads the raw pixels (so a recovered row is an image)."""
    f = layer_inputs(model, layer, images[:2])
    return f.shape == images[:2].flatten(1).shape and torch.equal(f, images[:2].flatten(1))


def secrets_of(layer_name: str, rows: int, reads: bool, **extra: object) -> dict[str, object]:
    return {"layer": layer_name, "rows": rows, "reads_input": reads, **extra}


def layer_update(obs: Observation) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The attacked layer's weight and bias update, and how many of its rows the attack programmed."""
    s = obs.secrets
    if not isinstance(s.get("layer"), str) or not isinstance(s.get("rows"), int):
        raise AttackInputError("no in-place attack secrets (layer, rows) in the observation")
    if not s.get("reads_input"):
        raise AttackInputError(
            f"the attacked layer {s['layer']!r} reads features, not the input: its rows recover features, "
            "not images (use a model whose first layer is linear on the pixels, e.g. 'mlp')"
        )
    name = str(s["layer"])
    try:
        return obs.update.tensors[f"{name}.weight"], obs.update.tensors[f"{name}.bias"], int(s["rows"])  # type: ignore[call-overload]
    except KeyError:
        raise AttackInputError(f"the update lacks {name}.weight / {name}.bias") from None


def check_positive(**values: float) -> None:
    for key, v in values.items():
        if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
            raise ValueError(f"{key} must be a positive finite number, got {v!r}")


@torch.no_grad()
def write_bins(
    linear: nn.Linear, features: torch.Tensor, rows: slice, generator: torch.Generator, scale: float,
    measurement: str,
) -> None:  # fmt: skip
    """Rows ``rows`` of ``linear`` become cumulative bins over ``features`` (the public data as the layer
    reads them): ``s <a, f> - s (c_i + <a, o>)``, ``a`` normalised to unit spread, cuts at the quantiles."""
    count = rows.stop - rows.start
    offset, direction, cuts = place_bins(features, measurement, count, generator)
    linear.weight[rows] = (scale * direction).to(linear.weight.dtype)
    linear.bias[rows] = (-scale * (cuts + direction @ offset)).to(linear.bias.dtype)


@torch.no_grad()
def share_columns(nxt: nn.Linear, rows: slice, back_weight: float) -> None:
    """The back-connection: the next layer reads every bin through the same column (``back_weight`` times
    the mean of those columns' signs, so each output keeps its usual sign), so all bins of a sample get one
    gradient."""
    column = nxt.weight[:, rows].mean(dim=1)
    column = back_weight * torch.where(column >= 0, 1.0, -1.0).to(column.dtype) / (rows.stop - rows.start)
    nxt.weight[:, rows] = column[:, None]


@dataclass(frozen=True)
class InPlaceBinsConfig:
    """``num_bins`` k (None: every row of the first linear layer); ``measurement`` as for
    ``robbing_the_fed``; ``scale`` the bins' gain in units of the public measurement's spread; ``back_weight``
    the next layer's total weight on the bins; ``max_images`` caps the output (None: the update's sample
    count); ``rel_tol`` the relative bias mass under which a bin counts as empty; ``noise``: an adaptive
    server's evasion, relative Gaussian noise added to every bin row (0: exact bins)."""

    num_bins: int | None = None
    measurement: str = "random"
    scale: float = 1e-2
    back_weight: float = 1.0
    max_images: int | None = None
    rel_tol: float = 1e-6
    noise: float = 0.0

    def __post_init__(self) -> None:
        if self.num_bins is not None and (not isinstance(self.num_bins, int) or self.num_bins < 2):
            raise ValueError(f"num_bins must be None or an int >= 2, got {self.num_bins!r}")
        if self.measurement not in MEASUREMENTS:
            raise ValueError(f"measurement must be one of {MEASUREMENTS}, got {self.measurement!r}")
        check_positive(scale=self.scale, back_weight=self.back_weight)
        if self.max_images is not None and self.max_images < 1:
            raise ValueError(f"max_images must be >= 1, got {self.max_images}")
        if not 0 <= self.rel_tol < 1:
            raise ValueError(f"rel_tol must be in [0, 1), got {self.rel_tol}")
        if not (math.isfinite(self.noise) and self.noise >= 0):
            raise ValueError(f"noise must be a finite number >= 0, got {self.noise!r}")


@torch.no_grad()
def perturbed(w: torch.Tensor, noise: float, generator: torch.Generator) -> torch.Tensor:
    """``w`` (rows, D) plus Gaussian noise of ``noise`` times each row's norm (per coordinate: / sqrt(D))."""
    scale = noise * w.norm(dim=1, keepdim=True) / math.sqrt(w.shape[1])
    return w + scale * torch.randn(w.shape, generator=generator, dtype=w.dtype)


class RtFInPlace:
    """Robbing the Fed in the model's own first linear layer; see the module docstring."""

    def __init__(self, config: InPlaceBinsConfig | None = None) -> None:
        self.config = config or InPlaceBinsConfig()

    def prepare(
        self, model: nn.Module, public_images: torch.Tensor | None, *, generator: torch.Generator
    ) -> tuple[nn.Module, Mapping[str, object]]:
        cfg = self.config
        public = require_public(public_images, "rtf_in_place")
        malicious = copy.deepcopy(model)
        (name, first), nxt = first_and_next(malicious)
        if nxt is None:
            raise AttackInputError(f"no linear layer reads {name!r}: the bins would have no back-connection")
        k = cfg.num_bins or first.out_features
        if k > first.out_features:
            raise AttackInputError(f"{name} has {first.out_features} rows, fewer than num_bins = {k}")
        rows = slice(0, k)
        features = layer_inputs(malicious, first, public)
        write_bins(first, features, rows, generator, cfg.scale, cfg.measurement)
        share_columns(nxt[1], rows, cfg.back_weight)
        if cfg.noise > 0:
            with torch.no_grad():
                first.weight[rows] = perturbed(first.weight[rows], cfg.noise, generator)
                nxt[1].weight[:, rows] = perturbed(nxt[1].weight[:, rows].T, cfg.noise, generator).T
        reads = reads_input(malicious, first, public)
        return malicious, {"attack": "rtf_in_place", **secrets_of(name, k, reads)}

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        require_image_input(obs)
        start = time.perf_counter()
        gw, gb, k = layer_update(obs)
        limit = self.config.max_images or max(1, obs.update.num_samples)
        rec = invert_bins(gw[:k], gb[:k], max_items=limit, rel_tol=self.config.rel_tol)
        return bins_reconstruction(rec.features, obs, start, bins=k, recovered=len(rec.bins))


def bins_reconstruction(
    features: torch.Tensor, obs: Observation, start: float, **stats: float
) -> Reconstruction:
    if len(features) == 0:  # nothing fired: one grey image, scored as a failure
        log.warning("%s: no row carries any update mass", obs.secrets.get("attack"))
        images = torch.full((1, *obs.input_shape), 0.5)
    else:
        images = features_to_images(features, obs.input_shape)
    out = {"seconds": time.perf_counter() - start, **{k: float(v) for k, v in stats.items()}}
    steps = local_step_count(obs)
    if steps is not None:
        out["local_steps"] = float(steps)
    return Reconstruction(images=images, labels=None, stats=out)


@dataclass(frozen=True)
class LokiInPlaceConfig:
    """``slots`` clients per round, ``bins_per_slot`` rows each (``slots * bins_per_slot`` must fit in the
    first linear layer); ``scale``, ``back_weight``, ``rel_tol``, ``max_images`` as for ``rtf_in_place``."""

    slots: int = 4
    bins_per_slot: int = 32
    scale: float = 1e-2
    back_weight: float = 1.0
    rel_tol: float = 1e-6
    max_images: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {self.slots!r}")
        if not isinstance(self.bins_per_slot, int) or self.bins_per_slot < 2:
            raise ValueError(f"bins_per_slot must be an int >= 2, got {self.bins_per_slot!r}")
        check_positive(scale=self.scale, back_weight=self.back_weight)
        if not 0 <= self.rel_tol < 1:
            raise ValueError(f"rel_tol must be in [0, 1), got {self.rel_tol}")
        if self.max_images is not None and self.max_images < 1:
            raise ValueError(f"max_images must be >= 1, got {self.max_images}")


class LokiInPlace:
    """LOKI's slots in the model's own first linear layer; see the module docstring."""

    def __init__(self, config: LokiInPlaceConfig | None = None) -> None:
        self.config = config or LokiInPlaceConfig()
        self._open_bias: torch.Tensor | None = None

    def prepare(
        self, model: nn.Module, public_images: torch.Tensor | None, *, generator: torch.Generator
    ) -> tuple[nn.Module, Mapping[str, object]]:
        cfg = self.config
        public = require_public(public_images, "loki_in_place")
        malicious = copy.deepcopy(model)
        (name, first), nxt = first_and_next(malicious)
        total = cfg.slots * cfg.bins_per_slot
        if nxt is None or total > first.out_features:
            raise AttackInputError(
                f"{name} must have >= {total} rows (slots x bins_per_slot) and a linear layer reading it"
            )
        features = layer_inputs(malicious, first, public)
        for j in range(cfg.slots):
            rows = slice(j * cfg.bins_per_slot, (j + 1) * cfg.bins_per_slot)
            write_bins(first, features, rows, generator, cfg.scale, "random")
        share_columns(nxt[1], slice(0, total), cfg.back_weight * cfg.slots)
        self._open_bias = first.bias.detach()[:total].clone()
        reads = reads_input(malicious, first, public)
        secrets = secrets_of(name, total, reads, slots=cfg.slots, bins_per_slot=cfg.bins_per_slot)
        return self.customize(malicious, 0), {"attack": "loki_in_place", **secrets}

    def customize(self, broadcast: nn.Module, slot: int) -> nn.Module:
        """Client ``slot``'s copy: its slot's biases as programmed, every other slot's closed."""
        cfg = self.config
        if self._open_bias is None:
            raise RuntimeError("loki_in_place: prepare() first")
        if not 0 <= slot < cfg.slots:
            raise ValueError(f"slot {slot} outside [0, {cfg.slots}): raise LokiInPlaceConfig.slots")
        custom = copy.deepcopy(broadcast)
        (_, first), _ = first_and_next(custom)
        k = cfg.bins_per_slot
        with torch.no_grad():
            first.bias[: len(self._open_bias)] = CLOSED_BIAS
            first.bias[slot * k : (slot + 1) * k] = self._open_bias[slot * k : (slot + 1) * k]
        return custom

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        require_image_input(obs)
        start = time.perf_counter()
        gw, gb, total = layer_update(obs)
        k = int(obs.secrets.get("bins_per_slot", self.config.bins_per_slot))  # type: ignore[call-overload]
        feats, masses = [], []
        for j in range(total // k):
            rec = invert_bins(gw[j * k : (j + 1) * k], gb[j * k : (j + 1) * k], rel_tol=self.config.rel_tol)
            if len(rec.bins):
                feats.append(rec.features)
                masses.append(rec.mass / rec.mass.max())
        limit = self.config.max_images or max(1, obs.update.num_samples)
        features = torch.empty(0, gw.shape[1], dtype=torch.float64)
        if feats:
            features = torch.cat(feats)[torch.argsort(torch.cat(masses), descending=True)[:limit]]
        return bins_reconstruction(features, obs, start, slots_with_data=len(feats), recovered=len(features))


@dataclass(frozen=True)
class TrapWeightsConfig:
    """``negative_scale`` s > 1 multiplies each row's negative half (Boenisch et al. Sec. IV; larger: sparser
    firing); ``max_images`` caps the output (None: the update's sample count); ``rel_tol`` the relative bias
    mass under which a row counts as silent; ``duplicate_cosine``: two recovered rows this similar are one
    sample; ``exact_half``: negate exactly half of each row's entries, as the paper does (False: each entry
    with probability 1/2, an adaptive server's evasion of a guard that counts exact halves)."""

    negative_scale: float = 1.05
    exact_half: bool = True
    max_images: int | None = None
    rel_tol: float = 1e-6
    duplicate_cosine: float = 0.99

    def __post_init__(self) -> None:
        if not (math.isfinite(self.negative_scale) and self.negative_scale > 1):
            raise ValueError(f"negative_scale must be a finite number > 1, got {self.negative_scale!r}")
        if self.max_images is not None and self.max_images < 1:
            raise ValueError(f"max_images must be >= 1, got {self.max_images}")
        if not 0 <= self.rel_tol < 1 or not 0 < self.duplicate_cosine <= 1:
            raise ValueError("rel_tol must be in [0, 1) and duplicate_cosine in (0, 1]")


class TrapWeights:
    """Boenisch et al.'s trap weights in the first linear layer; see the module docstring."""

    def __init__(self, config: TrapWeightsConfig | None = None) -> None:
        self.config = config or TrapWeightsConfig()

    def prepare(
        self, model: nn.Module, public_images: torch.Tensor | None, *, generator: torch.Generator
    ) -> tuple[nn.Module, Mapping[str, object]]:
        malicious = copy.deepcopy(model)
        (name, first), _ = first_and_next(malicious)
        rows, cols = first.weight.shape
        with torch.no_grad():
            magnitude = torch.rand(rows, cols, generator=generator) / math.sqrt(cols)
            if self.config.exact_half:
                order = torch.rand(rows, cols, generator=generator).argsort(dim=1)
                negative = torch.zeros(rows, cols, dtype=torch.bool).scatter_(1, order[:, : cols // 2], True)
            else:
                negative = torch.rand(rows, cols, generator=generator) < 0.5
            w = torch.where(negative, -self.config.negative_scale * magnitude, magnitude)
            first.weight.copy_(w.to(first.weight.dtype))
            first.bias.zero_()
        reads = public_images is not None and reads_input(malicious, first, public_images)
        return malicious, {"attack": "trap_weights", **secrets_of(name, rows, reads)}

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        require_image_input(obs)
        cfg = self.config
        start = time.perf_counter()
        gw, gb, _ = layer_update(obs)
        gw, gb = gw.detach().to(torch.float64), gb.detach().to(torch.float64)
        mass = gb.abs()
        live = torch.nonzero(mass > cfg.rel_tol * float(mass.max().clamp_min(1e-300))).reshape(-1)
        x = gw[live] / gb[live, None]
        unit = x / x.norm(dim=1, keepdim=True).clamp_min(1e-300)
        close = (unit @ unit.T) >= cfg.duplicate_cosine
        # a row fired by one sample alone gives that sample exactly, and so does every other such row: a
        # vector several rows agree on is a sample; a mixture of several is rarely repeated
        agree = (unit @ unit.T >= 1 - 1e-6).sum(dim=1)
        order = sorted(range(len(live)), key=lambda i: (-int(agree[i]), -float(mass[live[i]])))
        limit = cfg.max_images or max(1, obs.update.num_samples)
        kept: list[int] = []
        for i in order:  # a row too close to a kept one is the same sample
            if not any(bool(close[i, j]) for j in kept):
                kept.append(i)
            if len(kept) == limit:
                break
        features = x[kept] if kept else torch.empty(0, gw.shape[1], dtype=torch.float64)
        return bins_reconstruction(features, obs, start, rows_fired=len(live), recovered=len(kept))


@dataclass(frozen=True)
class ClassFishingConfig:
    """``target_class`` (None: drawn from the attack's generator); ``class_multiplier`` the constant of the
    target's output row and ``bias_multiplier`` the other classes' bias (breaching's defaults, 0.5 and
    1000); ``inversion``: Inverting Gradients' options for the one fished image."""

    target_class: int | None = None
    class_multiplier: float = 0.5
    bias_multiplier: float = 1000.0
    inversion: IGConfig = dataclasses.field(default_factory=lambda: IGConfig(max_iterations=500))

    def __post_init__(self) -> None:
        if self.target_class is not None and (
            not isinstance(self.target_class, int) or self.target_class < 0
        ):
            raise ValueError(f"target_class must be None or an int >= 0, got {self.target_class!r}")
        check_positive(class_multiplier=self.class_multiplier, bias_multiplier=self.bias_multiplier)
        if isinstance(self.inversion, Mapping):
            object.__setattr__(self, "inversion", IGConfig(**self.inversion))


class ClassFishing:
    """Wen et al.'s class fishing on the output layer; see the module docstring."""

    def __init__(self, config: ClassFishingConfig | None = None) -> None:
        self.config = config or ClassFishingConfig()

    def prepare(
        self, model: nn.Module, public_images: torch.Tensor | None, *, generator: torch.Generator
    ) -> tuple[nn.Module, Mapping[str, object]]:
        cfg = self.config
        malicious = copy.deepcopy(model)
        layers = linear_layers(malicious)
        if not layers:
            raise AttackInputError("class_fishing needs a linear output layer")
        name, out = layers[-1]
        classes = out.out_features
        target = cfg.target_class
        if target is None:
            target = int(torch.randint(0, classes, (1,), generator=generator))
        if target >= classes:
            raise AttackInputError(f"target_class {target} outside the model's {classes} classes")
        with torch.no_grad():
            out.weight.zero_()
            out.weight[target] = cfg.class_multiplier
            kept = float(out.bias[target])
            out.bias.fill_(cfg.bias_multiplier)
            out.bias[target] = kept
        if public_images is not None and output_classes(malicious, public_images) != classes:
            raise AttackInputError(f"{name} is not the model's output layer")
        return malicious, {"attack": "class_fishing", "layer": name, "target_class": target}

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        require_image_input(obs)
        target = obs.secrets.get("target_class")
        if not isinstance(target, int):
            raise AttackInputError("no class_fishing secrets (target_class) in the observation")
        layer = str(obs.secrets.get("layer", ""))
        body = {n: t for n, t in obs.update.tensors.items() if n not in (f"{layer}.weight", f"{layer}.bias")}
        fished = dataclasses.replace(  # the output layer's own gradient mixes every sample: left out
            obs,
            update=Update(body, 1, obs.update.kind, obs.update.metadata),
            labels=torch.tensor([target]),
        )
        inversion = dataclasses.replace(self.config.inversion, num_samples=1)
        rec = InvertingGradients(inversion).reconstruct(fished, generator=generator)
        return dataclasses.replace(rec, stats={**rec.stats, "target_class": float(target)})


ATTACKS.register(
    "rtf_in_place",
    RtFInPlace,
    config_cls=InPlaceBinsConfig,
    summary="malicious server: Robbing the Fed's bins in the model's own first linear layer",
    modality="image",
)
ATTACKS.register(
    "loki_in_place",
    LokiInPlace,
    config_cls=LokiInPlaceConfig,
    summary="malicious server: LOKI's per-client slots in the model's own first linear layer",
    modality="image",
)
ATTACKS.register(
    "trap_weights",
    TrapWeights,
    config_cls=TrapWeightsConfig,
    summary="malicious server: trap weights in the first linear layer (Boenisch et al. 2023)",
    modality="image",
)
ATTACKS.register(
    "class_fishing",
    ClassFishing,
    config_cls=ClassFishingConfig,
    summary="malicious server: class fishing on the output layer, then IG (Wen et al. 2022)",
    modality="image",
)
