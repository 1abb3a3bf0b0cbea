"""Defense x attack grids from one config: which defense to switch on, against which attacks, at what cost.

``[grid] defenses = ["none", "aegis", { name = "batch_noise", sigma = 0.01 }]`` runs the experiment once per
defense (a *cell*), each with every attack of ``[audit]``. Every cell has the config's seed, so the same
partition, the same sampled clients in every round and the same audited clients (the grid's records carry
their ids, and :func:`run_grid` checks them). Each cell is an ordinary run in the results store: an
interrupted cell resumes where it stopped, a finished one is not run again (found by its fingerprint:
config and code), so a restarted grid gives the records an uninterrupted one gives.

Per cell and attack the summary reports privacy (the attack's scores over the audited updates: mean and
spread, with the number of updates; each beside its null floors and as leakage above them, see
:mod:`gradleak.metrics.floors`), utility (test accuracy after the same rounds) and cost (the cell's FL
time over the ``none`` cell's, from the same machine and code).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradleak.experiments import columns
from gradleak.experiments.config import ComponentSpec, ExperimentConfig, GridSection, cell_label
from gradleak.experiments.runner import RunOutcome, environment, fingerprint, run_experiment
from gradleak.experiments.store import ResultStore
from gradleak.progress import bar

log = logging.getLogger(__name__)

BASELINE = "none"
# per attacked update, where the attack reports it: every modality's scores and floors
PRIVACY = columns.keys()


@dataclass
class Cell:
    """One defense's run; ``reused``: found finished in the store, not run again."""

    label: str
    defense: ComponentSpec
    outcome: RunOutcome
    reused: bool = False


@dataclass
class GridOutcome:
    config: ExperimentConfig
    cells: list[Cell]

    def summary(self) -> list[dict[str, Any]]:
        """One row per cell and attack: privacy (mean, spread, count), utility, cost."""
        base = next((c for c in self.cells if c.defense.name == BASELINE), None)
        base_seconds = _fl_seconds(base.outcome) if base is not None else None
        names = [spec.name for spec in self.config.audit.attacks]
        rows = []
        for cell in self.cells:
            seconds = _fl_seconds(cell.outcome)
            summary = cell.outcome.of_kind("summary")[0]
            common = {"defense": cell.label, "accuracy": summary.get("final_accuracy"),
                      "perplexity": summary.get("final_perplexity"), "fl_seconds": seconds,
                      "cost": seconds / base_seconds if base_seconds else None}  # fmt: skip
            attacks = cell.outcome.of_kind("attack")
            for i, spec in enumerate(self.config.audit.attacks):
                records = [r for r in attacks if r.get("cell") == i]
                # an attack listed twice (other options) is told apart by its options in tables
                label = cell_label(spec) if names.count(spec.name) > 1 else spec.name
                row: dict[str, Any] = {**common, "attack": spec.name, "attack_label": label,
                                       "updates": len(records),
                                       "withheld": columns.withheld(cell.outcome.records, i),
                                       "failed": columns.failed(cell.outcome.records, i)}  # fmt: skip
                rows.append({**row, **spread(records, PRIVACY)})
        return rows


def spread(records: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, float]:
    """``key`` (the mean) and ``key_sd`` (the sample standard deviation, 0 for one value) of every key the
    records hold a number for (booleans count as 0 / 1)."""
    out: dict[str, float] = {}
    for key in keys:
        values = [float(r[key]) for r in records if isinstance(r.get(key), int | float)]
        if values:
            out[key] = statistics.fmean(values)
            out[f"{key}_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
    return out


def _fl_seconds(outcome: RunOutcome) -> float:
    return float(outcome.of_kind("summary")[0]["fl_seconds"])


MAX_NAME = 200  # experiment.name's limit (gradleak.validation.SAFE_NAME)


def cell_name(base: str, label: str) -> str:
    """``base.label`` made a safe run name (run ids, folder names); a label whose name would pass the
    200-character limit (a defense with many options) keeps its head and a digest of the whole."""
    slug = re.sub(r"[^A-Za-z0-9._=-]+", "-", label).strip("-")
    slug = re.sub(r"\.{2,}", ".", slug)
    name = f"{base}.{slug}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.blake2b(label.encode(), digest_size=6).hexdigest()
    keep = max(0, MAX_NAME - len(base) - len(digest) - 2)
    return f"{base}.{slug[:keep].rstrip('.-')}-{digest}"


def cell_configs(cfg: ExperimentConfig) -> list[tuple[ComponentSpec, ExperimentConfig]]:
    """Each cell's own config: the grid's, with that defense and a name of its own (same seed)."""
    out = []
    for spec in cfg.grid.defenses:
        name = cell_name(cfg.experiment.name, cell_label(spec))
        cell = dataclasses.replace(
            cfg, defenses=(spec,), grid=GridSection(),
            experiment=dataclasses.replace(cfg.experiment, name=name),
        )  # fmt: skip
        out.append((spec, cell))
    return out


def _finished(store: ResultStore | None, cfg: ExperimentConfig) -> RunOutcome | None:
    """A complete run of exactly this config and code in the store, if any."""
    if store is None:
        return None
    key = fingerprint(cfg, environment())
    for run in store.runs():
        if run.fingerprint == key and run.status == "complete":
            return RunOutcome(run.run_id, cfg, store.records(run.run_id), resumed=True)
    return None


def run_grid(
    cfg: ExperimentConfig,
    *,
    store: ResultStore | None = None,
    out_dir: str | Path | None = None,
    progress: bool | None = None,
    resume: bool = True,
    per_run_folder: bool = False,
) -> GridOutcome:
    """Run every cell of ``cfg.grid`` (module docstring); cells already finished in ``store`` are reused."""
    if not cfg.grid.defenses:
        raise ValueError("the config has no [grid] defenses; run it with run_experiment")
    cells = []
    for spec, cell_cfg in bar(cell_configs(cfg), desc="grid cells", force=bool(progress)):
        label = cell_label(spec)
        found = _finished(store, cell_cfg) if resume else None
        if found is not None:
            log.info("grid cell %s: finished in the store (run %s), not run again", label, found.run_id)
            cells.append(Cell(label, spec, found, reused=True))
            continue
        log.info("grid cell %s", label)
        outcome = run_experiment(cell_cfg, store=store, out_dir=out_dir, progress=progress, resume=resume,
                                 per_run_folder=per_run_folder)  # fmt: skip
        cells.append(Cell(label, spec, outcome))
    _check_same_federation(cells)
    return GridOutcome(cfg, cells)


def _check_same_federation(cells: Sequence[Cell]) -> None:
    """Every cell sampled the same clients in every round, and audited clients drawn from the same ones
    (a defense that fails closed leaves its client out of that cell's records, nothing else)."""
    rounds = [[r["clients"] for r in c.outcome.of_kind("round")] for c in cells]
    audited = [{r.get("client_id") for r in c.outcome.of_kind("attack")} for c in cells]
    widest = max(audited, key=len)
    for cell, sampled, ids in zip(cells, rounds, audited, strict=True):
        if sampled != rounds[0] or not ids <= widest:
            raise RuntimeError(
                f"grid cell {cell.label} trained or audited other clients than cell {cells[0].label} "
                f"(rounds {sampled} vs {rounds[0]}; audited {sorted(ids, key=str)} vs "
                f"{sorted(widest, key=str)})"
            )
