"""Scripted measurements (gradleak.experiments.measurement): common options, the result record; and the bare
FedAvg loop of benchmarks/fl_overhead.py (loaded from its file) matching the engine."""

from __future__ import annotations

import copy
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

from gradleak.data.base import ImageDataset
from gradleak.experiments import measurement
from gradleak.federation import FederatedSimulation, FLConfig
from gradleak.models import build_model
from gradleak.types import LocalTraining

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCH / "results"


def _script(name: str):  # a benchmark script as a module, loaded from its file (benchmarks/ is no package)
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_parse_args_defaults_and_seeds() -> None:
    p = measurement.make_parser("x", RESULTS)
    a = measurement.parse_args(p, [])
    assert (a.scale, a.seeds, a.out, a.threads) == ("smoke", [0], RESULTS, None)
    a = measurement.parse_args(p, ["--scale", "small", "--seed", "3", "--seed", "1", "--seeds", "3", "7"])
    assert a.scale == "small" and a.seeds == [3, 1, 7]
    with pytest.raises(SystemExit):
        measurement.parse_args(p, ["--scale", "huge"])


def test_write_result_records_provenance(tmp_path: Path) -> None:
    path = measurement.write_result("demo", "smoke", {"ratio": 1.0}, seeds=[1, 2], out=tmp_path)
    assert path == tmp_path / "demo_smoke.json"
    assert [p.name for p in tmp_path.iterdir()] == ["demo_smoke.json"]  # no temp file left behind
    rec = json.loads(path.read_text())
    assert rec["benchmark"] == "demo" and rec["scale"] == "smoke" and rec["seeds"] == [1, 2]
    assert rec["result"] == {"ratio": 1.0}
    assert set(rec["git"]) == {"commit", "dirty"}
    assert {"platform", "cpu_count", "torch", "torch_threads"} <= set(rec["machine"])
    assert rec["command"] and rec["timestamp"]
    with pytest.raises(ValueError):
        measurement.write_result("demo", "huge", {}, seeds=[0], out=tmp_path)
    with pytest.raises(ValueError):  # NaN is not JSON
        measurement.write_result("demo", "smoke", {"x": float("nan")}, seeds=[0], out=tmp_path)
    assert json.loads(path.read_text())["result"] == {"ratio": 1.0}  # a failed write leaves the old file


def test_summarize() -> None:
    s = measurement.summarize([3.0, 1.0, 2.0, 4.0])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0 and s["n"] == 4


