"""SQLite results store: one row per finished run and one row per record, written in one transaction.

A run is written only when it has finished: a failure before :meth:`ResultStore.write_run` leaves the
store untouched, so there are never partial result rows. Records are JSON objects with a ``kind``
("round", "attack", ...). JSON and CSV exports read from the store.
"""

from __future__ import annotations

import csv
import json
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    started TEXT NOT NULL,
    finished TEXT NOT NULL,
    config TEXT NOT NULL,
    environment TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS records (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    seq INTEGER NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
);
"""


@dataclass(frozen=True)
class RunRow:
    run_id: str
    name: str
    started: str
    finished: str
    config: dict[str, Any]
    environment: dict[str, Any]


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot store {type(value).__name__} in a record")


def _finite(value: Any) -> Any:
    """JSON has no inf/nan: store them as strings so that they round-trip visibly."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class ResultStore:
    """A results database at ``path`` (created on first write)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path)
        try:
            conn.executescript(SCHEMA)
            yield conn
        finally:
            conn.close()

    def write_run(self, run: RunRow, records: Sequence[dict[str, Any]]) -> None:
        """Insert the run and all its records atomically (all or nothing)."""
        for i, r in enumerate(records):
            if "kind" not in r:
                raise ValueError(f"record {i} has no 'kind'")
        rows = [
            (run.run_id, i, r["kind"], json.dumps(_finite(r), default=_json_default))
            for i, r in enumerate(records)
        ]
        with self._connect() as conn, conn:  # the inner `conn` context commits or rolls back
            conn.execute(
                "INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?)",
                (
                    run.run_id,
                    run.name,
                    run.started,
                    run.finished,
                    json.dumps(_finite(run.config), default=_json_default),
                    json.dumps(run.environment, default=_json_default),
                ),
            )
            conn.executemany("INSERT INTO records VALUES (?, ?, ?, ?)", rows)

    def runs(self) -> list[RunRow]:
        if not self.path.exists():
            return []
        with self._connect() as conn:
            rows = conn.execute("SELECT * FROM runs ORDER BY started").fetchall()
        return [RunRow(r[0], r[1], r[2], r[3], json.loads(r[4]), json.loads(r[5])) for r in rows]

    def records(self, run_id: str, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        query = (
            "SELECT data FROM records WHERE run_id = ?" + (" AND kind = ?" if kind else "") + " ORDER BY seq"
        )
        args = (run_id, kind) if kind else (run_id,)
        with self._connect() as conn:
            return [json.loads(r[0]) for r in conn.execute(query, args).fetchall()]

    def export_json(self, run_id: str, path: str | Path) -> Path:
        run = next((r for r in self.runs() if r.run_id == run_id), None)
        if run is None:
            raise KeyError(f"no run {run_id!r} in {self.path}")
        payload = {**run.__dict__, "records": self.records(run_id)}
        out = Path(path)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(out)
        return out

    def export_csv(self, run_id: str, path: str | Path, kind: str) -> Path:
        """Flat CSV of one record kind; nested values are JSON-encoded into their cell."""
        recs = self.records(run_id, kind)
        cols: list[str] = []
        for r in recs:
            cols += [k for k in r if k not in cols]
        out = Path(path)
        tmp = out.with_suffix(out.suffix + ".tmp")
        with tmp.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=cols)
            w.writeheader()
            for r in recs:
                w.writerow({k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in r.items()})
        tmp.replace(out)
        return out
