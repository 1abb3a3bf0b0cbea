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
    # --compare runs nothing and writes the same comparison again (e.g. after a run with another --out)
    result = out / "tiny_smoke.json"
    result.write_text(json.dumps({k: v for k, v in data.items() if k != "previous"}))
    assert main(["--quiet", "bench", str(config), "--compare", str(result), "--previous", str(out)]) == 0
    assert json.loads(result.read_text())["previous"] == prev
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


SHARED = """
[experiment]
name = "shared"
seed = 3
[data]
dataset = "cifar10"
num_clients = 10
[audit]
clients = 2
max_samples = 50
[[audit.attacks]]
name = "ig"
"""

USES_BASE = """
[benchmark]
name = "sweep"
claim = "a sweep on a shared setting"
base = "base/shared.toml"
stats = ["matching_loss_honest"]

[[benchmark.axes.steps]]
name = "short"
at = { smoke = ["audit.training.epochs=2"], paper = ["audit.training.epochs=20"] }

[[benchmark.axes.steps]]
name = "long"
overrides = ["audit.max_samples=8"]
at = { smoke = ["audit.training.epochs=5"] }

[benchmark.scales.smoke]
overrides = ["audit.max_samples=4"]

[benchmark.scales.paper]

[experiment]
name = "sweep"
[data]
num_clients = 20
"""


def test_a_benchmark_on_a_shared_base_config_with_per_scale_cell_overrides(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "shared.toml").write_text(SHARED)
    path = tmp_path / "sweep.toml"
    path.write_text(USES_BASE)
    bench = load_benchmark(path)
    assert bench.stats == ("matching_loss_honest",)
    smoke = {c.name: cfg for c, _, cfg in bench.configs("smoke")}
    # the base's tables under the file's own: data.dataset from the base, num_clients from the file
    assert all(c.data.dataset == "cifar10" and c.data.num_clients == 20 for c in smoke.values())
    assert [a.name for a in smoke["short"].audit.attacks] == ["ig"]
    # overrides in order: scale, cell, the cell's at this scale (the more specific wins)
    assert (smoke["short"].audit.max_samples, smoke["short"].audit.training.epochs) == (4, 2)
    assert (smoke["long"].audit.max_samples, smoke["long"].audit.training.epochs) == (8, 5)
    paper = {c.name: cfg for c, _, cfg in bench.configs("paper")}
    assert paper["short"].audit.training.epochs == 20 and paper["long"].audit.training.epochs == 1
    assert paper["short"].audit.max_samples == 50  # the base's
    path.write_text(USES_BASE.replace("at = { smoke", "at = { huge"))
    with pytest.raises(ConfigError, match="at maps scales"):
        load_benchmark(path)
    path.write_text(USES_BASE.replace('base = "base/shared.toml"', 'base = "base/none.toml"'))
    with pytest.raises(ConfigError, match="benchmark.base .*none.toml' does not exist"):
        load_benchmark(path)


EXTENDS = """
[benchmark]
name = "sweep_other"
extends = "sweep.toml"
seeds = [1, 2]

[benchmark.scales.smoke]
overrides = ["audit.max_samples=6"]

[data]
num_clients = 30
"""


def test_a_benchmark_that_extends_another_takes_its_tables_but_not_its_name(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "shared.toml").write_text(SHARED)
    (tmp_path / "sweep.toml").write_text(
        USES_BASE.replace("stats =", 'previous = "sweep_{scale}.json"\nstats =')
    )
    path = tmp_path / "sweep_other.toml"
    path.write_text(EXTENDS)
    parent, bench = load_benchmark(tmp_path / "sweep.toml"), load_benchmark(path)
    assert (bench.name, bench.previous, bench.seeds) == ("sweep_other", None, (1, 2))  # its own identity
    assert bench.claim == parent.claim and bench.stats == parent.stats and bench.cells == parent.cells
    smoke = {c.name: cfg for c, _, cfg in bench.configs("smoke")}
    # the parent's base, its own tables, then this file's: the scale's overrides replaced, the cell's kept
    assert all(c.data.dataset == "cifar10" and c.data.num_clients == 30 for c in smoke.values())
    assert (smoke["short"].audit.max_samples, smoke["short"].audit.training.epochs) == (6, 2)
    assert (smoke["long"].audit.max_samples, smoke["long"].audit.training.epochs) == (8, 5)
    assert smoke["short"].experiment.name == "sweep_other.short"
    # the parent's paper scale, untouched
    paper = {c.name: cfg for c, _, cfg in bench.configs("paper")}
    assert paper["short"].audit.training.epochs == 20 and paper["short"].data.num_clients == 30
    # own cells replace the parent's axes (a file takes cells or axes, not both)
    path.write_text(EXTENDS + '\n[[benchmark.cells]]\nname = "one"\noverrides = ["audit.max_samples=3"]\n')
    assert [(c.name, s) for c, s, _ in load_benchmark(path).configs("smoke")] == [("one", 1), ("one", 2)]
    # ... and the parent's scales' choices of its own cells with them
    (tmp_path / "sweep.toml").write_text(USES_BASE + '[benchmark.scales.small]\ncells = ["short"]\n')
    assert [c.name for c, _, _ in load_benchmark(path).configs("small")] == ["one", "one"]
    assert [c.name for c, _, _ in load_benchmark(tmp_path / "sweep.toml").configs("small")] == ["short"]
    (tmp_path / "sweep.toml").write_text(
        USES_BASE.replace('name = "sweep"\n', 'name = "sweep"\nextends = "sweep_other.toml"\n', 1)
    )
    with pytest.raises(ConfigError, match="benchmark.extends loops"):
        load_benchmark(path)
    path.write_text(EXTENDS.replace('"sweep.toml"', "3"))
    with pytest.raises(ConfigError, match="benchmark.extends must be a file name"):
        load_benchmark(path)


