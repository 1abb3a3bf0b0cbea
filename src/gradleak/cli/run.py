"""``gradleak run CONFIG [key=value ...]``: run an experiment; store, export, draw."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gradleak.cli.report import write_report
from gradleak.cli.table import render
from gradleak.experiments import ResultStore, RunOutcome, columns, load_config, run_experiment
from gradleak.experiments.columns import modality_of
from gradleak.experiments.config import ExperimentConfig
from gradleak.experiments.grid import GridOutcome, run_grid
from gradleak.fileio import atomic_write
from gradleak.plugins import load_plugins


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="run an experiment from a TOML config")
    p.add_argument("config", help="path to the experiment TOML file")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. fl.rounds=2")
    add_plugin_arg(p)
    add_output_args(p)
    p.set_defaults(handler=handle)


def add_plugin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--plugin", action="append", default=[], metavar="MODULE",
        help="import a module (name, or path to a .py file) that registers data sets, models, attacks or "
        "defenses before the config is read; repeatable",
    )  # fmt: skip
    p.add_argument(
        "--trust-config-plugins", action="store_true",
        help="load the .py files the config's experiment.plugins names (code that comes with the config: "
        "refused by default)",
    )  # fmt: skip


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="gradleak-out", help="output folder; each run writes OUT/NAME/RUN_ID/")
    p.add_argument("--store", default=None, help="SQLite results store (default: OUT/results.sqlite)")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="start a new run even if an unfinished run of the same config can be resumed",
    )


def execute(cfg: ExperimentConfig, args: argparse.Namespace) -> RunOutcome:
    """Run, then export; shared by ``run`` and ``demo``. The store is checked before any work; the run's
    files go to their own folder, so concurrent runs never overwrite each other's."""
    out = Path(args.out)
    store = ResultStore(args.store or out / "results.sqlite")
    store.check()
    outcome = run_experiment(
        cfg, store=store, out_dir=out / cfg.experiment.name, resume=not args.fresh,
        per_run_folder=True,
    )  # fmt: skip
    base = outcome.out_dir
    assert base is not None
    exports = [store.export_json(outcome.run_id, base / "results.json")]
    for kind in ("round", "attack"):
        if outcome.of_kind(kind):
            exports.append(store.export_csv(outcome.run_id, base / f"{kind}s.csv", kind))
    exports.append(write_report(store, [outcome.run_id], base / "report.html", out / cfg.experiment.name))
    print(summary_table(outcome))
    verb = "resumed and finished" if outcome.resumed else "stored"
    print(f"\nrun {outcome.run_id} {verb} in {store.path}")
    print(f"exports: {', '.join(str(e) for e in exports)}")
    print(f"report: {base / 'report.html'}")
    for f in outcome.figures:
        print(f"figure: {f}")
    return outcome


def summary_table(outcome: RunOutcome) -> str:
    """One row per attacked update: who, the utility after the rounds, the modality's privacy columns."""
    summary = outcome.of_kind("summary")[0]
    modality = modality_of(outcome.config.data.dataset)
    privacy = columns.PRIVACY[modality]
    utility = [c for c in columns.UTILITY if c.key in summary]
    rows = []
    for r in outcome.of_kind("attack"):
        rows.append([r["attack"], r.get("client_id", "sum"), r["batch_size"],
                     *(summary[c.key] for c in utility), *(r.get(c.key) for c in privacy),
                     "refused" if r.get("refused") else r.get("seconds")])  # fmt: skip
    if not rows:
        empty = [None] * (len(privacy) + 1)
        rows.append(["(no attack)", "-", "-", *(summary[c.key] for c in utility), *empty])
    headers = ["attack", "client", "batch", *(c.header for c in utility), *(c.header for c in privacy),
               "attack s"]  # fmt: skip
    lines = [render(headers, rows)]
    lines.append(
        f"FL: {len(outcome.of_kind('round'))} rounds in {summary['fl_seconds']:.1f}s; "
        f"total {summary['total_seconds']:.1f}s. {columns.NOTES[modality]}"
    )
    return "\n".join(lines)


def execute_grid(cfg: ExperimentConfig, args: argparse.Namespace) -> GridOutcome:
    """A grid config: every cell as a run in the store (finished cells reused), then the grid's table and
    its summary as JSON."""
    out = Path(args.out)
    store = ResultStore(args.store or out / "results.sqlite")
    store.check()
    grid = run_grid(cfg, store=store, out_dir=out / cfg.experiment.name, resume=not args.fresh,
                    per_run_folder=True)  # fmt: skip
    rows = grid.summary()
    privacy = [c for c in columns.PRIVACY[modality_of(cfg.data.dataset)] if c.key != "label_accuracy"]
    ppl = any(r.get("perplexity") is not None for r in rows)  # a causal LM's utility
    table = [[r["defense"], r["attack_label"], columns.updates_label(r), *(_pm(r, c.key) for c in privacy),
              r.get("label_accuracy"), r["accuracy"], *([r["perplexity"]] if ppl else []), r["cost"]]
             for r in rows]  # fmt: skip
    headers = ["defense", "attack", "updates", *(c.header for c in privacy), "label acc", "test acc",
               *(["test ppl"] if ppl else []), "FL time / none"]  # fmt: skip
    print(render(headers, table))
    path = out / cfg.experiment.name / "grid.json"
    cells = [{"defense": c.label, "run_id": c.outcome.run_id, "reused": c.reused} for c in grid.cells]
    payload = {"grid": cfg.experiment.name, "cells": cells, "summary": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(payload, indent=2, default=str)))
    folder = out / cfg.experiment.name
    report = write_report(store, [c.outcome.run_id for c in grid.cells], folder / "report.html", folder)
    print(f"report: {report}")
    reused = sum(c.reused for c in grid.cells)
    print(f"\n{len(grid.cells)} cells ({reused} already finished) in {store.path}; summary: {path}")
    return grid


def _pm(row: dict[str, Any], key: str) -> str:
    if key not in row:
        return "n/a"
    return f"{row[key]:.3f} +- {row[key + '_sd']:.3f}"


def handle(args: argparse.Namespace) -> int:
    load_plugins(args.plugin)
    cfg = load_config(args.config, args.overrides, trust_plugins=args.trust_config_plugins)
    if cfg.grid.defenses:
        execute_grid(cfg, args)
    else:
        execute(cfg, args)
    return 0
