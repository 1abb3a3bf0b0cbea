"""SQLite results store: runs, their records committed per finished unit, and a resumable checkpoint.

A run is a row in ``runs`` (``status`` ``running`` until :meth:`ResultStore.finish_run` marks it
``complete``). Its work is split into *units* (one FL round, one attacked update, the summary); each unit's
records are committed in one transaction together with the unit's name in ``units``, so a unit is either
wholly stored or absent, never duplicated. A killed run is resumed by :meth:`ResultStore.begin_run` with the
same config fingerprint: its finished units are skipped. ``checkpoints`` holds the latest global model
(safetensors bytes, never pickle; in ``checkpoint_chunks`` of at most :data:`CHUNK` bytes each, since SQLite
caps a value at 1e9 bytes and a language model's weights and server optimizer state exceed it) and the
server's sampler state, written with the round units it follows (the runner commits rounds in groups when
a checkpoint takes long to write: ``runner.CHECKPOINT_OVERHEAD``).

The file is checked before any work (:meth:`ResultStore.check`): a foreign or corrupt file is a
:class:`StoreError`. WAL journaling and a busy timeout let several processes write one store at once.
Records are JSON objects with a ``kind`` ("round", "attack", "summary"); JSON and CSV exports read them.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradleak.fileio import atomic_write

SCHEMA_VERSION = 3
CHUNK = 1 << 28  # bytes per stored piece of a checkpoint (SQLite's default value limit is 1e9 bytes)
APPLICATION = "gradleak"

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    started TEXT NOT NULL,
    finished TEXT NOT NULL,
    config TEXT NOT NULL,
    environment TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'complete',
    fingerprint TEXT,
    owner TEXT
);
CREATE TABLE IF NOT EXISTS records (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    seq INTEGER NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL,
    unit TEXT,
    PRIMARY KEY (run_id, seq)
);
CREATE TABLE IF NOT EXISTS units (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    unit TEXT NOT NULL,
    PRIMARY KEY (run_id, unit)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT PRIMARY KEY REFERENCES runs(run_id),
    unit TEXT NOT NULL,
    tensors BLOB NOT NULL,
    state TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoint_chunks (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    idx INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (run_id, idx)
);
"""
# schema 2 (before checkpoint_chunks): a checkpoint's bytes were in checkpoints.tensors, which schema 3
# leaves empty; a pending schema-2 checkpoint is still read from there.
V2_UPGRADE = SCHEMA + f"UPDATE meta SET value = '{SCHEMA_VERSION}' WHERE key = 'schema_version';"
# schema 1 (before units and resume): runs(run_id, name, started, finished, config, environment) and
# records(run_id, seq, kind, data); its runs are all complete.
V1_TABLES = {"runs": {"run_id", "name", "started", "finished", "config", "environment"},
             "records": {"run_id", "seq", "kind", "data"}}  # fmt: skip
STAMP = f"""
INSERT OR IGNORE INTO meta VALUES ('application', '{APPLICATION}');
INSERT OR IGNORE INTO meta VALUES ('schema_version', '{SCHEMA_VERSION}');
"""
V1_UPGRADE = """
ALTER TABLE runs ADD COLUMN status TEXT NOT NULL DEFAULT 'complete';
ALTER TABLE runs ADD COLUMN fingerprint TEXT;
ALTER TABLE runs ADD COLUMN owner TEXT;
ALTER TABLE records ADD COLUMN unit TEXT;
"""


class StoreError(ValueError):
    """The store file cannot be used: not SQLite, corrupt, another program's database, or a unit clash."""


@dataclass(frozen=True)
class RunRow:
    run_id: str
    name: str
    started: str
    finished: str
    config: dict[str, Any]
    environment: dict[str, Any]
    status: str = "complete"
    fingerprint: str | None = None


@dataclass(frozen=True)
class Checkpoint:
    """The latest resumable state of a run: after ``unit``, model ``tensors`` (safetensors bytes) and a
    JSON-able ``state`` (e.g. the server's sampler)."""

    unit: str
    tensors: bytes
    state: dict[str, Any]


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