def test_a_row_is_compared_with_the_mean_of_every_committed_row_it_matches():
    """Matching committed rows (e.g. a former script's seeds) are averaged; attack options must agree on
    the keys both name, so two rows of one attack at two budgets meet their own committed rows."""
    from gradleak.experiments.benchmark import Cell, compare

    committed = {"runs": [
        {"dataset": "femnist", "attack": "nlsme", "seed": s, "options": {"max_iterations": b}, "psnr_mean": v,
         "lsim": 0.1 * s}
        for s, (b, v) in enumerate([(100, 6.0), (100, 8.0), (500, 7.0), (100, 10.0)])
    ] + [{"dataset": "cifar10", "attack": "nlsme", "psnr_mean": 99.0}]}  # fmt: skip
    rows = [
        {"cell": "c", "seed": 0, "defense": "none", "attack": "nlsme", "updates": 3,
         "options": {"max_iterations": 100, "nodes": 3}, "psnr_mean": 9.0, "matching_loss_honest": 0.2},
        {"cell": "c", "seed": 0, "defense": "none", "attack": "nlsme", "updates": 3,
         "options": {"max_iterations": 500}, "psnr_mean": 5.0, "matching_loss_honest": 0.3},
    ]  # fmt: skip
    cell = Cell("c", match={"dataset": "femnist"})
    out = compare(rows, cell, committed, keys={"matching_loss_honest": "lsim"})
    assert [o["previous_rows"] for o in out] == [3, 1]
    assert out[0]["psnr_mean"] == {"ours": 9.0, "previous": pytest.approx(8.0), "delta": pytest.approx(1.0)}
    assert out[0]["matching_loss_honest"]["previous"] == pytest.approx((0.0 + 0.1 + 0.3) / 3)
    assert out[1]["psnr_mean"]["previous"] == 7.0 and out[1]["psnr_mean"]["delta"] == -2.0


def test_a_row_averages_the_benchmarks_attack_stats_over_its_updates(tmp_path):
    from gradleak.experiments.benchmark import Cell, _mean_rows
    from gradleak.experiments.config import load_config
    from gradleak.experiments.runner import RunOutcome

    cfg = load_config({"audit": {"attacks": [{"name": "ig", "max_iterations": 7}, {"name": "dlg"}]}})
    records = [{"kind": "summary", "final_accuracy": 0.5, "fl_seconds": 2.0}] + [
        {"kind": "attack", "cell": i, "psnr_mean": 10.0 + k + i, "matching_loss_honest": 0.1 * k}
        for i in (0, 1) for k in range(3)
    ]  # fmt: skip
    outcome = RunOutcome("r", cfg, records, [], None, False)
    rows = _mean_rows(Cell("c"), 0, outcome, "none", ("matching_loss_honest",))
    assert [(r["attack"], r["options"], r["updates"]) for r in rows] == [
        ("ig", {"max_iterations": 7}, 3), ("dlg", {}, 3)
    ]  # fmt: skip
    assert rows[0]["psnr_mean"] == pytest.approx(11.0) and rows[1]["psnr_mean"] == pytest.approx(12.0)
    assert rows[0]["matching_loss_honest"] == pytest.approx(0.1)
    assert rows[0]["matching_loss_honest_sd"] == pytest.approx(0.1)
    assert rows[0]["final_accuracy"] == 0.5


BASES = sorted((ROOT / "benchmarks" / "configs" / "base").glob("*.toml"))


@pytest.mark.parametrize("path", BASES, ids=[p.stem for p in BASES])
def test_the_shared_base_configs_are_experiments_of_their_own(path, monkeypatch):
    from gradleak.experiments.config import load_config
    from gradleak.registry import MODELS

    MODELS.names()  # built-ins loaded first, so the copy restored afterwards holds them
    monkeypatch.setattr(MODELS, "_entries", dict(MODELS._entries))  # a base's plugin model: this test only
    cfg = load_config(path, trust_plugins=True)  # a committed base's plugin is the project's own code
    audits = cfg.audit.clients > 0 and bool(cfg.audit.attacks)
    compares_defenses = len(cfg.grid.defenses) > 1  # a utility base: defenses trained side by side
    assert audits or compares_defenses


