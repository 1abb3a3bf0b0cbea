"""The client's leakage gate: attack your own update before sending it, and defend it when it leaks.

NVIDIA FLARE's privacy filters run a full inversion on the client; this gate runs a configured *fast*
attack (by default Inverting Gradients at 100 iterations) on the finished update, through the same audit
pipeline and scorer as every audit (:func:`gradleak.audit.pipeline.attack_update`, with the no-information
floors of :mod:`gradleak.metrics.floors`), and reads the leakage in the report's units: the mean PSNR of
the matched reconstructions above the higher floor (``psnr_mean_beyond_floor``, dB). Above
``threshold_db`` it applies the configured update-level defenses (by default pruning 90 % of the update)
and records the decision; it withholds the update only when ``withhold`` is set, because a client that
falls silent is itself a signal to the server. A gate whose attack fails fails closed: the defenses apply.

The attack is granted the true labels (a server that recovers labels, as iDLG does, has them too), so the
gate measures the worse case. Floors come from ``reference`` images of the client's own (held out from
the update, or a public set of the same task): what a reconstruction that carries nothing of the update
scores. How well the fast attack predicts the full one (recall, false triggers) and what it costs as a
share of the round is measured by ``benchmarks/leakage_gate.py`` (docs/security.md).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradleak.attacks import create_attack
from gradleak.audit.pipeline import attack_update
from gradleak.audit.scoring import ImageScorer
from gradleak.data.base import ImageDataset
from gradleak.defenses.base import DefenseChain, SetupContext, is_update_level
from gradleak.defenses.in_loop import DefenseSpec, build_defenses
from gradleak.metrics.floors import LEAKS_ABOVE_DB
from gradleak.registry import ATTACKS
from gradleak.spec import ComponentSpec, as_spec
from gradleak.types import LocalTraining, ModelModifyingAttack, Observation, Update
from gradleak.validation import error_text

log = logging.getLogger(__name__)

LEAKAGE = "psnr_mean_beyond_floor"
"""The record field the gate reads: the report's leakage above the null floor, in dB."""


@dataclass(frozen=True)
class GateConfig:
    """``attack``: the fast attack (a registered image attack that reads an update, not a malicious
    server's); ``threshold_db``: leakage above the floor (dB of mean PSNR) above which the gate acts;
    ``defenses``: update-level defenses applied then; ``withhold``: send nothing instead."""

    attack: ComponentSpec | str | tuple[str, Any] = ComponentSpec("ig", {"max_iterations": 100})
    threshold_db: float = LEAKS_ABOVE_DB
    defenses: Sequence[DefenseSpec] = (("pruning", {"ratio": 0.9}),)
    withhold: bool = False

    def __post_init__(self) -> None:
        spec = as_spec(self.attack)
        object.__setattr__(self, "attack", spec)
        object.__setattr__(self, "defenses", tuple(self.defenses))
        if spec.name not in ATTACKS or ATTACKS.entry(spec.name).modality != "image":
            raise ValueError(f"the gate's attack must be a registered image attack, got {spec.name!r}")
        if isinstance(create_attack(spec.name, **spec.options), ModelModifyingAttack):
            raise ValueError(f"{spec.name} is a malicious server's attack: the gate attacks an honest update")
        if not (isinstance(self.threshold_db, int | float) and math.isfinite(self.threshold_db)):
            raise ValueError(f"threshold_db must be a finite number, got {self.threshold_db!r}")
        if not isinstance(self.withhold, bool):
            raise ValueError(f"withhold must be true or false, got {self.withhold!r}")
        if not self.defenses and not self.withhold:
            raise ValueError("a gate with no defenses must withhold (withhold=True), or it does nothing")
        for d in build_defenses(self.defenses):
            if not is_update_level(d):
                raise ValueError(
                    f"defense {d.name!r} acts inside training; the gate defends a finished update"
                )


@dataclass(frozen=True)
class GateDecision:
    """What the gate measured and did. ``leakage_db``: the fast attack's leakage above the floor (None
    when the attack failed or scored nothing: the gate then acts); ``seconds``: the gate's own time."""

    leakage_db: float | None
    threshold_db: float
    triggered: bool
    withheld: bool
    seconds: float
    record: dict[str, Any] = field(default_factory=dict)


class LeakageGate:
    """The gate of one client (module docstring); ``reference``: the images its floors are drawn from."""

    def __init__(self, config: GateConfig | None = None, *, reference: ImageDataset) -> None:
        self.config = config or GateConfig()
        if len(reference) < 1:
            raise ValueError("the gate's floors need reference images")
        self.reference = reference
        self.decisions: list[GateDecision] = []

    def measure(
        self,
        model: nn.Module,
        update: Update,
        truth: ImageDataset,
        training: LocalTraining | None,
        generator: torch.Generator,
    ) -> dict[str, Any]:
        """The fast attack's record on ``update`` of ``model`` (the weights it was computed from) with
        ``truth`` (the data behind it), scored with floors."""
        spec = self.config.attack
        assert isinstance(spec, ComponentSpec)
        obs = Observation(
            model=copy.deepcopy(model), update=update, input_shape=tuple(truth.images.shape[1:]),
            num_classes=truth.num_classes, training=training, labels=truth.labels.clone(),
        )  # fmt: skip
        floor_generator = torch.Generator().manual_seed(
            int(torch.randint(0, 2**62, (1,), generator=generator))
        )
        return attack_update(
            create_attack(spec.name, **spec.options), spec, obs, generator=generator, truth=truth,
            scorer=ImageScorer(self.reference), floor_generator=floor_generator,
        ).record  # fmt: skip

    def check(
        self,
        model: nn.Module,
        update: Update,
        truth: ImageDataset,
        *,
        training: LocalTraining | None = None,
        generator: torch.Generator,
    ) -> tuple[Update | None, GateDecision]:
        """The update to send (``update`` itself, the defended one, or None when withheld) and the
        decision, which is also appended to :attr:`decisions`."""
        start = time.perf_counter()
        try:
            record = self.measure(model, update, truth, training, generator)
        except Exception as exc:  # noqa: BLE001 - no score (the update does not fit, scoring failed): act
            record = {"error": error_text(exc)}
        value = record.get(LEAKAGE)
        leakage = float(value) if isinstance(value, int | float) and math.isfinite(value) else None
        triggered = leakage is None or leakage > self.config.threshold_db
        out: Update | None = update
        if triggered and leakage is None:
            log.warning("leakage gate: the attack gave no score (%s); acting as if it leaked",
                        record.get("error") or record.get("refused"))  # fmt: skip
        if triggered and self.config.withhold:
            out = None
        elif triggered:
            chain = DefenseChain(build_defenses(self.config.defenses))  # fresh: no state across rounds
            chain.setup(nn.Module(), SetupContext(generator))
            out = chain.on_update(update)
        decision = GateDecision(
            leakage, self.config.threshold_db, triggered, out is None, time.perf_counter() - start,
            {k: v for k, v in record.items() if isinstance(v, int | float | str | bool | type(None))},
        )  # fmt: skip
        self.decisions.append(decision)
        if triggered:
            action = "withheld" if out is None else "defended"
            log.warning(
                "leakage gate: %s dB above the floor > %.1f dB: %s", leakage, self.config.threshold_db, action
            )
        return out, decision


__all__ = ["LEAKAGE", "GateConfig", "GateDecision", "LeakageGate"]
