"""Issue 22's utility and round-time targets, read off a committed utility benchmark result.

A utility benchmark (e.g. ``configs/aegis_generator_utility.toml``) trains no defense and Aegis on the same
federation (same sampled clients, same initial model) and records, round by round, the test accuracy, the
wall time, the sampled clients and the clients that withheld their update. From those rows this script
reports, for each Aegis arm (one per benchmark cell, each against its seed's no-defense row), per seed and
over the seeds:

- the accuracy gap Aegis - none (points) in blocks of rounds (default 25-36, 37-48, 49-60) and over rounds
  25-60 (issue 22's target: within 1 point);
- the round-time ratio Aegis / none against the compute bound of each round, ``sum_i (n_i + M) / sum_i n_i``
  over the round's clients (each Aegis epoch adds one pass over the M cache images to the client's n real
  ones), as the median over the rounds from ``--from-round`` (earlier rounds carry most cache builds); issue
  22's target: at most 1.1 x the bound. Only a pair timed in one run is a measurement: for an Aegis arm
  whose no-defense twin comes from another result file (another run, maybe another machine) the ratios are
  left empty (``timed_together`` false), the medians of the seconds kept.

    python benchmarks/aegis_utility_blocks.py [--result results/aegis_generator_utility_paper.json ...]
        [--setting configs/base/paper000_setting.toml] [--cache 2048] [--from-round 5]

``--result`` takes one file or several (e.g. one per seed, run in different sessions with ``--seeds``, or
``aegis_generator_utility_6000_paper.json``, an Aegis arm whose no-defense twin is in the first file); a
row (seed, cell, defense) found in two files, or files of different scales, are refused. It writes
``results/aegis_utility_blocks_<scale>.json`` (the scale of the results it reads).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from gradleak.experiments.config import load_config
from gradleak.experiments.measurement import make_parser, parse_args, write_result
from gradleak.experiments.runner import build_simulation

HERE = Path(__file__).resolve().parent
NAME = "aegis_utility_blocks"
BLOCKS = ((25, 36), (37, 48), (49, 60))


def block_mean(values: list[float | None], first: int, last: int) -> float | None:
    """Mean of the evaluated rounds ``first..last`` (1-based, inclusive) of a round-indexed list."""
    return mean_of(values[first - 1 : last])


def mean_of(values: list[float | None]) -> float | None:
    """The mean of the values that exist (a run shorter than a block has none for it)."""
    got = [v for v in values if v is not None]
    return statistics.fmean(got) if got else None


def sizes_of(setting: Path, seed: int) -> dict[int, int]:
    """Each client's number of training images in the federation of ``setting`` at ``seed``."""
    sim = build_simulation(load_config(setting, [f"experiment.seed={seed}"]))
    return {cid: len(data) for cid, data in enumerate(sim.clients)}


def analyse(
    none: dict[str, Any], aegis: dict[str, Any], sizes: dict[int, int], cache: int, start: int
) -> dict[str, Any]:
    """The paired rows' accuracy gaps by block and round-time ratio against the compute bound (None for
    rows of two result files, ``result`` of :func:`merged_rows`: seconds from two runs are no ratio)."""
    if none["clients_by_round"] != aegis["clients_by_round"]:
        raise ValueError("the two rows did not train the same sampled clients: not a paired run")
    timed_together = none.get("result") == aegis.get("result")
    gap = [None if a is None or b is None else 100 * (a - b)
           for a, b in zip(aegis["accuracy_by_round"], none["accuracy_by_round"], strict=True)]  # fmt: skip
    blocks = {f"{a}-{b}": block_mean(gap, a, b) for a, b in BLOCKS}
    blocks["25-60"] = block_mean(gap, 25, 60)
    ratios, bounds = [], []
    for r, clients in enumerate(aegis["clients_by_round"]):
        if r + 1 < start:
            continue
        n = sum(sizes[c] for c in clients)
        bounds.append((n + cache * len(clients)) / n)
        ratios.append(aegis["seconds_by_round"][r] / none["seconds_by_round"][r])
    return {
        "gap_points_by_block": blocks,
        "final_accuracy": {"none": none["final_accuracy"], "aegis": aegis["final_accuracy"]},
        "withheld": {"none": sum(none.get("withheld_by_round", [])),
                     "aegis": sum(aegis.get("withheld_by_round", []))},
        "timed_together": timed_together,
        "round_time_ratio_median": statistics.median(ratios) if timed_together else None,
        "compute_bound_median": statistics.median(bounds),
        "ratio_over_bound_median": (
            statistics.median(r / b for r, b in zip(ratios, bounds, strict=True)) if timed_together else None
        ),
        "rounds_timed": len(ratios),
        "seconds_median": {"none": statistics.median(none["seconds_by_round"][start - 1 :]),
                           "aegis": statistics.median(aegis["seconds_by_round"][start - 1 :])},
    }  # fmt: skip


