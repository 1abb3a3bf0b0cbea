"""The one audit step every path runs: attack an observed update, score it with its floor, make the record.

observe -> **attack -> score (with floors) -> record** -> commit. Observing differs by where the updates
come from (the in-process runner's simulation, the Flower engine's nodes, a Flower server's replies), and
committing by where records go (a run's units, a wrapper's audit run); the middle is this module, used by
:mod:`gradleak.experiments.runner` and :mod:`gradleak.integrations.flower.auditing` alike:

- **one failure policy**: an attack that finds nothing it can read (:class:`~gradleak.types.AttackInputError`,
  e.g. a defense left no gradient) is *refused*: its record says why and scores the empty reconstruction
  (what the server got); any other exception is an ``attack_error`` record with the reason, logged with its
  traceback: one attack's failure never stops a federation or the audit's other attacks;
- **one seed rule** (:func:`audit_generators`): the ``k``-th attacked update of an audit draws its
  attack's randomness from ``derive_seed(seed, 0xA77C, k)`` and its floor from ``derive_seed(seed,
  0xF1008, attack, k)``, so the same update attacked in-process and through a Flower wrapper gives the
  same record;
- **one record shape** (:func:`attack_update`): the attack, its options, what the observation was (one
  client or an aggregate of how many, how many samples), the formal privacy its defenses stated, the
  attack's statistics, and, with the truth, the modality's scores beside their floors.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from gradleak.audit.indicator import fit_margin
from gradleak.audit.scoring import Scorer
from gradleak.defenses.base import claims
from gradleak.device import CPU, module_device
from gradleak.federation.simulation import derive_seed
from gradleak.registry import ATTACKS
from gradleak.spec import ComponentSpec
from gradleak.types import Attack, AttackInputError, Observation, Reconstruction
from gradleak.validation import error_text

log = logging.getLogger(__name__)

ATTACK_SALT, FLOOR_SALT, NULL_SALT = 0xA77C, 0xF1008, 0x4E11


def audit_generators(seed: int, attack: int, k: int) -> tuple[torch.Generator, torch.Generator]:
    """The generators of the ``k``-th attacked update for the audit's ``attack``-th attack: the attack's
    own randomness (the same for every attack on that update, as an optimisation attack's initial guess
    should be) and its floor's (module docstring)."""
    return (
        torch.Generator().manual_seed(derive_seed(seed, ATTACK_SALT, k)),
        torch.Generator().manual_seed(derive_seed(seed, FLOOR_SALT, attack, k)),
    )


def null_generator(seed: int, attack: int, k: int) -> torch.Generator:
    """The generator of the truth-free indicator's null update for the ``k``-th attacked update."""
    return torch.Generator().manual_seed(derive_seed(seed, NULL_SALT, attack, k))


@dataclass
class AttackOutcome:
    """One attacked update: its record and the reconstruction (None when the attack failed)."""

    record: dict[str, Any]
    reconstruction: Reconstruction | None


def attack_device(name: str, model: torch.nn.Module) -> torch.device:
    """Where attack ``name`` computes on an observation of ``model``: the model's device when the attack is
    registered for its type, else the CPU (:mod:`gradleak.device`)."""
    device, devices = module_device(model), ATTACKS.entry(name).devices
    if device.type not in devices:
        log.info("%s computes on the CPU (registered devices: %s)", name, devices)
        return CPU
    return device


def on_attack_device(name: str, obs: Observation) -> Observation:
    """``obs`` where attack ``name`` computes (:func:`attack_device`); the update follows the model."""
    return obs.to(attack_device(name, obs.model))


def attack_update(
    attack: Attack,
    spec: ComponentSpec,
    obs: Observation,
    *,
    generator: torch.Generator,
    truth: Any | None = None,
    scorer: Scorer | None = None,
    floor_generator: torch.Generator | None = None,
    null_generator: torch.Generator | None = None,
) -> AttackOutcome:
    """Run ``attack`` (built from ``spec``) on ``obs`` and make its record (module docstring). With
    ``truth`` and a ``scorer`` the record carries the scores, and with a ``floor_generator`` their floors;
    with a ``null_generator`` the truth-free fit margin (:func:`gradleak.audit.indicator.fit_margin`)."""
    base: dict[str, Any] = {
        "attack": spec.name, "options": dict(spec.options), "aggregated": obs.aggregated,
        "num_clients": obs.num_clients, "num_samples": obs.update.num_samples,
    }  # fmt: skip
    obs = on_attack_device(spec.name, obs)
    refused, started = None, time.perf_counter()
    try:
        rec = attack.reconstruct(obs, generator=generator).to(CPU)  # results rest on the CPU
    except AttackInputError as exc:  # e.g. a defense left nothing the attack can read
        who = obs.update.metadata.get("client_id", "sum")
        log.info("%s refused the update of client %s: %s", spec.name, who, exc)
        refused, rec = str(exc), Reconstruction(token_ids=[])
    except Exception as exc:  # noqa: BLE001 - one attack's failure is recorded, never raised
        log.exception("audit: %s failed on the update of %s", spec.name, obs.update.metadata.get("client_id"))
        return AttackOutcome({"kind": "attack_error", **base, "error": error_text(exc)}, None)
    seconds = time.perf_counter() - started
    shown = rec.images if rec.images is not None else rec.token_ids
    record: dict[str, Any] = {
        "kind": "attack", **base, "refused": refused, "attack_seconds": seconds,
        "reconstructed": 0 if shown is None else len(shown), **claims(obs.update.metadata), **rec.stats,
    }  # fmt: skip
    if null_generator is not None and refused is None:
        try:
            record.update(fit_margin(attack, obs, rec, null_generator))
        except Exception as exc:  # noqa: BLE001 - the indicator's failure is noted, the record stands
            record["fit_margin_error"] = f"{type(exc).__name__}: {exc}"[:500]
    if truth is not None and scorer is not None:
        scores = scorer.score(rec, truth)
        if floor_generator is not None:
            scores.update(scorer.floors(attack, obs, truth, scores, floor_generator))
        record.update(batch_size=len(truth), **scores)
    return AttackOutcome(record, rec)