def test_a_utility_benchmark_row_has_no_attack_and_the_mean_accuracy_of_its_last_rounds():
    from gradleak.experiments.benchmark import Cell, _mean_rows
    from gradleak.experiments.config import load_config
    from gradleak.experiments.runner import RunOutcome

    cfg = load_config({"audit": {"clients": 0}, "fl": {"rounds": 5}})
    accs = [0.1, 0.5, None, 0.3, 0.4]  # round 2 not evaluated; round 3 lost client 7 (failed closed)
    records = [
        {"kind": "round", "round": r, "accuracy": a, "seconds": 2.0 + r, "clients": [r, 7],
         "errors": {"7": "aegis: pool exhausted"} if r == 3 else {}}
        for r, a in reversed(list(enumerate(accs)))  # the store's order is not the rounds'
    ]  # fmt: skip
    records.append({"kind": "summary", "final_accuracy": 0.4, "fl_seconds": 8.0})
    (row,) = _mean_rows(Cell("u"), 0, RunOutcome("r", cfg, records, [], None, False), "aegis", tail=3)
    assert row["attack"] is None and row["updates"] == 0 and row["defense"] == "aegis"
    assert row["accuracy_last_3"] == pytest.approx((0.5 + 0.3 + 0.4) / 3)  # the last 3 evaluated rounds
    assert row["accuracy_by_round"] == accs and row["seconds_by_round"] == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert row["clients_by_round"] == [[r, 7] for r in range(5)]
    assert row["withheld_by_round"] == [0, 0, 0, 1, 0]
    assert row["final_accuracy"] == 0.4 and row["fl_seconds"] == 8.0


def test_texts_put_each_attacked_update_s_sentences_beside_their_matches_in_the_row(tmp_path):
    from gradleak.experiments.benchmark import Cell, _mean_rows
    from gradleak.experiments.config import load_config
    from gradleak.experiments.runner import RunOutcome

    cfg = load_config({"audit": {"clients": 2, "attacks": [{"name": "ig"}]}})  # the attack is not run
    attack = {"kind": "attack", "cell": 0}
    records = [
        {**attack, "client_id": 4, "rouge1": 1.0, "true_texts": ["a b"], "matched_texts": ["a b"]},
        {**attack, "client_id": 9, "rouge1": 0.5, "true_texts": ["c d"], "matched_texts": [""], "texts": []},
        {**attack, "client_id": 7, "refused": True},  # refused: no texts
        {"kind": "summary"},
    ]  # fmt: skip
    outcome = RunOutcome("r", cfg, records, [], None, False)
    (row,) = _mean_rows(Cell("t"), 0, outcome, "none", texts=True)
    assert row["texts"] == [{"client": 4, "true": ["a b"], "matched": ["a b"]},
                            {"client": 9, "true": ["c d"], "matched": [""]}]  # fmt: skip
    assert row["rouge1"] == pytest.approx(0.75)
    (plain,) = _mean_rows(Cell("t"), 0, outcome, "none")
    assert "texts" not in plain
    bad = tmp_path / "b.toml"
    bad.write_text('[benchmark]\nname = "b"\ntexts = "yes"\n')
    with pytest.raises(ConfigError, match="benchmark.texts must be true or false"):
        load_benchmark(bad)


def test_a_scale_runs_named_cells_with_extra_overrides_last():
    bench = load_benchmark(Path(__file__).resolve().parents[2] / "benchmarks/configs/image_map.toml")
    (cell, seed, cfg), = bench.configs("paper", cells=["wrn_train-b8-fedavg1"],
                                       extra=["experiment.device='cuda'", "audit.clients=1"])  # fmt: skip
    assert cell.name == "wrn_train-b8-fedavg1" and seed == 0
    assert cfg.experiment.device == "cuda" and cfg.audit.clients == 1  # after the scale's clients = 4
    assert cfg.model.name == "wide_resnet" and cfg.model.mode == "train" and cfg.audit.max_samples == 8
    with pytest.raises(ConfigError, match=r"--cells names \['lenet-b1-fedsgd'\], not cells of scale 'paper'"):
        bench.configs("paper", cells=["lenet-b1-fedsgd"])


def test_a_benchmark_s_own_seed_and_name_cannot_be_set_from_outside():
    bench = load_benchmark(Path(__file__).resolve().parents[2] / "benchmarks/configs/image_map.toml")
    with pytest.raises(ConfigError, match="--set 'experiment.seed=3': a benchmark sets each cell's seed"):
        bench.configs("smoke", extra=["experiment.seed=3"])
