"""Benchmarks as configs of the engine (issue 18, item 4): a benchmark TOML's cells run through the runner,
the result JSON carries what reproducing needs and each row is the mean of the stored records; the
committed benchmark configs are valid at every scale they name."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from gradleak.cli import main
from gradleak.experiments import ResultStore
from gradleak.experiments.benchmark import load_benchmark
from gradleak.experiments.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "benchmarks" / "configs").glob("*.toml"))

TINY = """
[benchmark]
name = "tiny"
claim = "two cells of a text audit"
seeds = [0]
paper = { dager_rouge1_min = 0.98 }
previous = "old_{scale}.json"
aliases = { "pruning(ratio=0.9)" = "prune_90" }

[[benchmark.cells]]
name = "a"
match = { model = "gpt2_tiny" }

[[benchmark.cells]]
name = "b"
overrides = ["audit.training.batch_size=3"]

[benchmark.scales.smoke]
overrides = ["audit.clients=2"]

[experiment]
name = "tiny"
[data]
dataset = "wikitext2"
train_split = "valid"
test_split = "test"
train_limit = 60
test_limit = 8
num_clients = 4
partition = "iid"
options = { max_tokens = 8 }
[model]
name = "gpt2_tiny"
task = "causal_lm"
[fl]
rounds = 0
fraction = 0.5
[audit]
clients = 1
training = { protocol = "fedsgd", batch_size = 2 }
[[audit.attacks]]
name = "dager"
vocab = "embedding"
[grid]
defenses = ["none", { name = "pruning", ratio = 0.9 }]
"""


def test_a_benchmark_runs_its_cells_through_the_engine_and_compares_with_the_committed_result(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    out = tmp_path / "results"
    out.mkdir()
    old = {"result": {"summary": [
        {"model": "gpt2_tiny", "attack": "dager", "setting": "none", "rouge1": 0.9, "n": 5},
        {"model": "gpt2_tiny", "attack": "dager", "setting": "prune_90", "rouge1": 0.25, "n": 5},
    ]}}  # fmt: skip
    (out / "old_smoke.json").write_text(json.dumps(old))
    store = tmp_path / "s.sqlite"
    assert (
        main(["--quiet", "bench", str(config), "--scale", "smoke", "--out", str(out), "--store", str(store)])
        == 0
    )
    data = json.loads((out / "tiny_smoke.json").read_text())
    assert data["benchmark"] == "tiny" and data["scale"] == "smoke" and data["seeds"] == [0]
    assert (
        data["git"]["commit"]
        and data["machine"]["torch"]
        and data["command"] == f"gradleak bench {config} --scale smoke"
    )
    assert data["paper"] == {"dager_rouge1_min": 0.98}
    rows = data["rows"]
    assert [(r["cell"], r["defense"]) for r in rows] == [
        ("a", "none"), ("a", "pruning(ratio=0.9)"), ("b", "none"), ("b", "pruning(ratio=0.9)")
    ]  # fmt: skip
    runs = {r.run_id: r for r in ResultStore(store).runs()}
    for row in rows:  # each row is the mean and spread of its run's stored attack records
        records = ResultStore(store).records(row["run_id"], "attack")
        assert row["updates"] == len(records) == 2  # the scale's audit.clients
        r1 = [r["rouge1"] for r in records]
        assert row["rouge1"] == pytest.approx(statistics.fmean(r1))
        assert row["rouge1_sd"] == pytest.approx(statistics.stdev(r1))
        assert {r["batch_size"] for r in records} == {2 if row["cell"] == "a" else 3}  # the cell's override
        assert runs[row["run_id"]].config["experiment"]["seed"] == 0
    # cell a re-derives the committed rows it matches (aliases name the defense); b matches nothing
    prev = data["previous"]
    assert [(p["cell"], p["defense"]) for p in prev] == [("a", "none"), ("a", "pruning(ratio=0.9)")]
    for p, row, want in zip(prev, rows[:2], (0.9, 0.25), strict=True):
        assert p["file"] == "old_smoke.json" and p["rouge1"]["previous"] == want
        assert p["rouge1"]["ours"] == row["rouge1"] and p["rouge1"]["delta"] == pytest.approx(
            row["rouge1"] - want
        )
    # run again: every cell is found finished in the store and reused, the rows are the same
    assert (
        main(["--quiet", "bench", str(config), "--scale", "smoke", "--out", str(out), "--store", str(store)])
        == 0
    )
    again = json.loads((out / "tiny_smoke.json").read_text())["rows"]
    assert [r["run_id"] for r in again] == [r["run_id"] for r in rows]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_the_committed_benchmark_configs_are_valid_at_every_scale(path):
    bench = load_benchmark(path)
    assert bench.claim and bench.cells
    for scale in bench.scales:
        plan = bench.configs(scale)
        assert plan, scale
        assert len({(c.name, s) for c, s, _ in plan}) == len(plan)


@pytest.mark.parametrize(("text", "message"), [
    ("[experiment]\nname = 'x'\n", "needs a \\[benchmark\\] table"),
    ("[benchmark]\nname = 'x'\nbogus = 1\n", "unknown key\\(s\\) \\['bogus'\\]"),
    ("[benchmark]\nname = 'x'\n[benchmark.scales.huge]\n", "the scales are"),
    ("[benchmark]\nname = 'x'\n" + "[[benchmark.cells]]\nname = 'a'\n" * 2, "repeat a name"),
    ("[benchmark]\nname = 'x'\nseeds = []\n", "non-empty list of ints"),
    ("[benchmark]\nname = 'x/y'\n", "letters, digits and underscores"),
])  # fmt: skip
def test_bad_benchmark_files_are_refused_by_name(tmp_path, text, message):
    path = tmp_path / "b.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_benchmark(path)


def test_a_bad_cell_is_refused_before_any_work(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text(
        TINY.replace('overrides = ["audit.training.batch_size=3"]', "overrides = [\"model.name='nope'\"]")
    )
    with pytest.raises(ConfigError, match="cell 'b' \\(smoke\\).*unknown model 'nope'"):
        load_benchmark(path).configs("smoke")
    with pytest.raises(ConfigError, match="no scale 'paper'"):
        load_benchmark(path).configs("paper")