def arm_of(row: dict[str, Any]) -> str:
    """The arm a row belongs to: its benchmark cell (rows of older results without one: the defense)."""
    return str(row.get("cell", row["defense"]))


def merged_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of several utility results of one scale (e.g. one per seed, or an Aegis arm run apart from
    its no-defense twin), each (seed, cell, defense) from exactly one of them; each row gains ``result``,
    the index of its file."""
    if len({r["scale"] for r in results}) != 1:
        raise SystemExit(f"results of different scales: {sorted({r['scale'] for r in results})}")
    rows: list[dict[str, Any]] = []
    key = lambda r: (r["seed"], arm_of(r), r["defense"])  # noqa: E731
    for index, result in enumerate(results):
        twice = {key(r) for r in result["rows"]} & {key(r) for r in rows}
        if twice:
            raise SystemExit(f"rows {sorted(twice, key=repr)} appear in more than one result file")
        rows.extend({**r, "result": index} for r in result["rows"])
    return rows


def paired(rows: list[dict[str, Any]]) -> dict[str, dict[int, tuple[dict[str, Any], dict[str, Any]]]]:
    """Each Aegis arm (a non-``none`` row, named by its cell) per seed, beside that seed's one no-defense
    row: arms of several cells (e.g. generators trained longer) share the seed's no-defense run."""
    arms: dict[str, dict[int, tuple[dict[str, Any], dict[str, Any]]]] = {}
    for seed in sorted({r["seed"] for r in rows}):
        nones = [r for r in rows if r["seed"] == seed and r["defense"] == "none"]
        if len(nones) != 1:
            raise SystemExit(f"seed {seed} has {len(nones)} no-defense rows; a pairing needs exactly one")
        for row in (r for r in rows if r["seed"] == seed and r["defense"] != "none"):
            cell = arm_of(row)
            if seed in arms.setdefault(cell, {}):
                raise SystemExit(f"seed {seed} has two Aegis rows in cell {cell!r}")
            arms[cell][seed] = (nones[0], row)
    return arms


def main() -> None:
    parser = make_parser(__doc__.splitlines()[0], HERE / "results")
    parser.add_argument(
        "--result", type=Path, nargs="+", default=[HERE / "results" / "aegis_generator_utility_paper.json"]
    )
    parser.add_argument("--setting", type=Path, default=HERE / "configs" / "base" / "paper000_setting.toml")
    parser.add_argument("--cache", type=int, default=2048, help="Aegis' M")
    parser.add_argument("--from-round", type=int, default=5, help="first round (1-based) of the timing")
    args = parse_args(parser)
    results = [json.loads(path.read_text()) for path in args.result]
    keys = [*(f"{a}-{b}" for a, b in BLOCKS), "25-60"]
    sizes: dict[int, dict[int, int]] = {}
    arms: dict[str, Any] = {}
    for cell, seeds in paired(merged_rows(results)).items():
        per_seed = {}
        for seed, (none, aegis) in seeds.items():
            if seed not in sizes:
                sizes[seed] = sizes_of(args.setting, seed)
            per_seed[str(seed)] = analyse(none, aegis, sizes[seed], args.cache, args.from_round)
        mean_blocks = {k: mean_of([s["gap_points_by_block"][k] for s in per_seed.values()]) for k in keys}
        arms[cell] = {"seeds": per_seed, "mean_gap_points_by_block": mean_blocks}
    payload = {"source": [p.name for p in args.result], "source_git": [r["git"] for r in results],
               "cache": args.cache, "from_round": args.from_round, "arms": arms}  # fmt: skip
    path = write_result(NAME, results[0]["scale"], payload, seeds=sorted(sizes), out=args.out)
    print(json.dumps(payload, indent=1))  # noqa: T201 (a script's report)
    print(f"wrote {path}")  # noqa: T201


if __name__ == "__main__":
    main()