def _dumps(value: Any) -> str:
    return json.dumps(_finite(value), default=_json_default)


def normalise(record: dict[str, Any]) -> dict[str, Any]:
    """A record as the store gives it back (JSON: tuples become lists, NaN and Inf strings)."""
    loaded: dict[str, Any] = json.loads(_dumps(record))
    return loaded


def this_owner() -> str:
    """``host:pid`` of this process: who is executing a running run."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _owner_alive(owner: str | None) -> bool:
    """Whether the process that owns a running run may still be executing it (unknown hosts: assume so)."""
    if not owner or ":" not in owner:
        return False
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


class ResultStore:
    """A results database at ``path`` (created at the first write; :meth:`check` before any work)."""

    def __init__(self, path: str | Path, *, timeout: float = 60.0) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self._inspected = False  # the file was checked by this object (integrity, schema)

    # -- opening and checking -------------------------------------------------------------------------

    def check(self) -> None:
        """Open and check an existing file (SQLite, integrity, a gradleak store of a known schema; a
        schema-1 store is upgraded in place). A missing file is fine: it is created at the first write.
        Raises :class:`StoreError` naming the problem."""
        if self.path.is_dir():
            raise StoreError(f"results store {self.path} is a directory, not a file")
        if not self.path.exists():
            parent = self.path.parent if str(self.path.parent) else Path(".")
            ancestor = next((p for p in (parent, *parent.parents) if p.exists()), Path("."))
            if not os.access(ancestor, os.W_OK):
                raise StoreError(f"results store {self.path} cannot be created: {ancestor} is not writable")
            return
        with self._connect(create=False):
            pass

    def _inspect(self, conn: sqlite3.Connection, *, retry: bool = True) -> None:
        """Check the file (read-only unless it is empty or of schema 1) and create or upgrade the schema in
        one transaction, so a concurrent opener sees no tables or a complete, stamped store."""
        try:
            ok = conn.execute("PRAGMA quick_check").fetchone()
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"results store {self.path} is not a readable SQLite database ({exc})") from None
        if not ok or ok[0] != "ok":
            raise StoreError(
                f"results store {self.path} is corrupt (integrity check: {ok[0] if ok else '?'})"
            )
        if "meta" in tables:
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            if meta.get("application") != APPLICATION:
                raise StoreError(f"{self.path} is not a gradleak results store (meta: {meta})")
            version = int(meta.get("schema_version", "0"))
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"results store {self.path} has schema {version}, newer than this gradleak's "
                    f"{SCHEMA_VERSION}: upgrade gradleak or use another store"
                )
            if version < SCHEMA_VERSION:
                self._script(conn, V2_UPGRADE, retry)
            return
        if tables:
            columns = {
                t: {r[1] for r in conn.execute(f"PRAGMA table_info({t})")} for t in V1_TABLES if t in tables
            }
            if set(columns) != set(V1_TABLES) or any(columns[t] != V1_TABLES[t] for t in V1_TABLES):
                raise StoreError(
                    f"{self.path} is not a gradleak results store: it holds tables {sorted(tables)}; "
                    "pass another --store path"
                )
        self._script(conn, (V1_UPGRADE if tables else "") + SCHEMA + STAMP, retry)

    def _script(self, conn: sqlite3.Connection, script: str, retry: bool) -> None:
        """Create or upgrade the schema in one transaction (DDL is transactional in SQLite: a kill leaves
        the file as it was); on a clash with another process doing the same, inspect again."""
        try:
            conn.executescript("BEGIN IMMEDIATE;" + script + "COMMIT;")
        except sqlite3.OperationalError:
            conn.rollback()
            if not retry:
                raise
            self._inspect(conn, retry=False)  # another process created or upgraded it meanwhile

    @contextmanager
    def _connect(self, create: bool = True) -> Iterator[sqlite3.Connection]:
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:  # a new store is its owner's alone: its records hold clients' texts and scores
                os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                pass
        elif not self.path.exists():
            raise StoreError(f"results store {self.path} does not exist")
        try:
            conn = sqlite3.connect(self.path, timeout=self.timeout)
        except sqlite3.Error as exc:
            raise StoreError(f"results store {self.path} cannot be opened ({exc})") from None
        try:
            if not self._inspected:  # read-only checks first: a foreign file is never modified
                self._inspect(conn)
                self._inspected = True
            conn.execute("PRAGMA journal_mode=WAL")  # concurrent readers beside one writer at a time
            yield conn
        finally:
            conn.close()

    # -- writing ---------------------------------------------------------------------------------------

    def begin_run(self, run: RunRow, *, resume: bool = True) -> tuple[str, bool]:
        """Start ``run``, or resume an unfinished run with the same fingerprint whose process is gone.

        Returns ``(run_id, resumed)``. The claim is one immediate transaction, so two processes never
        resume the same run."""
        with self._write() as conn:
            if resume and run.fingerprint:
                rows = conn.execute(
                    "SELECT run_id, owner FROM runs WHERE status = 'running' AND fingerprint = ? "
                    "ORDER BY rowid",
                    (run.fingerprint,),
                ).fetchall()
                for run_id, owner in rows:
                    if not _owner_alive(owner):
                        conn.execute("UPDATE runs SET owner = ? WHERE run_id = ?", (this_owner(), run_id))
                        return run_id, True
            conn.execute(
                "INSERT INTO runs VALUES (?, ?, ?, '', ?, ?, 'running', ?, ?)",
                (run.run_id, run.name, run.started, _dumps(run.config), _dumps(run.environment),
                 run.fingerprint, this_owner()),
            )  # fmt: skip
        return run.run_id, False

    def _own(self, conn: sqlite3.Connection, run_id: str) -> None:
        row = conn.execute("SELECT owner, status FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            raise StoreError(f"no run {run_id!r} in {self.path}")
        if row[1] != "running" or row[0] != this_owner():
            raise StoreError(f"run {run_id} is not being executed by this process (owner {row[0]}, {row[1]})")

    def _insert_unit(
        self, conn: sqlite3.Connection, run_id: str, units: Sequence[str], records: Sequence[dict[str, Any]]
    ) -> None:
        """Inside an open transaction: the unit names (each once) and the records after the run's last."""
        for i, r in enumerate(records):
            if "kind" not in r:
                raise ValueError(f"record {i} of unit {units[0]!r} has no 'kind'")
        for unit in units:
            try:
                conn.execute("INSERT INTO units VALUES (?, ?)", (run_id, unit))
            except sqlite3.IntegrityError:
                raise StoreError(f"unit {unit!r} of run {run_id} is already stored") from None
        (top,) = conn.execute("SELECT COALESCE(MAX(seq), -1) FROM records WHERE run_id = ?", (run_id,))
        conn.executemany(
            "INSERT INTO records VALUES (?, ?, ?, ?, ?)",
            [(run_id, top[0] + 1 + i, r["kind"], _dumps(r), units[0]) for i, r in enumerate(records)],
        )

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One immediate transaction: committed when the block ends, rolled back on any exception."""
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.commit()
            except BaseException:
                conn.rollback()
                raise

    def commit_unit(
        self,
        run_id: str,
        unit: str,
        records: Sequence[dict[str, Any]] = (),
        *,
        checkpoint: Checkpoint | None = None,
        also: Sequence[str] = (),
    ) -> None:
        """Store one finished unit's records (and optionally the run's new checkpoint, and the names of
        units it completes, ``also``) atomically; a unit already stored is a :class:`StoreError` and
        changes nothing, and only the process executing the run may write to it."""
        with self._write() as conn:
            self._own(conn, run_id)
            self._insert_unit(conn, run_id, [unit, *also], records)
            if checkpoint is not None:
                conn.execute(
                    "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?)",
                    (run_id, checkpoint.unit, b"", _dumps(checkpoint.state)),
                )
                conn.execute("DELETE FROM checkpoint_chunks WHERE run_id = ?", (run_id,))
                view = memoryview(checkpoint.tensors)
                conn.executemany(
                    "INSERT INTO checkpoint_chunks VALUES (?, ?, ?)",
                    ((run_id, i, view[start : start + CHUNK])
                     for i, start in enumerate(range(0, len(view), CHUNK))),
                )  # fmt: skip

    def release(self, run_id: str) -> None:
        """The owning process gives up an unfinished run (it failed): the next same-config run resumes it."""
        with self._write() as conn:
            conn.execute(
                "UPDATE runs SET owner = NULL WHERE run_id = ? AND status = 'running' AND owner = ?",
                (run_id, this_owner()),
            )

    def finish_run(self, run_id: str, finished: str, records: Sequence[dict[str, Any]] = ()) -> None:
        """Commit the last unit (``summary``), mark the run complete and drop its checkpoint, atomically."""
        with self._write() as conn:
            self._own(conn, run_id)
            self._insert_unit(conn, run_id, ["summary"], records)
            conn.execute(
                "UPDATE runs SET status = 'complete', finished = ? WHERE run_id = ?", (finished, run_id)
            )
            conn.execute("DELETE FROM checkpoints WHERE run_id = ?", (run_id,))
            conn.execute("DELETE FROM checkpoint_chunks WHERE run_id = ?", (run_id,))

    # -- reading ---------------------------------------------------------------------------------------

    def runs(self, *, include_unfinished: bool = False) -> list[RunRow]:
        """Complete runs, oldest first (with ``include_unfinished``, running or killed ones too)."""
        if not self.path.exists():
            return []
        where = "" if include_unfinished else " WHERE status = 'complete'"
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT run_id, name, started, finished, config, environment, status, fingerprint FROM runs"
                + where
                + " ORDER BY rowid"
            ).fetchall()
        return [RunRow(r[0], r[1], r[2], r[3], json.loads(r[4]), json.loads(r[5]), r[6], r[7]) for r in rows]

    def units(self, run_id: str) -> set[str]:
        if not self.path.exists():
            return set()
        with self._connect() as conn:
            return {r[0] for r in conn.execute("SELECT unit FROM units WHERE run_id = ?", (run_id,))}

    def checkpoint(self, run_id: str) -> Checkpoint | None:
        if not self.path.exists():
            return None
        with self._connect() as conn:
            row = conn.execute(
                "SELECT unit, tensors, state FROM checkpoints WHERE run_id = ?", (run_id,)
            ).fetchone()
            if row is None:
                return None
            chunks = conn.execute(
                "SELECT data FROM checkpoint_chunks WHERE run_id = ? ORDER BY idx", (run_id,)
            ).fetchall()
        tensors = bytes(row[1]) or b"".join(bytes(c[0]) for c in chunks)  # schema 2 kept them in row[1]
        return Checkpoint(row[0], tensors, json.loads(row[2]))

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
        run = next((r for r in self.runs(include_unfinished=True) if r.run_id == run_id), None)
        if run is None:
            raise KeyError(f"no run {run_id!r} in {self.path}")
        payload = {**run.__dict__, "records": self.records(run_id)}
        return atomic_write(Path(path), lambda tmp: tmp.write_text(json.dumps(payload, indent=2)))

    def export_csv(self, run_id: str, path: str | Path, kind: str) -> Path:
        """Flat CSV of one record kind; nested values are JSON-encoded into their cell."""
        recs = self.records(run_id, kind)
        cols: list[str] = []
        for r in recs:
            cols += [k for k in r if k not in cols]

        def write(tmp: Path) -> None:
            with tmp.open("w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=cols)
                w.writeheader()
                for r in recs:
                    w.writerow({k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in r.items()})

        return atomic_write(Path(path), write)
