"""Measuring the client's leakage gate (:mod:`gradleak.audit.gate`) on a labelled set of updates.

Each item is one client's update as it would be sent: FedSGD on its local batch (batch sizes vary), under
one of several client defenses (none, pruning, update noise), for a data set and model. It is labelled by
the *full* attack (Inverting Gradients at ``full_iterations``) through the same pipeline and floors:
leaky when its leakage above the floor exceeds the gate's threshold. The gate's verdict comes from its
*fast* attack on the same update. Counted: recall (leaky updates the gate triggers on), false-trigger
rate (non-leaky updates it triggers on), each with exact one-sided 95 % bounds, and the gate's cost as a
share of the round (the client's local training plus the gate), all timed here, side by side.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F
from tqdm import tqdm

from gradleak.audit.gate import LEAKAGE, GateConfig, LeakageGate
from gradleak.data import load_dataset
from gradleak.data.base import ImageDataset
from gradleak.defenses.base import SetupContext
from gradleak.defenses.in_loop import build_defenses
from gradleak.experiments.guard_trials import clopper_pearson
from gradleak.federation.simulation import derive_seed
from gradleak.models import build_model
from gradleak.spec import ComponentSpec
from gradleak.types import Update

log = logging.getLogger(__name__)

CLIENT_DEFENSES: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    "none": (),
    "pruning 0.5": (("pruning", {"ratio": 0.5}),),
    "pruning 0.99": (("pruning", {"ratio": 0.99}),),
    "update noise": (("update_noise", {"clip": 1.0, "sigma": 0.01}),),
}


@dataclass(frozen=True)
class GateItem:
    """One labelled update: data set, model, its seed, the client's batch size and defense."""

    dataset: str
    model: str
    seed: int
    batch: int
    defense: str


@dataclass
class GateOutcome:
    item: GateItem
    full_db: float | None
    fast_db: float | None
    leaky: bool
    triggered: bool
    train_seconds: float
    gate_seconds: float
    full_seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {**self.item.__dict__, **{k: v for k, v in self.__dict__.items() if k != "item"}}


def client_update(
    model: torch.nn.Module, batch: ImageDataset, defense: str, generator: torch.Generator
) -> tuple[Update, float]:
    """The FedSGD update the client sends (its defenses applied) and the seconds its training took."""
    start = time.perf_counter()
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    F.cross_entropy(m(batch.images), batch.labels).backward()
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
    update = Update(grads, len(batch.images), "gradient")
    for d in build_defenses(CLIENT_DEFENSES[defense]):
        d.setup(m, SetupContext(generator))
        update = d.on_update(update)
    return update, time.perf_counter() - start


SCALES: dict[str, tuple[list[tuple[str, str]], list[int], int]] = {
    "smoke": ([("cifar10", "lenet")], [1, 4], 200),
    "small": ([("cifar10", "lenet"), ("pathmnist", "lenet")], [1, 2, 4, 8], 1000),
    "paper": (
        [("cifar10", "lenet"), ("cifar10", "sme_cifar_cnn"), ("pathmnist", "lenet")],
        [1, 2, 4, 8],
        1000,
    ),
}
"""The labelled set per scale: (data set, model) pairs, client batch sizes, the full attack's iterations
(shared by ``benchmarks/leakage_gate.py`` and ``benchmarks/truth_free_indicator.py``)."""


class LabelledSets:
    """Each item's model, reference images (the floors'), the client's batch and the update it sends,
    with its training seconds; models and data loaded once per (data set, model, seed)."""

    def __init__(self, reference_size: int = 256) -> None:
        self.reference_size = reference_size
        self.cache: dict[tuple[str, str, int], tuple[torch.nn.Module, ImageDataset, ImageDataset]] = {}

    def update(self, item: GateItem) -> tuple[torch.nn.Module, ImageDataset, ImageDataset, Update, float]:
        key = (item.dataset, item.model, item.seed)
        if key not in self.cache:
            data = load_dataset(item.dataset, limit=self.reference_size + 512)
            c, h, w = data.images.shape[1:]
            model = build_model(item.model, (c, h, w), data.num_classes, seed=item.seed)
            reference = data.subset(list(range(self.reference_size)))
            pool = data.subset(list(range(self.reference_size, len(data.images))))
            self.cache[key] = (model, reference, pool)
        model, reference, pool = self.cache[key]
        g = torch.Generator().manual_seed(derive_seed(item.seed, item.batch, len(item.defense)))
        batch = pool.subset(torch.randperm(len(pool.images), generator=g)[: item.batch].tolist())
        update, seconds = client_update(model, batch, item.defense, g)
        return model, reference, batch, update, seconds


