"""``gradleak results STORE [RUN_ID]``: what a results store holds, whoever wrote it.

Without a run id: one line per run (complete, running or killed), from ``gradleak run``, ``gradleak demo``
or a Flower ServerApp's :class:`~gradleak.integrations.flower.AuditStrategy`. With a run id (or
``latest``): its attacked updates as a table, and the updates that never reached an attack (rejected
replies, client errors, attack errors) with their reasons.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from gradleak.cli.table import render
from gradleak.experiments.store import ResultStore

FAILURES = ("rejected", "client_error", "attack_error")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("results", help="show the runs in a results store, or one run's attacks")
    p.add_argument("store", help="the SQLite results store (e.g. gradleak-out/results.sqlite)")
    p.add_argument("run_id", nargs="?", default=None, help="a run id from the listing, or 'latest'")
    p.set_defaults(handler=handle)


def runs_table(store: ResultStore) -> str:
    rows = []
    for run in store.runs(include_unfinished=True):
        records = store.records(run.run_id)
        kinds = Counter(r["kind"] for r in records)
        engine = run.config.get("engine", {})
        engine_name = engine.get("name", "inprocess") if isinstance(engine, dict) else engine
        # a Flower audit stores no round records: its rounds are those its records name
        rounds = kinds.get("round", 0) or len({r["round"] for r in records if r.get("round") is not None})
        rows.append([run.run_id, run.status, run.started, engine_name, rounds, kinds.get("attack", 0),
                     sum(kinds.get(k, 0) for k in FAILURES)])  # fmt: skip
    return render(["run", "status", "started", "engine", "rounds", "attack records", "failures"], rows)


def attacks_table(store: ResultStore, run_id: str) -> str:
    records = store.records(run_id)
    rows = []
    for r in (r for r in records if r["kind"] == "attack"):
        who = r.get("node_id", r.get("client_id"))
        rows.append([r["attack"], r.get("round", "-"), "sum" if r.get("aggregated") else who,
                     r.get("num_samples", r.get("batch_size")), r.get("psnr_mean"), r.get("ssim_mean"),
                     r.get("reconstruction_rate"), r.get("label_accuracy"), r.get("matching_loss"),
                     r.get("seconds")])  # fmt: skip
    headers = ["attack", "round", "client/node", "samples", "PSNR dB", "SSIM", "rec. rate", "label acc",
               "matching loss", "seconds"]  # fmt: skip
    lines = [render(headers, rows) if rows else "(no attacked update)"]
    for r in (r for r in records if r["kind"] in FAILURES):
        who = r.get("node_id", r.get("client_id", "?"))
        attack = f", attack {r['attack']}" if r.get("attack") else ""
        lines.append(
            f"{r['kind']}: round {r.get('round', '-')}, client/node {who}{attack}: {r.get('error', '')}"
        )
    if not any("psnr" in r or "rouge1" in r for r in records if r["kind"] == "attack"):
        lines.append(
            "PSNR, SSIM, rec. rate and label acc need the clients' data: a real server's audit has none."
        )
    return "\n".join(lines)


def open_store(path: Path) -> ResultStore:
    """An existing results store, checked (a missing file is an error, never created by reading)."""
    if not path.is_file():
        raise FileNotFoundError(f"no results store at {str(path)!r}")
    store = ResultStore(path)
    store.check()
    return store


def handle(args: argparse.Namespace) -> int:
    path = Path(args.store)
    store = open_store(path)
    if args.run_id is None:
        print(runs_table(store))
        return 0
    runs = store.runs(include_unfinished=True)
    if not runs:
        raise ValueError(f"{path} holds no run")
    run_id = runs[-1].run_id if args.run_id == "latest" else args.run_id
    if run_id not in {r.run_id for r in runs}:
        raise ValueError(f"no run {run_id!r} in {path}; `gradleak results {path}` lists them")
    print(f"run {run_id}")
    print(attacks_table(store, run_id))
    return 0
