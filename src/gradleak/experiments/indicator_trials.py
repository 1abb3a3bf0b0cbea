"""Validating the truth-free indicator (:mod:`gradleak.audit.indicator`) against the truth.

On the leakage gate's labelled set of client updates (:mod:`gradleak.experiments.gate_trials`: data sets,
models, seeds, batch sizes, client defenses), each update is scored twice through the audit pipeline: with
the client's data and the floors by the full attack (the truth-based leakage over the floor, dB) and,
without any data, by the fast attack's fit margin over norm-matched noise. Reported: Spearman's rank
correlation between the two and the AUC of the margin for "leaks" (over the floor by more than
:data:`~gradleak.metrics.floors.LEAKS_ABOVE_DB`), the probability that a leaky update's margin exceeds a
non-leaky one's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from scipy.stats import spearmanr
from tqdm import tqdm

from gradleak.attacks import create_attack
from gradleak.audit.pipeline import attack_update
from gradleak.audit.scoring import ImageScorer
from gradleak.experiments.gate_trials import GateItem, LabelledSets
from gradleak.federation.simulation import derive_seed
from gradleak.metrics.floors import LEAKS_ABOVE_DB
from gradleak.spec import ComponentSpec
from gradleak.types import Observation


@dataclass
class IndicatorOutcome:
    item: GateItem
    leakage_db: float | None
    fit_margin: float | None
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {**self.item.__dict__, "leakage_db": self.leakage_db, "fit_margin": self.fit_margin,
                "seconds": self.seconds}  # fmt: skip


def run_items(
    items: Sequence[GateItem],
    *,
    fast: int = 100,
    full: int = 1000,
    reference_size: int = 256,
    progress: bool = False,
) -> list[IndicatorOutcome]:
    """The truth-based leakage (IG at ``full`` iterations) and the fit margin (IG at ``fast``) per item."""
    out = []
    sets = LabelledSets(reference_size)
    for item in tqdm(items, desc="indicator items", disable=not progress):
        model, reference, batch, update, _ = sets.update(item)
        obs = Observation(model, update, tuple(batch.images.shape[1:]), batch.num_classes,
                          labels=batch.labels.clone())  # fmt: skip
        start = time.perf_counter()
        full_spec = ComponentSpec("ig", {"max_iterations": full})
        truth = attack_update(
            create_attack("ig", max_iterations=full), full_spec, obs, generator=_gen(item, 1), truth=batch,
            scorer=ImageScorer(reference), floor_generator=_gen(item, 2),
        ).record  # fmt: skip
        fast_spec = ComponentSpec("ig", {"max_iterations": fast})
        blind = attack_update(
            create_attack("ig", max_iterations=fast), fast_spec, obs, generator=_gen(item, 3),
            null_generator=_gen(item, 4),
        ).record  # fmt: skip
        leak, margin = truth.get("psnr_mean_beyond_floor"), blind.get("fit_margin")
        out.append(IndicatorOutcome(
            item, float(leak) if isinstance(leak, int | float) else None,
            float(margin) if isinstance(margin, int | float) else None, time.perf_counter() - start,
        ))  # fmt: skip
    return out


def _gen(item: GateItem, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(item.seed, item.batch, 0x1D, salt))


def auc(positive: Sequence[float], negative: Sequence[float]) -> float | None:
    """P(a positive's score > a negative's), ties counting half (the Mann-Whitney form of the ROC AUC)."""
    if not positive or not negative:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in positive for n in negative)
    return wins / (len(positive) * len(negative))


def summarise(outcomes: Sequence[IndicatorOutcome]) -> dict[str, Any]:
    scored = [o for o in outcomes if o.leakage_db is not None and o.fit_margin is not None]
    leaky = [o.fit_margin for o in scored if o.leakage_db > LEAKS_ABOVE_DB]  # type: ignore[operator]
    clean = [o.fit_margin for o in scored if o.leakage_db <= LEAKS_ABOVE_DB]  # type: ignore[operator]
    rho = (
        spearmanr([o.fit_margin for o in scored], [o.leakage_db for o in scored]).statistic
        if len(scored) > 2
        else None
    )
    return {
        "updates": len(outcomes),
        "scored": len(scored),
        "leaky": len(leaky),
        "spearman": float(rho) if rho is not None else None,
        "auc": auc(leaky, clean),  # type: ignore[arg-type]
        "threshold_db": LEAKS_ABOVE_DB,
    }


__all__ = ["IndicatorOutcome", "auc", "run_items", "summarise"]