def run_items(
    items: Sequence[GateItem],
    *,
    config: GateConfig | None = None,
    full_iterations: int = 500,
    reference_size: int = 256,
    progress: bool = False,
) -> list[GateOutcome]:
    """Label every item with the full attack and gate it with the fast one."""
    config = config or GateConfig()
    assert isinstance(config.attack, ComponentSpec)
    full = GateConfig(
        ComponentSpec(config.attack.name, {**config.attack.options, "max_iterations": full_iterations}),
        config.threshold_db, config.defenses, config.withhold,
    )  # fmt: skip
    sets = LabelledSets(reference_size)
    out = []
    for item in tqdm(items, desc="gate items", disable=not progress):
        model, reference, batch, update, train_seconds = sets.update(item)
        start = time.perf_counter()
        labelled = LeakageGate(full, reference=reference).measure(model, update, batch, None, _gen(item, 1))
        full_seconds = time.perf_counter() - start
        _, decision = LeakageGate(config, reference=reference).check(
            model, update, batch, generator=_gen(item, 2)
        )
        full_db = labelled.get(LEAKAGE)
        full_db = float(full_db) if isinstance(full_db, int | float) else None
        out.append(GateOutcome(
            item, full_db, decision.leakage_db, full_db is None or full_db > config.threshold_db,
            decision.triggered, train_seconds, decision.seconds, full_seconds,
        ))  # fmt: skip
    return out


def _gen(item: GateItem, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(item.seed, item.batch, salt))


def summarise(outcomes: Sequence[GateOutcome], threshold_db: float) -> dict[str, Any]:
    """Recall and false-trigger rate with their bounds, the cost share, and a threshold sweep of the
    fast attack (what another ``threshold_db`` for the gate alone would give, labels fixed)."""
    leaky = [o for o in outcomes if o.leaky]
    clean = [o for o in outcomes if not o.leaky]
    hits = sum(o.triggered for o in leaky)
    false = sum(o.triggered for o in clean)
    shares = [o.gate_seconds / (o.gate_seconds + o.train_seconds) for o in outcomes]
    sweep = {}
    for t in (threshold_db - 2, threshold_db - 1, threshold_db, threshold_db + 1, threshold_db + 2):
        fired = [o.fast_db is None or o.fast_db > t for o in outcomes]
        sweep[f"{t:g}"] = {
            "recall": sum(f for f, o in zip(fired, outcomes, strict=True) if o.leaky) / max(len(leaky), 1),
            "false_trigger_rate": sum(f for f, o in zip(fired, outcomes, strict=True) if not o.leaky)
            / max(len(clean), 1),
        }
    by_defense: dict[str, Mapping[str, int]] = {}
    for name in dict.fromkeys(o.item.defense for o in outcomes):
        rows = [o for o in outcomes if o.item.defense == name]
        by_defense[name] = {"updates": len(rows), "leaky": sum(o.leaky for o in rows),
                            "triggered": sum(o.triggered for o in rows)}  # fmt: skip
    return {
        "updates": len(outcomes),
        "leaky": len(leaky),
        "recall": hits / max(len(leaky), 1),
        "recall_95_lower": clopper_pearson(hits, len(leaky))[0],
        "false_trigger_rate": false / max(len(clean), 1),
        "false_trigger_rate_95_upper": clopper_pearson(false, len(clean))[1],
        "gate_share_of_round_mean": sum(shares) / max(len(shares), 1),
        "gate_share_of_round_max": max(shares, default=0.0),
        "gate_seconds_mean": sum(o.gate_seconds for o in outcomes) / max(len(outcomes), 1),
        "full_attack_seconds_mean": sum(o.full_seconds for o in outcomes) / max(len(outcomes), 1),
        "by_defense": by_defense,
        "threshold_sweep": sweep,
    }


def items_for(
    pairs: Sequence[tuple[str, str]], seeds: Sequence[int], batches: Sequence[int], defenses: Sequence[str]
) -> list[GateItem]:
    """Every combination."""
    return [GateItem(d, m, s, b, f) for d, m in pairs for s in seeds for b in batches for f in defenses]


__all__ = [
    "CLIENT_DEFENSES",
    "SCALES",
    "GateItem",
    "GateOutcome",
    "LabelledSets",
    "items_for",
    "run_items",
    "summarise",
]
