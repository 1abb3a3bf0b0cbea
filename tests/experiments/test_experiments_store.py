"""The results store: checked before any work, units committed once, schema-1 stores upgraded."""

from __future__ import annotations

import contextlib
import json
import sqlite3

import pytest

from gradleak.cli import main
from gradleak.experiments.store import Checkpoint, ResultStore, RunRow, StoreError


@contextlib.contextmanager
def _sql(path):
    """A connection committed *and closed* on exit: sqlite3's own ``with`` only commits, and an open
    connection checkpoints the WAL into the file whenever it is collected, which changes the file's
    bytes at a moment no test chooses."""
    conn = sqlite3.connect(path)
    try:
        with conn:
            yield conn
    finally:
        conn.close()


def row(run_id: str = "r1", fingerprint: str = "f") -> RunRow:
    return RunRow(
        run_id, "exp", "2026-12-01T00:00:00", "", {"a": 1}, {"git_commit": "x"}, "running", fingerprint
    )


def test_units_are_committed_once_in_order_and_the_run_completes(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    run_id, resumed = store.begin_run(row())
    assert (run_id, resumed) == ("r1", False)
    store.commit_unit(
        run_id, "round/0", [{"kind": "round", "round": 0}], checkpoint=Checkpoint("round/0", b"x", {"k": 1})
    )
    store.commit_unit(run_id, "attack/0/0", [{"kind": "attack", "v": float("nan")}])
    with pytest.raises(StoreError, match="already stored"):
        store.commit_unit(run_id, "round/0", [{"kind": "round", "round": 0}])
    assert store.units(run_id) == {"round/0", "attack/0/0"}
    assert [r["kind"] for r in store.records(run_id)] == ["round", "attack"]  # the clash added nothing
    assert store.records(run_id, "attack")[0]["v"] == "nan"  # JSON has no NaN: stored visibly
    ckpt = store.checkpoint(run_id)
    assert ckpt is not None and ckpt.unit == "round/0" and ckpt.tensors == b"x" and ckpt.state == {"k": 1}
    assert store.runs() == []  # not complete yet
    store.finish_run(run_id, "2026-12-01T00:01:00", [{"kind": "summary"}])
    (done,) = store.runs()
    assert done.status == "complete" and done.finished == "2026-12-01T00:01:00"
    assert store.checkpoint(run_id) is None


def test_an_unfinished_run_is_resumed_only_when_its_process_is_gone(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    store.begin_run(row("live"))
    assert store.begin_run(row("second")) == ("second", False)  # "live" is owned by this process
    store.release("live")  # its process gave it up (it failed)
    assert store.begin_run(row("third")) == ("live", True)
    assert store.begin_run(row("other", fingerprint="g")) == ("other", False)  # another config
    assert store.begin_run(row("fresh"), resume=False) == ("fresh", False)
    with _sql(tmp_path / "s.sqlite") as conn:  # a dead process on this host
        conn.execute(
            "UPDATE runs SET owner = ? WHERE run_id = 'second'",
            (f"{__import__('socket').gethostname()}:999999999",),
        )
    assert store.begin_run(row("fourth")) == ("second", True)


def test_only_the_executing_process_writes_a_run(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    store.begin_run(row("mine"))
    with _sql(tmp_path / "s.sqlite") as conn:
        conn.execute("UPDATE runs SET owner = 'otherhost:1' WHERE run_id = 'mine'")
    with pytest.raises(StoreError, match="not being executed by this process"):
        store.commit_unit("mine", "round/0", [{"kind": "round"}])
    store.release("mine")  # not ours: nothing changes
    assert store.units("mine") == set()
    assert store.begin_run(row("again")) == ("again", False)  # another host's run is never taken over


def _foreign(path):
    with _sql(path) as conn:
        conn.execute("CREATE TABLE patients (id INTEGER, name TEXT)")


def _garbage(path):
    path.write_bytes(b"this is not a database, it is a text file\n" * 100)


def _newer(path):
    store = ResultStore(path)
    store.check()
    store.begin_run(row())
    with _sql(path) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")


def _corrupt(path):
    store = ResultStore(path)
    store.begin_run(row())
    for i in range(200):
        store.commit_unit("r1", f"u{i}", [{"kind": "round", "pad": "x" * 500}])
    with _sql(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    page = 4096
    for offset in range(2 * page, len(data) - page, 3 * page):  # overwrite interior pages
        data[offset + 8 : offset + 200] = b"\xff" * 192
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("make", "message"),
    [(_foreign, "not a gradleak results store: it holds tables"), (_garbage, "not a"),
     (_newer, "schema 99, newer than"), (_corrupt, "corrupt|not a readable|malformed")],
)  # fmt: skip
def test_a_bad_store_file_is_refused_before_any_work_and_nothing_is_written(tmp_path, capsys, make, message):
    from gradleak.cli.demo import demo_config_path

    store = tmp_path / "given.sqlite"
    make(store)
    before = store.read_bytes()
    with pytest.raises(StoreError, match=message):
        ResultStore(store).check()
    out = tmp_path / "out"
    assert (
        main(["run", demo_config_path(), "data.train_limit=300", "--out", str(out), "--store", str(store)])
        == 2
    )
    err = capsys.readouterr().err
    assert "gradleak: error:" in err and str(store) in err and "Traceback" not in err
    assert not out.exists() and store.read_bytes() == before  # no figure, no export, the file untouched


def test_a_schema_1_store_is_upgraded_in_place_keeping_its_runs(tmp_path):
    path = tmp_path / "old.sqlite"
    with _sql(path) as conn:
        conn.executescript(
            "CREATE TABLE runs (run_id TEXT PRIMARY KEY, name TEXT NOT NULL, started TEXT NOT NULL, "
            "finished TEXT NOT NULL, config TEXT NOT NULL, environment TEXT NOT NULL);"
            "CREATE TABLE records (run_id TEXT NOT NULL REFERENCES runs(run_id), seq INTEGER NOT NULL, "
            "kind TEXT NOT NULL, data TEXT NOT NULL, PRIMARY KEY (run_id, seq));"
        )
        conn.execute("INSERT INTO runs VALUES ('old', 'demo', 's', 'f', '{}', '{}')")
        conn.execute(
            "INSERT INTO records VALUES ('old', 0, 'summary', ?)", (json.dumps({"kind": "summary"}),)
        )
    store = ResultStore(path)
    store.check()
    (old,) = store.runs()
    assert old.run_id == "old" and old.status == "complete" and store.records("old") == [{"kind": "summary"}]
    store.begin_run(row("new"))
    store.commit_unit("new", "round/0", [{"kind": "round"}])
    assert [r.run_id for r in store.runs(include_unfinished=True)] == ["old", "new"]
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def _chunks(path) -> list[bytes]:
    with _sql(path) as conn:
        return [bytes(r[0]) for r in conn.execute("SELECT data FROM checkpoint_chunks ORDER BY idx")]


def test_a_checkpoint_over_the_chunk_size_is_stored_in_pieces_and_read_back_whole(tmp_path, monkeypatch):
    """SQLite caps one value at 1e9 bytes (a 135M-parameter model with AdamW state is 1.6e9): a checkpoint
    is split into CHUNK-byte pieces; a later, shorter checkpoint leaves no stale piece; finishing drops
    all."""
    import gradleak.experiments.store as store_module

    monkeypatch.setattr(store_module, "CHUNK", 3)
    path = tmp_path / "s.sqlite"
    store = ResultStore(path)
    run_id, _ = store.begin_run(row())
    store.commit_unit(run_id, "round/0", [], checkpoint=Checkpoint("round/0", b"abcdefgh", {"k": 0}))
    assert _chunks(path) == [b"abc", b"def", b"gh"]
    assert store.checkpoint(run_id) == Checkpoint("round/0", b"abcdefgh", {"k": 0})
    store.commit_unit(run_id, "round/1", [], checkpoint=Checkpoint("round/1", b"xyzw", {"k": 1}))
    assert _chunks(path) == [b"xyz", b"w"]
    assert store.checkpoint(run_id) == Checkpoint("round/1", b"xyzw", {"k": 1})
    store.finish_run(run_id, "2026-12-01T00:01:00")
    assert store.checkpoint(run_id) is None and _chunks(path) == []


def test_a_schema_2_store_is_upgraded_and_its_pending_checkpoint_still_resumes(tmp_path):
    path = tmp_path / "v2.sqlite"
    store = ResultStore(path)
    run_id, _ = store.begin_run(row())
    with _sql(path) as conn:  # as schema 2 wrote it: the bytes in checkpoints.tensors, no chunk table
        conn.execute("DROP TABLE checkpoint_chunks")
        conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
        conn.execute("INSERT INTO checkpoints VALUES (?, 'round/0', ?, '{}')", (run_id, b"old-bytes"))
    reopened = ResultStore(path)
    reopened.check()
    assert reopened.checkpoint(run_id) == Checkpoint("round/0", b"old-bytes", {})
    with _sql(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "3"
    reopened.commit_unit(run_id, "round/1", [], checkpoint=Checkpoint("round/1", b"new", {}))
    assert reopened.checkpoint(run_id) == Checkpoint("round/1", b"new", {})
