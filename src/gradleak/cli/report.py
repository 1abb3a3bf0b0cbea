"""``gradleak report STORE [RUN_ID ...]``: the audit report, one self-contained HTML file.

Without run ids: the latest run. Several run ids: one report comparing them (a grid's cells). ``gradleak
run`` writes the report of each run or grid next to its results (``report.html``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gradleak.cli.results import open_store
from gradleak.experiments.report import render
from gradleak.experiments.store import ResultStore
from gradleak.fileio import atomic_write


def add_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="write the HTML audit report of runs in a results store")
    p.add_argument("store", help="the SQLite results store (e.g. gradleak-out/results.sqlite)")
    p.add_argument("run_ids", nargs="*", help="run ids, or 'latest' (the default)")
    p.add_argument("--figures", default=None, help="folder holding RUN_ID/ figure folders (OUT/NAME)")
    p.add_argument("--out", default="report.html", help="the HTML file to write")
    p.set_defaults(handler=handle)


def write_report(store: ResultStore, run_ids: list[str], path: Path, figures: Path | None) -> Path:
    """Render and write atomically (a reader never sees half a report)."""
    page = render(store, run_ids, figures)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda tmp: tmp.write_text(page, encoding="utf-8"))


def handle(args: argparse.Namespace) -> int:
    path = Path(args.store)
    store = open_store(path)
    ids = list(args.run_ids) or ["latest"]
    if "latest" in ids:
        runs = store.runs(include_unfinished=True)
        if not runs:
            raise ValueError(f"{path} holds no runs")
        ids = [runs[-1].run_id if i == "latest" else i for i in ids]
    out = write_report(store, ids, Path(args.out), None if args.figures is None else Path(args.figures))
    print(f"report: {out}")
    return 0
