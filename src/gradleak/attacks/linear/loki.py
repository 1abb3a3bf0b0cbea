"""LOKI (Zhao, Sharma, Elkordy, Ezzeldin, Avestimehr, Bagchi; IEEE S&P 2024): imprints that survive secure
aggregation.

The server gives every client of the round its own *slot*: a 1x1 convolution in front of the imprint layer
copies the input into slot ``j``'s channels for client ``j`` only (identity kernels for slot ``j``, zero
kernels elsewhere: LOKI's per-client customised convolution), and a block-diagonal imprint layer gives each
slot its own ``k`` cumulative bins (:class:`~gradleak.models.malicious.GroupedLinear`). A client's data
therefore reach only its slot's rows, and the secure-aggregation *sum* of all updates keeps every client's
rows apart: the server runs the Robbing-the-Fed recovery slot by slot on the aggregate alone.

As in ``robbing_the_fed`` the measurement is a random direction on images centred by the public mean;
the customisation also sets the biases of the other slots to a large negative value, so a slot fed all
zeros (centred: minus the mean) fires no bin and every other client's rows stay exactly zero.

Customisation: the server sends client ``j`` the model :meth:`Loki.customize` ``(broadcast, j)`` returns;
its parameters have the same names and shapes for every client, so updates still add up. The current
runner broadcasts one model to every audited client; :meth:`Loki.prepare` therefore returns the model with
slot 0 open, under which LOKI degenerates to Robbing the Fed with ``bins_per_slot`` bins on the aggregate
(docs/attacks-linear.md, and the proposed ``customize`` hook in the runner). Ground-truth activations are
never read: the recovery uses the update, the broadcast model and the server's secrets only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from gradleak.attacks.checks import require_image_input
from gradleak.attacks.linear.imprint import (
    ImprintSecrets,
    calibrate_back_weight,
    features_to_images,
    invert_bins,
    local_step_count,
    place_bins,
    program_bins,
)
from gradleak.attacks.linear.robbing_the_fed import (
    ADAM_EPS,
    TUNINGS,
    output_classes,
    require_public,
    scale_for,
)
from gradleak.models.malicious import (
    ImprintBlock,
    SlotSeparator,
    imprint_parameter_names,
    insert_imprint,
    select_slot,
)
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation, Reconstruction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LokiConfig:
    """``slots``: clients the server customises per round; ``bins_per_slot``: k per client; ``scale``,
    ``back_weight``, ``tuned_for``, ``adam_margin``, ``rel_tol`` as for ``robbing_the_fed`` (the block's
    back-connection weight is ``back_weight * slots``, because the mean runs over every slot's rows and only
    one slot fires per client: each row then gets the gradient it would get in Robbing the Fed);
    ``max_images`` caps the output (None: the aggregate's sample count, the bins of largest mass; up to
    ``slots * bins_per_slot`` returns every non-empty bin, an upper bound on what the imprint leaks when
    a defense's synthetic bins outnumber the real ones)."""

    slots: int = 10
    bins_per_slot: int = 256
    scale: float | None = None
    back_weight: float = 10.0
    tuned_for: str = "sgd"
    adam_margin: float = 1e-4
    rel_tol: float = 1e-6
    max_images: int | None = None

    def __post_init__(self) -> None:
        if self.max_images is not None and (not isinstance(self.max_images, int) or self.max_images < 1):
            raise ValueError(f"max_images must be an int >= 1, got {self.max_images!r}")
        if not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {self.slots!r}")
        if not isinstance(self.bins_per_slot, int) or self.bins_per_slot < 2:
            raise ValueError(f"bins_per_slot must be an int >= 2, got {self.bins_per_slot!r}")
        if self.tuned_for not in TUNINGS:
            raise ValueError(f"tuned_for must be one of {TUNINGS}, got {self.tuned_for!r}")
        for key in ("scale", "back_weight", "adam_margin"):
            if key == "scale" and self.scale is None:
                continue
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)!r}")
        if not 0 <= self.rel_tol < 1:
            raise ValueError(f"rel_tol must be in [0, 1), got {self.rel_tol}")


