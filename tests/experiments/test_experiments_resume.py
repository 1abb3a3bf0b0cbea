"""No work lost, nothing mixed: a real ``gradleak run`` killed with SIGKILL mid-audit resumes, and concurrent
runs sharing an output folder and a store never overwrite each other."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from gradleak.experiments.store import ResultStore

TIMING = {"seconds", "fl_seconds", "total_seconds", "attack_seconds"}
# 2 FL rounds, then 3 attack cells x 3 audited clients = 9 attacked updates, each its own unit
AUDIT = [
    "data.train_limit=600", "data.test_limit=100", "data.num_clients=10", "fl.rounds=2", "fl.fraction=0.3",
    "audit.clients=3", "audit.training.batch_size=2",
    "audit.attacks=[{name='ig', max_iterations=25}, {name='ig', max_iterations=25, lr=0.05}, "
    "{name='ig', max_iterations=25, tv_weight=0.001}]",
]  # fmt: skip


def gradleak(*args: str, **popen) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # same kernels in every process
    exe = Path(sys.executable).with_name("gradleak")  # the installed console script: a real `gradleak run`
    return subprocess.Popen(
        [str(exe), *args], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen,
    )  # fmt: skip


def demo_path() -> str:
    from gradleak.cli.demo import demo_config_path

    return demo_config_path()


def units(db: Path) -> set[str]:
    if not db.exists():
        return set()
    try:
        with sqlite3.connect(db, timeout=30) as conn:
            return {r[0] for r in conn.execute("SELECT unit FROM units")}
    except sqlite3.OperationalError:  # tables not created yet
        return set()


def untimed(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def test_a_run_killed_mid_audit_resumes_without_recomputing_or_duplicating(tmp_path):
    db, out = tmp_path / "s.sqlite", tmp_path / "out"
    proc = gradleak("run", demo_path(), *AUDIT, "--out", str(out), "--store", str(db))
    deadline = time.monotonic() + 240
    while True:  # kill once some attacked updates are stored and others are not
        done = {u for u in units(db) if re.fullmatch(r"attack/\d+/\d+", u)}
        if len(done) >= 2 or proc.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    before = units(db)
    finished = {u for u in before if re.fullmatch(r"attack/\d+/\d+", u)}
    assert 2 <= len(finished) < 9 and "summary" not in before
    with sqlite3.connect(db) as conn:
        rows_before = conn.execute("SELECT seq, data FROM records ORDER BY seq").fetchall()
        (run_id,) = conn.execute("SELECT run_id FROM runs WHERE status = 'running'").fetchone()

    again = gradleak("-v", "run", demo_path(), *AUDIT, "--out", str(out), "--store", str(db))
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert "resumed and finished" in stdout
    skipped = set(re.findall(r"unit (attack/\d+/\d+) already stored", stderr))
    assert skipped == finished  # the finished updates were not attacked again; the others were
    store = ResultStore(db)
    (run,) = store.runs()
    assert run.run_id == run_id and run.status == "complete"
    with sqlite3.connect(db) as conn:
        rows_after = conn.execute("SELECT seq, data FROM records ORDER BY seq").fetchall()
        dupes = conn.execute("SELECT COUNT(*) - COUNT(DISTINCT unit) FROM records WHERE kind != 'summary'")
        assert dupes.fetchone()[0] == 0
    assert rows_after[: len(rows_before)] == rows_before  # finished rows untouched
    records = store.records(run_id)
    assert [r["kind"] for r in records] == ["round"] * 2 + ["attack"] * 9 + ["summary"]

    reference_db = tmp_path / "ref.sqlite"
    ref = gradleak("run", demo_path(), *AUDIT, "--out", str(tmp_path / "ref"), "--store", str(reference_db))
    _, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err
    ref_store = ResultStore(reference_db)
    (ref_run,) = ref_store.runs()
    assert untimed(records) == untimed(ref_store.records(ref_run.run_id))  # equal to an uninterrupted run
    figures = sorted(p.name for p in (out / "demo" / run_id).glob("*.png"))
    assert figures == sorted(f"reconstructions_{i}_{k}.png" for i in range(3) for k in range(3))


def test_concurrent_runs_sharing_an_output_folder_and_a_store_do_not_mix(tmp_path):
    db, out = tmp_path / "shared.sqlite", tmp_path / "same"
    tiny = ["data.train_limit=300", "data.test_limit=50", "data.num_clients=5", "fl.rounds=1",
            "fl.fraction=0.2", "audit.attacks.0.max_iterations=5", "audit.training.batch_size=2",
            "audit.clients=1"]  # fmt: skip
    procs = [
        gradleak("run", demo_path(), *tiny, f"experiment.seed={i}", "--out", str(out), "--store", str(db))
        for i in range(3)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    runs = ResultStore(db).runs()
    assert len(runs) == 3 and sorted(r.config["experiment"]["seed"] for r in runs) == [0, 1, 2]
    folders = sorted((out / "demo").iterdir())
    assert sorted(f.name for f in folders) == sorted(r.run_id for r in runs)
    for folder in folders:
        exported = json.loads((folder / "results.json").read_text())
        assert exported["run_id"] == folder.name
        run = next(r for r in runs if r.run_id == folder.name)
        assert exported["config"]["experiment"]["seed"] == run.config["experiment"]["seed"]
        assert (folder / "reconstructions_0_0.png").stat().st_size > 1000
        assert not list(folder.glob("*.tmp*"))  # no temporary file left behind