def test_bare_round_matches_engine() -> None:
    fl_overhead = _script("fl_overhead")
    g = torch.Generator().manual_seed(0)
    clients = [
        ImageDataset("syn", torch.rand(n, 1, 12, 12, generator=g), torch.randint(0, 3, (n,), generator=g), 3)
        for n in (20, 33, 9, 15)
    ]
    training = LocalTraining(epochs=2, batch_size=8, lr=1e-3, optimizer="adam")
    model = build_model("aegis_cnn", (1, 12, 12), 3, seed=0, width=4, hidden=16)
    bare = copy.deepcopy(model)
    work = copy.deepcopy(model)
    sim = FederatedSimulation(model, clients, FLConfig(fraction=0.5, training=training), seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention on a busy machine
    try:
        for r in range(2):
            ids = sim.run_round(r).client_ids
            fl_overhead.bare_round(bare, work, clients, ids, seed=5, round_idx=r, training=training)
    finally:
        torch.set_num_threads(threads)
    assert fl_overhead.max_abs_diff(sim.model, bare) <= 1e-6


def test_the_utility_blocks_are_paired_round_means_and_the_bound_counts_the_cache_per_client():
    blocks = _script("aegis_utility_blocks")
    rounds = 60
    none = {
        "accuracy_by_round": [0.5] * rounds,
        "seconds_by_round": [2.0] * rounds,
        "clients_by_round": [[0, 1]] * rounds,
        "withheld_by_round": [0] * rounds,
        "final_accuracy": 0.5,
    }
    aegis = {**none, "accuracy_by_round": [0.5 - 0.001 * r for r in range(rounds)],  # r is the 0-based round
             "seconds_by_round": [2.0 * (11.0 if r < 4 else 5.0) for r in range(rounds)],
             "withheld_by_round": [1 if r == 30 else 0 for r in range(rounds)],
             "final_accuracy": 0.44}  # fmt: skip
    aegis["accuracy_by_round"][40] = None  # round 41 not evaluated: left out of its block
    out = blocks.analyse(none, aegis, {0: 100, 1: 300}, cache=400, start=5)
    # rounds 25-36 are indices 24..35: mean gap -0.1 x (24 + 35) / 2 points
    assert out["gap_points_by_block"]["25-36"] == pytest.approx(-0.1 * 29.5)
    assert out["gap_points_by_block"]["37-48"] == pytest.approx(
        -0.1 * statistics.fmean([*range(36, 40), *range(41, 48)])
    )
    assert out["gap_points_by_block"]["25-60"] == pytest.approx(
        -0.1 * statistics.fmean([*range(24, 40), *range(41, 60)])
    )
    # bound (100 + 300 + 2 x 400) / 400 = 3; rounds 1-4 (cache builds) are not timed
    assert out["compute_bound_median"] == pytest.approx(3.0) and out[
        "round_time_ratio_median"
    ] == pytest.approx(5.0)
    assert out["ratio_over_bound_median"] == pytest.approx(5 / 3) and out["rounds_timed"] == 56
    assert out["withheld"] == {"none": 0, "aegis": 1} and out["timed_together"] is True
    # rows of two result files (merged_rows' "result"): no time ratio
    apart = blocks.analyse(
        {**none, "result": 0}, {**aegis, "result": 1}, {0: 100, 1: 300}, cache=400, start=5
    )
    assert apart["round_time_ratio_median"] is None and apart["ratio_over_bound_median"] is None
    assert (
        apart["compute_bound_median"] == pytest.approx(3.0)
        and apart["seconds_median"] == out["seconds_median"]
    )
    assert apart["gap_points_by_block"] == out["gap_points_by_block"]
    short = {k: v[:5] if isinstance(v, list) else v for k, v in aegis.items()}  # a 5-round run: no block
    short_none = {k: v[:5] if isinstance(v, list) else v for k, v in none.items()}
    assert blocks.analyse(short_none, short, {0: 100, 1: 300}, cache=400, start=2)["gap_points_by_block"] == {
        "25-36": None,
        "37-48": None,
        "49-60": None,
        "25-60": None,
    }
    assert blocks.mean_of([None, 1.0, 3.0]) == 2.0 and blocks.mean_of([None]) is None
    with pytest.raises(ValueError, match="not a paired run"):
        blocks.analyse(none, {**aegis, "clients_by_round": [[0, 2]] * rounds}, {0: 1, 1: 1, 2: 1}, 400, 5)


def test_the_utility_blocks_merge_one_result_per_row_and_refuse_a_row_twice_or_mixed_scales():
    blocks = _script("aegis_utility_blocks")
    seed0 = {"scale": "paper", "rows": [{"seed": 0, "defense": "none"}, {"seed": 0, "defense": "aegis"}]}
    seed1 = {"scale": "paper", "rows": [{"seed": 1, "defense": "none"}, {"seed": 1, "defense": "aegis"}]}
    rows = blocks.merged_rows([seed0, seed1])
    assert [(r["seed"], r["defense"], r["result"]) for r in rows] == [
        (0, "none", 0), (0, "aegis", 0), (1, "none", 1), (1, "aegis", 1)]  # fmt: skip
    with pytest.raises(SystemExit, match=r"rows \[\(0, 'aegis', 'aegis'\), \(0, 'none', 'none'\)\]"):
        blocks.merged_rows([seed0, seed1, seed0])
    # an Aegis arm run apart (another cell) merges beside its seed's no-defense row
    apart = {"scale": "paper", "rows": [{"seed": 0, "defense": "aegis", "cell": "longer"}]}
    assert len(blocks.merged_rows([seed0, apart])) == 3
    with pytest.raises(SystemExit, match="different scales"):
        blocks.merged_rows([seed0, {**seed1, "scale": "small"}])


def test_the_utility_blocks_pair_every_aegis_arm_with_its_seeds_one_no_defense_row():
    blocks = _script("aegis_utility_blocks")
    rows = [{"seed": 0, "defense": "none", "cell": "a"}, {"seed": 0, "defense": "aegis", "cell": "a"},
            {"seed": 0, "defense": "aegis", "cell": "b"}, {"seed": 1, "defense": "none", "cell": "a"},
            {"seed": 1, "defense": "aegis", "cell": "b"}]  # fmt: skip
    arms = blocks.paired(rows)
    assert sorted(arms) == ["a", "b"] and sorted(arms["a"]) == [0] and sorted(arms["b"]) == [0, 1]
    assert arms["b"][0] == (rows[0], rows[2]) and arms["b"][1] == (rows[3], rows[4])
    with pytest.raises(SystemExit, match="seed 0 has 2 no-defense rows"):
        blocks.paired([*rows, {"seed": 0, "defense": "none", "cell": "b"}])
    with pytest.raises(SystemExit, match="seed 1 has 0 no-defense rows"):
        blocks.paired([r for r in rows if r is not rows[3]])
    with pytest.raises(SystemExit, match="two Aegis rows in cell 'a'"):
        blocks.paired([*rows, {"seed": 0, "defense": "aegis2", "cell": "a"}])


def test_timed_separates_wall_from_cpu_seconds() -> None:
    # sleeping costs wall time and (almost) no CPU time: a swapped pair or one clock for both fails here
    def nap() -> str:
        time.sleep(0.3)
        return "done"

    out, wall, cpu = measurement.timed(nap)
    assert out == "done"
    assert 0.3 <= wall < 5.0
    assert 0.0 <= cpu < 0.1


def test_the_sampling_cost_variants_change_only_how_the_shortest_column_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gradleak.defenses.aegis.defense import AegisConfig
    from gradleak.defenses.aegis.generators.diffusion import stored_name
    from gradleak.options import build_dataclass

    monkeypatch.syspath_prepend(str(BENCH))  # it imports generator_steps beside it
    cost = _script("generator_sampling_cost")
    columns = [
        build_dataclass(AegisConfig, opts, where="t")
        for opts in (
            {},
            *({"generator": "diffusion", "diffusion": {"training": {"steps": n}}} for n in (1500, 600)),
        )
    ]
    column = cost.shortest_column(columns)
    assert column.diffusion.training.steps == 600
    both = cost.variant(column, {"guidance": 1.0, "steps": 6})
    s, base = both.diffusion.sampling, column.diffusion.sampling
    assert (s.guidance, s.steps, s.sampler, s.spacing) == (1.0, 6, base.sampler, base.spacing)
    assert (base.guidance, base.steps) == (1.5, 10)  # the column itself is untouched
    # the same trained generator (file name) for every variant: only the sampling differs
    assert stored_name(b"data", both.diffusion) == stored_name(b"data", column.diffusion)
    assert cost.variant(column, {}) == column
    with pytest.raises(ValueError, match="guidance"):
        cost.variant(column, {"guidance": 0.5})
    with pytest.raises(SystemExit, match="no diffusion column"):
        cost.shortest_column(columns[:1])


def test_public_generators_finds_each_distinct_public_diffusion_arm_and_refuses_a_config_without_one() -> (
    None
):
    public = _script("public_generators")
    configs = BENCH / "configs"
    (smoke,) = public.public_arms(configs / "aegis_generator_utility_6000.toml", "smoke", 0)
    assert (smoke.train_on, smoke.training.steps, smoke.pool) == ("public", 50, 128)  # the smoke overrides
    (paper,) = public.public_arms(configs / "aegis_generator_utility_6000.toml", "paper", 0)
    assert (paper.training.steps, paper.pool, paper.public.dataset) == (6000, 2048, "organamnist")
    # the other config's arm (1,500 steps) is another generator
    (other,) = public.public_arms(configs / "aegis_generator_utility.toml", "paper", 0)
    assert other.training.steps == 1500 and other != paper
    with pytest.raises(SystemExit, match="no Aegis arm with a public diffusion generator"):
        public.public_arms(configs / "aegis_generators_pathmnist.toml", "small", 0)  # own-share generators


def test_lamp_official_names_a_narrower_run_apart_and_scales_the_equal_time_budget() -> None:
    lo = _script("lamp_official")
    default = lo.result_name(1, lo.METHODS, None, lo.DEFAULT_ARMS)
    assert (
        default == "lamp_official"
        and lo.result_name(2, lo.METHODS, None, lo.DEFAULT_ARMS) == "lamp_official_b2"
    )
    narrower = [
        lo.result_name(1, ("tag",), None, lo.DEFAULT_ARMS),
        lo.result_name(1, lo.METHODS, 10, lo.DEFAULT_ARMS),
        lo.result_name(1, lo.METHODS, None, ("official", "ours_pinned")),
        lo.result_name(1, lo.METHODS, None, ("official", "ours_pinned", "ours_pinned_equal_time")),
        lo.result_name(1, lo.METHODS, None, lo.ARMS),
        lo.result_name(1, lo.METHODS, None, lo.DEFAULT_ARMS, attack_seed=1),
    ]
    assert len(set(narrower)) == len(narrower) and default not in narrower  # none overwrites another
    assert lo.equal_time_steps(500, 180.0, 100.0) == 900  # 500 x 180 / 100: the official call's time
    assert lo.equal_time_steps(500, 1.0, 1e6) == 1  # never below one step


@pytest.mark.parametrize(
    "argv",
    [
        ["--arms", "ours_pinned,ours_pinned_equal_time"],  # the equal-time arm without the official one
        ["--arms", "official,official"],
        ["--methods", "tag,dlg"],
        ["--count", "0"],
    ],
)
def test_lamp_official_refuses_bad_arms_methods_and_counts_before_work(
    argv: list[str], tmp_path: Path
) -> None:
    lo = _script("lamp_official")
    with pytest.raises(SystemExit) as err:
        lo.main(["--lamp", str(tmp_path), *argv])  # tmp_path holds no checkout: parsing must fail first
    assert err.value.code == 2  # argparse's usage error, not the missing checkout's message