class Loki:
    """The attack; see the module docstring."""

    def __init__(self, config: LokiConfig | None = None) -> None:
        self.config = config or LokiConfig()

    def prepare(
        self, model: nn.Module, public_images: torch.Tensor | None, *, generator: torch.Generator
    ) -> tuple[nn.Module, Mapping[str, object]]:
        cfg = self.config
        public = require_public(public_images, "loki")
        channels, dim = int(public.shape[1]), int(public[0].numel())
        mean, direction, cuts = place_bins(public, "random", cfg.bins_per_slot, generator)
        k, s = cfg.bins_per_slot, cfg.slots
        block = ImprintBlock(
            dim, k, front=SlotSeparator(channels, s), back_weight=cfg.back_weight * s, groups=s,
            offset=mean.repeat(s),
        )  # fmt: skip
        for j in range(s):
            program_bins(
                block.linear,
                direction,
                cuts,
                scale_for(cfg.scale, cfg.tuned_for),
                rows=slice(j * k, (j + 1) * k),
            )
        block.remember_bias()
        broadcast = select_slot(insert_imprint(model, block), 0)
        if cfg.tuned_for == "adam":
            imprint = broadcast.get_submodule("imprint")
            assert isinstance(imprint, ImprintBlock)
            calibrate_back_weight(
                broadcast, imprint, public, output_classes(broadcast, public), cfg.adam_margin * ADAM_EPS,
                generator, include_front=False,
            )  # fmt: skip
        weight_name, bias_name = imprint_parameter_names()
        bias = broadcast.get_parameter(bias_name).detach()
        secrets = ImprintSecrets(weight_name, bias_name, s * k, (dim,), bias, mean.to(torch.float32))
        return broadcast, {"attack": "loki", "slots": s, "bins_per_slot": k, **secrets.to_mapping()}

    def customize(self, broadcast: nn.Module, slot: int) -> nn.Module:
        """The model the server sends to the client in ``slot`` (a copy; ``broadcast`` is untouched)."""
        if not 0 <= slot < self.config.slots:
            raise ValueError(f"slot {slot} outside [0, {self.config.slots}): raise LokiConfig.slots")
        return select_slot(broadcast, slot)

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        require_image_input(obs)
        cfg = self.config
        start = time.perf_counter()
        secrets = ImprintSecrets.from_observation(obs)
        slots = int(obs.secrets.get("slots", cfg.slots))  # type: ignore[call-overload]
        k = int(obs.secrets.get("bins_per_slot", cfg.bins_per_slot))  # type: ignore[call-overload]
        if slots * k != secrets.num_bins:
            raise AttackInputError(
                f"bins do not match the broadcast model: {slots} slots x {k} bins != {secrets.num_bins} rows"
            )
        gw = obs.update.tensors[secrets.weight_name]
        gb = obs.update.tensors[secrets.bias_name]
        feats, masses, used = [], [], 0
        for j in range(slots):
            rows = slice(j * k, (j + 1) * k)
            rec = invert_bins(gw[rows], gb[rows], rel_tol=cfg.rel_tol)
            if len(rec.bins):
                used += 1
                feats.append(rec.features)
                masses.append(rec.mass / rec.mass.max())  # comparable across clients
        limit = cfg.max_images or max(1, obs.update.num_samples)
        if feats:
            order = torch.argsort(torch.cat(masses), descending=True)[:limit]
            images = features_to_images(secrets.restore(torch.cat(feats)[order]), obs.input_shape)
        else:
            log.warning("loki: no slot carries any update mass")
            images = torch.full((1, *obs.input_shape), 0.5)
        stats = {
            "seconds": time.perf_counter() - start,
            "slots": float(slots),
            "slots_with_data": float(used),
            "bins_recovered": float(sum(len(f) for f in feats)),
        }
        steps = local_step_count(obs)
        if steps is not None:
            stats["local_steps"] = float(steps)
        return Reconstruction(images=images, labels=None, stats=stats)


ATTACKS.register(
    "loki",
    Loki,
    config_cls=LokiConfig,
    summary="malicious server: per-client conv slots + imprint, recovery from the secure aggregate (LOKI)",
    modality="image",
)
