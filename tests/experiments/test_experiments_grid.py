"""Defense x attack grids from one config (issue 18, item 2): the cells share the federation and the
audited clients, record privacy, utility and cost, a restarted grid reuses its finished cells and gives the
same records, and a cell's records are those of the same experiment run alone with that defense."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from gradleak.cli import main
from gradleak.experiments import ResultStore, load_config, run_experiment
from gradleak.experiments.config import ConfigError
from gradleak.experiments.grid import cell_configs, run_grid

ROOT = Path(__file__).resolve().parents[2]
GRID = ROOT / "examples" / "organamnist_grid.toml"
TINY = [
    "data.train_limit=1500", "data.test_limit=300", "data.num_clients=20", "fl.rounds=1", "fl.fraction=0.2",
    "audit.clients=2", "audit.training.batch_size=2", "audit.attacks.0.max_iterations=4",
    "grid.defenses=['none', {name = 'batch_noise', clip = 1.0, sigma = 0.5, batch_size = 2}]",
]  # fmt: skip


def test_the_cells_share_the_federation_and_a_restart_reuses_finished_cells(tmp_path):
    cfg = load_config(GRID, TINY)
    store = ResultStore(tmp_path / "grid.sqlite")
    grid = run_grid(cfg, store=store)
    assert [c.label for c in grid.cells] == ["none", "batch_noise(batch_size=2, clip=1.0, sigma=0.5)"]
    none, dp = (c.outcome for c in grid.cells)
    # the same federation: the same clients sampled in the round, the same audited clients
    assert none.of_kind("round")[0]["clients"] == dp.of_kind("round")[0]["clients"]
    audited = [sorted(r["client_id"] for r in o.of_kind("attack")) for o in (none, dp)]
    assert audited[0] == audited[1] and len(audited[0]) == 2
    rows = grid.summary()
    assert [(r["defense"], r["attack"], r["updates"]) for r in rows] == [
        ("none", "ig", 2), ("batch_noise(batch_size=2, clip=1.0, sigma=0.5)", "ig", 2)
    ]  # fmt: skip
    assert rows[0]["cost"] == pytest.approx(1.0) and rows[1]["cost"] > 0
    for row, outcome in zip(rows, (none, dp), strict=True):  # privacy: mean and spread over the updates
        psnr = [r["psnr_mean"] for r in outcome.of_kind("attack")]
        assert row["psnr_mean"] == pytest.approx(sum(psnr) / 2)
        assert row["psnr_mean_sd"] == pytest.approx(abs(psnr[0] - psnr[1]) / 2**0.5)
        assert row["accuracy"] == outcome.of_kind("summary")[0]["final_accuracy"]
    # the noise changed what the server saw: DP's reconstructions differ from the undefended ones
    losses = [[r["matching_loss"] for r in o.of_kind("attack")] for o in (none, dp)]
    assert losses[0] != losses[1]
    again = run_grid(cfg, store=store)
    assert all(c.reused for c in again.cells) and len(store.runs()) == 2  # nothing ran again
    for first, second in zip(grid.cells, again.cells, strict=True):
        assert first.outcome.run_id == second.outcome.run_id
        assert _strip(first.outcome.records) == _strip(second.outcome.records)


def _strip(records):
    """Records without wall-clock times."""
    drop = ("seconds", "fl_seconds", "total_seconds", "attack_seconds")
    return [{k: v for k, v in r.items() if k not in drop} for r in records]


def test_a_cell_is_the_experiment_run_alone_with_that_defense(tmp_path):
    cfg = load_config(GRID, TINY)
    _, cell = cell_configs(cfg)[1]
    alone = dataclasses.replace(cell, experiment=dataclasses.replace(cell.experiment, name="alone"))
    grid = run_grid(cfg)
    by_itself = run_experiment(alone)
    assert _strip(grid.cells[1].outcome.records) == _strip(by_itself.records)


def test_the_command_prints_the_grid_and_writes_its_summary(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--quiet", "run", str(GRID), *TINY, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"\|\s+none \|\s+ig \|\s+2 \|", text) and "FL time / none" in text
    summary = json.loads((out / "grid" / "grid.json").read_text())
    assert [c["defense"] for c in summary["cells"]] == [
        "none",
        "batch_noise(batch_size=2, clip=1.0, sigma=0.5)",
    ]
    assert len(summary["summary"]) == 2 and summary["summary"][0]["cost"] == 1.0


def test_an_attack_listed_twice_is_told_apart_by_its_options_in_the_table(tmp_path, capsys):
    twice = "audit.attacks=[{name = 'ig', max_iterations = 2}, {name = 'ig', max_iterations = 3}]"
    assert main(["--quiet", "run", str(GRID), *TINY, twice, "grid.defenses=['none']", "--out",
                 str(tmp_path / "out")]) == 0  # fmt: skip
    text = capsys.readouterr().out
    for n in (2, 3):
        assert re.search(rf"\|\s+none \|\s+ig\(max_iterations={n}\) \|\s+2 \|", text), text


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["defenses=['pruning']"],
            r"grid.defenses gives each cell its defense; leave \[\[defenses\]\] empty",
        ),
        (["grid.defenses=['none', 'none']"], r"grid.defenses lists the same cell twice: \['none', 'none'\]"),
        (["grid.defenses=['nope']"], r"grid.defenses\[0\].name: unknown defense 'nope'"),
        (["grid.defenses=[{name = 'pruning', ratio = 2.0}]"], r"grid.defenses\[0\]"),
        (["grid.defenses=['aegis_llm']"], r"grid.defenses\[0\] works on text tasks"),
    ],
)
def test_a_bad_grid_is_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GRID, overrides)


def test_an_audited_client_whose_defense_fails_closed_is_counted_and_its_reason_kept(tmp_path, capsys):
    """A defense that withholds every audited client's update (Soteria pointed at a layer the model does
    not have) leaves nothing to attack: the row says how many were withheld and the records keep why,
    instead of a silent 0 updates."""
    bad = "grid.defenses=['none', {name = 'soteria', consumer = 'classifier.9'}]"
    cfg = load_config(GRID, [*TINY[:-1], bad])
    store = ResultStore(tmp_path / "grid.sqlite")
    rows = run_grid(cfg, store=store).summary()
    assert [(r["updates"], r["withheld"]) for r in rows] == [(2, 0), (0, 2)]
    failed = [r for run in store.runs() for r in store.records(run.run_id) if r["kind"] == "client_error"]
    assert len(failed) == 2 and all("classifier.9" in r["error"] and r["attack"] == "ig" for r in failed)
    assert main(["run", str(GRID), *TINY[:-1], bad, "--out", str(tmp_path / "o")]) == 0
    assert "0 (2 withheld)" in capsys.readouterr().out
    # under secure aggregation the server sees one sum of the contributors: the withheld are those missing
    secure = run_grid(load_config(GRID, [*TINY[:-1], bad, "fl.secure_aggregation=true"])).summary()
    assert [(r["updates"], r["withheld"]) for r in secure] == [(1, 0), (0, 2)]


def test_a_cell_whose_label_is_long_still_gets_a_valid_distinct_name():
    """A defense with many options gave a cell name past experiment.name's 200 characters, and the
    benchmark (aegis_generator_utility at smoke scale) stopped with a config error before any work: the
    name keeps its head and a digest of the whole label, short labels keep their former names."""
    from gradleak.experiments.grid import MAX_NAME, cell_name
    from gradleak.validation import safe_name

    assert cell_name("bench.cell", "pruning(ratio=0.9)") == "bench.cell.pruning-ratio=0.9"
    long_a = "aegis(" + ", ".join(f"option_{i}={{size: {i}, store: 'x'}}" for i in range(30)) + ")"
    long_b = long_a.replace("size: 7", "size: 8")
    a, b = (
        cell_name("aegis_generator_utility.organamnist-diffusion", long_a),
        cell_name("aegis_generator_utility.organamnist-diffusion", long_b),
    )
    assert len(a) <= MAX_NAME and len(b) <= MAX_NAME and a != b
    assert safe_name(a, "experiment.name") == a and a.startswith(
        "aegis_generator_utility.organamnist-diffusion.aegis"
    )
