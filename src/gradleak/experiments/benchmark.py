"""Benchmarks as configs of the engine: one TOML per paper table or claim, run by the experiment runner.

A benchmark file is an experiment config (the base every cell shares) plus a ``[benchmark]`` table::

    [benchmark]
    name = "text_attacks"                       # the result file: benchmarks/results/<name>_<scale>.json
    claim = "paper 002 Tables III-VI: ..."      # what it measures, in words
    seeds = [0]                                 # experiment.seed of every cell
    paper = { dager_rouge1_min = 0.98 }         # the paper's numbers, stored beside ours
    previous = "text_attacks_{scale}.json"      # a committed result this re-derives (optional)
    aliases = { "aegis_llm(flood_mlp=False)" = "aegis_2ch" }   # our defense label -> the committed one's
    keys = { psnr_mean = "psnr_mean_all" }      # our score -> the committed one's name
    stats = ["matching_loss_honest"]            # attack statistics averaged beside the standard scores
    tail = 5                                    # also the mean test accuracy of the last 5 rounds (and
                                                # round by round: accuracy, wall time, sampled clients,
                                                # clients that withheld their update: *_by_round)
    texts = true                                # text attacks: each row also the word-for-word
                                                # reconstructions of every attacked update (paper 002
                                                # Table XIII): its true sequences (the first 16), each
                                                # with the reconstruction matched to it (an unordered
                                                # attack: its recovered tokens, not aligned)
    base = "paper001_victim.toml"               # a shared experiment config under this one
    extends = "text_attacks.toml"               # another benchmark file under this one: its tables and
                                                # [benchmark] keys but name and previous (cells or axes:
                                                # replaced whole where this file has either)

    [[benchmark.cells]]                         # one experiment (or grid) per cell; or [[benchmark.axes.X]]
                                                # tables whose product (names joined by "-") are the cells
    name = "gpt2_small-rotten_tomatoes"
    overrides = ["model.name='gpt2_small'"]     # dotted key=value, applied to the base
    match = { model = "gpt2_small", dataset = "rotten_tomatoes" }   # its rows in ``previous``
    at = { paper = ["audit.training.epochs=20"] }   # the cell's overrides at one scale (after the others)

    [benchmark.scales.small]                    # smoke | small | paper
    overrides = ["audit.clients=1"]             # applied before the cell's (the more specific wins)
    cells = ["gpt2_small-rotten_tomatoes"]      # optional: the cells this scale runs (default: all)

Every cell runs through :func:`~gradleak.experiments.runner.run_experiment` (or
:func:`~gradleak.experiments.grid.run_grid` for a ``[grid]`` base) into one store, so an interrupted
benchmark resumes where it stopped and a finished cell is reused. The result JSON holds the command, git
commit, machine, seeds and scale, one row per cell, defense and attack (mean, standard deviation and count
of every privacy score over the attacked updates, utility, cost), the paper's numbers and, with
``previous``, each row next to the committed rows it re-derives (their mean where several match, e.g. a
former script's seeds).
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradleak.experiments import columns
from gradleak.experiments.config import ConfigError, ExperimentConfig, defenses_label, load_config, read_toml
from gradleak.experiments.grid import run_grid, spread
from gradleak.experiments.measurement import SCALES, machine_info
from gradleak.experiments.runner import RunOutcome, environment, run_experiment
from gradleak.experiments.store import ResultStore
from gradleak.fileio import atomic_write

log = logging.getLogger(__name__)

# averaged over a row's attacked updates, where present (views, epsilon_views: an audit with audit.views > 1)
MEAN = (*columns.keys(), "valid", "attack_seconds", "views", "epsilon_views")


@dataclass(frozen=True)
class Cell:
    """One experiment of a benchmark: ``overrides`` on the base (``at``: more at one scale); ``match``
    selects its rows in the committed result it re-derives, ``previous`` (candidate files, the first that
    exists) overrides the benchmark's."""

    name: str
    overrides: tuple[str, ...] = ()
    match: Mapping[str, Any] = field(default_factory=dict)
    previous: tuple[str, ...] = ()
    at: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Scale:
    overrides: tuple[str, ...] = ()
    cells: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Benchmark:
    """A parsed benchmark file: its ``[benchmark]`` table and the base experiment (module docstring)."""

    name: str
    claim: str
    base: Mapping[str, Any]
    cells: tuple[Cell, ...]
    scales: Mapping[str, Scale]
    seeds: tuple[int, ...] = (0,)
    paper: Mapping[str, Any] = field(default_factory=dict)
    previous: str | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    keys: Mapping[str, str] = field(default_factory=dict)
    stats: tuple[str, ...] = ()
    tail: int = 0
    texts: bool = False
    source: Path | None = None

    def configs(
        self,
        scale: str,
        seeds: Sequence[int] | None = None,
        *,
        cells: Sequence[str] | None = None,
        extra: Sequence[str] = (),
    ) -> list[tuple[Cell, int, ExperimentConfig]]:
        """Every cell of ``scale`` (or the named ``cells`` of it) for every seed, with the ``extra``
        overrides last (e.g. ``experiment.device='cuda'``), validated (all before any work)."""
        if scale not in self.scales:
            raise ConfigError(f"benchmark {self.name!r} has no scale {scale!r}; it has {sorted(self.scales)}")
        sc = self.scales[scale]
        names = [c.name for c in self.cells]
        unknown = sorted(set(sc.cells or ()) - set(names))
        if unknown:
            raise ConfigError(f"benchmark.scales.{scale}.cells names unknown cells {unknown}; cells: {names}")
        chosen = [c for c in self.cells if sc.cells is None or c.name in sc.cells]
        owned = [e for e in extra if e.split("=", 1)[0].strip() in ("experiment.seed", "experiment.name")]
        if owned:
            raise ConfigError(f"--set {owned[0]!r}: a benchmark sets each cell's seed and name (use --seeds)")
        if cells is not None:
            missing = sorted(set(cells) - {c.name for c in chosen})
            if missing:
                raise ConfigError(
                    f"--cells names {missing}, not cells of scale {scale!r}: {[c.name for c in chosen]}"
                )
            chosen = [c for c in chosen if c.name in cells]
        out = []
        for cell in chosen:
            for seed in seeds if seeds is not None else self.seeds:
                name = f"experiment.name='{self.name}.{cell.name}'"
                overrides = [
                    *sc.overrides,
                    *cell.overrides,
                    *cell.at.get(scale, ()),
                    f"experiment.seed={seed}",
                    name,
                    *extra,
                ]
                try:
                    cfg = load_config(json.loads(json.dumps(self.base)), overrides)
                except ConfigError as exc:
                    raise ConfigError(
                        f"benchmark {self.name!r} cell {cell.name!r} ({scale}): {exc}"
                    ) from None
                out.append((cell, seed, cfg))
        return out


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of strings, got {value!r}")
    return tuple(value)


def _cell(c: Any, where: str) -> Cell:
    if not isinstance(c, Mapping) or not isinstance(c.get("name"), str):
        raise ConfigError(f"{where} needs a string name, got {c!r}")
    extra = sorted(set(c) - {"name", "overrides", "match", "previous", "at"})
    if extra:
        raise ConfigError(f"unknown key(s) {extra} in {where}")
    overrides = _strings(c.get("overrides", []), f"{where}.overrides")
    previous = _strings(c.get("previous", []), f"{where}.previous")
    at = c.get("at", {})
    if not isinstance(at, Mapping) or sorted(set(at) - set(SCALES)):
        raise ConfigError(f"{where}.at maps scales {list(SCALES)} to overrides, got {at!r}")
    scaled = {k: _strings(v, f"{where}.at.{k}") for k, v in at.items()}
    return Cell(c["name"], overrides, dict(c.get("match", {})), previous, scaled)


def _list(values: Any, axis: str) -> list[Any]:
    if not isinstance(values, list) or not values:
        raise ConfigError(f"benchmark.axes.{axis} must be a non-empty array of cells")
    return values


def _product(parts: Sequence[Cell]) -> Cell:
    """One cell of the axes' product: names joined by '-', overrides and matches in axis order, the
    last axis's previous files that name any."""
    previous = next((p.previous for p in reversed(parts) if p.previous), ())
    match: dict[str, Any] = {}
    for p in parts:
        match.update(p.match)
    at = {
        s: tuple(o for p in parts for o in p.at.get(s, ())) for s in SCALES if any(s in p.at for p in parts)
    }
    return Cell(
        "-".join(p.name for p in parts), tuple(o for p in parts for o in p.overrides), match, previous, at
    )


def load_benchmark(path: str | Path) -> Benchmark:
    """Parse and check a benchmark file (module docstring); its cells are validated by :meth:`configs`."""
    path = Path(path)
    raw = _resolved(path, ())
    spec = raw.pop("benchmark")
    if "axes" in spec:
        axes = spec["axes"]
        if not isinstance(axes, Mapping) or not axes:
            raise ConfigError(f"benchmark.axes must be a table of arrays of cells, got {axes!r}")
        groups = [[_cell(c, f"benchmark.axes.{axis}[{i}]") for i, c in enumerate(_list(values, axis))]
                  for axis, values in axes.items()]  # fmt: skip
        cells = [_product(combo) for combo in itertools.product(*groups)]
    else:
        cells = [
            _cell(c, f"benchmark.cells[{i}]") for i, c in enumerate(spec.get("cells") or [{"name": "all"}])
        ]
    if len({c.name for c in cells}) != len(cells):
        raise ConfigError(f"benchmark.cells repeat a name: {[c.name for c in cells]}")
    scales = {}
    for name, s in (spec.get("scales") or {}).items():
        if name not in SCALES:
            raise ConfigError(f"benchmark.scales.{name}: the scales are {list(SCALES)}")
        if not isinstance(s, Mapping) or sorted(set(s) - {"overrides", "cells"}):
            raise ConfigError(f"benchmark.scales.{name} takes overrides and cells, got {s!r}")
        chosen = _strings(s["cells"], f"benchmark.scales.{name}.cells") if "cells" in s else None
        scales[name] = Scale(_strings(s.get("overrides", []), f"benchmark.scales.{name}.overrides"), chosen)
    seeds = spec.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(v, int) for v in seeds):
        raise ConfigError(f"benchmark.seeds must be a non-empty list of ints, got {seeds!r}")
    name = spec.get("name", path.stem)
    if not isinstance(name, str) or not name.replace("_", "").isalnum():
        raise ConfigError(f"benchmark.name must be letters, digits and underscores, got {name!r}")
    aliases, keys = spec.get("aliases", {}), spec.get("keys", {})
    for what, table in (("aliases", aliases), ("keys", keys)):
        if not isinstance(table, Mapping) or not all(isinstance(v, str) for v in table.values()):
            raise ConfigError(f"benchmark.{what} must map names to names, got {table!r}")
    stats = _strings(spec.get("stats", []), "benchmark.stats")
    tail = spec.get("tail", 0)
    if isinstance(tail, bool) or not isinstance(tail, int) or tail < 0:
        raise ConfigError(f"benchmark.tail must be an int >= 0 (rounds), got {tail!r}")
    texts = spec.get("texts", False)
    if not isinstance(texts, bool):
        raise ConfigError(f"benchmark.texts must be true or false, got {texts!r}")
    return Benchmark(name, str(spec.get("claim", "")), raw, tuple(cells), scales or {"small": Scale()},
                     tuple(seeds), dict(spec.get("paper", {})), spec.get("previous"), dict(aliases),
                     dict(keys), stats, tail, texts, path)  # fmt: skip


KNOWN = ("name", "claim", "seeds", "paper", "previous", "aliases", "keys", "stats", "tail", "texts", "base",
         "extends", "cells", "axes", "scales")  # fmt: skip
OWN = ("name", "previous")  # a benchmark's identity: never taken from the benchmark it extends


def _resolved(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """A benchmark file's tables over what it builds on: its ``base`` experiment config, and over that the
    benchmark file it ``extends`` (resolved the same way; its ``name`` and ``previous`` left out; where this
    file has cells or axes, the parent's cells, axes and its scales' choices of cells left out), merged table
    by table (arrays and values replaced whole)."""
    if path.resolve() in seen:
        raise ConfigError(f"benchmark.extends loops: {' -> '.join(str(p) for p in (*seen, path.resolve()))}")
    raw = read_toml(path, "benchmark file")
    spec = raw.get("benchmark")
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{path}: a benchmark file needs a [benchmark] table")
    unknown = sorted(set(spec) - set(KNOWN))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [benchmark] of {path}; valid keys: {sorted(KNOWN)}")
    if "cells" in spec and "axes" in spec:
        raise ConfigError(f"[benchmark] of {path} takes cells or axes, not both")
    spec = raw["benchmark"] = dict(spec)
    under: dict[str, Any] = {}
    if "base" in spec:  # a shared experiment config (several tables of one paper share its setting)
        base = spec.pop("base")
        if not isinstance(base, str):
            raise ConfigError(f"benchmark.base must be a file name, got {base!r}")
        under = read_toml(path.parent / base, "benchmark.base")
        if "benchmark" in under:
            raise ConfigError(f"benchmark.base {base!r} is a benchmark file; it must be an experiment config")
    if "extends" in spec:  # another benchmark: its cells, scales, paper numbers and experiment under these
        extends = spec.pop("extends")
        if not isinstance(extends, str):
            raise ConfigError(f"benchmark.extends must be a file name, got {extends!r}")
        parent = _resolved(path.parent / extends, (*seen, path.resolve()))
        inherited = {k: v for k, v in parent.pop("benchmark").items() if k not in OWN}
        if "cells" in spec or "axes" in spec:  # other cells: the scales' choices of the parent's go too
            inherited = {k: v for k, v in inherited.items() if k not in ("cells", "axes")}
            scales = inherited.get("scales")
            if isinstance(scales, Mapping):
                inherited["scales"] = {
                    n: {k: v for k, v in sc.items() if k != "cells"} if isinstance(sc, Mapping) else sc
                    for n, sc in scales.items()
                }
        under = _merged(under, {**parent, "benchmark": inherited})
    return _merged(under, raw)


def _merged(base: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``own``'s keys over it, table by table (arrays and values replaced whole)."""
    out = dict(base)
    for key, value in own.items():
        old = out.get(key)
        out[key] = _merged(old, value) if isinstance(old, Mapping) and isinstance(value, Mapping) else value
    return out


def _mean_rows(
    cell: Cell,
    seed: int,
    outcome: RunOutcome,
    defense: str,
    stats: Sequence[str] = (),
    tail: int = 0,
    texts: bool = False,
) -> list[dict[str, Any]]:
    """One row per attack of a run (one row without an attack where the run audits nothing): mean, sd and
    count of each score (and of the attack statistics ``stats``) over its attacked updates; the utility
    after the last round, and with ``tail`` the mean test accuracy of the last ``tail`` evaluated rounds
    (early non-IID FedAvg rounds swing by 10-20 points); with ``texts`` each attacked update's true
    sequences and the reconstruction matched to each (a token set: the recovered tokens)."""
    summary = outcome.of_kind("summary")[0]
    common: dict[str, Any] = {"cell": cell.name, "seed": seed, "run_id": outcome.run_id, "defense": defense,
                              **{c.key: summary.get(c.key) for c in columns.UTILITY if c.key in summary},
                              "fl_seconds": summary.get("fl_seconds")}  # fmt: skip
    if tail:
        rounds = sorted(outcome.of_kind("round"), key=lambda r: int(r["round"]))
        curve = [r["accuracy"] for r in rounds if r.get("accuracy") is not None]
        common[f"accuracy_last_{tail}"] = statistics.fmean(curve[-tail:]) if curve else None
        # round by round (index = round; accuracy None where the round was not evaluated): the wall time, the
        # sampled clients and how many of them withheld their update (a defense that failed closed)
        common["accuracy_by_round"] = [r.get("accuracy") for r in rounds]
        common["seconds_by_round"] = [r.get("seconds") for r in rounds]
        common["clients_by_round"] = [r.get("clients") for r in rounds]
        common["withheld_by_round"] = [len(r.get("errors") or {}) for r in rounds]
    if outcome.config.audit.clients == 0:
        return [{**common, "attack": None, "updates": 0}]
    rows = []
    for i, spec in enumerate(outcome.config.audit.attacks):
        records = [r for r in outcome.of_kind("attack") if r.get("cell") == i]
        row = {**common, "attack": spec.name, "options": dict(spec.options), "updates": len(records),
               "refused": sum(1 for r in records if r.get("refused")),
               "withheld": columns.withheld(outcome.records, i)}  # fmt: skip
        if texts:
            row["texts"] = [{"client": r.get("client_id"), "true": r["true_texts"],
                             "matched": r.get("matched_texts") or r.get("texts")}
                            for r in records if r.get("true_texts")]  # fmt: skip
        rows.append({**row, **spread(records, (*MEAN, *stats))})
    return rows


def _with_cost(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """FL time over the ``none`` row's of the same cell and seed (measured in the same run)."""
    base = {(r["cell"], r["seed"]): r["fl_seconds"] for r in rows if r["defense"] == "none"}
    for r in rows:
        b = base.get((r["cell"], r["seed"]))
        r["cost"] = r["fl_seconds"] / b if b and r.get("fl_seconds") is not None else None
    return rows


COMPARED = ("rouge1", "rouge2", "rougeL", "meteor", "exact", "psnr_mean", "ssim_mean", "reconstruction_rate",
            "label_accuracy", "matching_loss_honest", "final_accuracy", "final_perplexity")  # fmt: skip
UNDER = "_under"  # a match key: a name on the committed row's path (e.g. a results key "organamnist/seed0")


def committed_rows(obj: Any, path: tuple[str, ...] = ()) -> list[tuple[dict[str, Any], tuple[str, ...]]]:
    """Every table row of a committed result (a dict inside a list), with the dict keys on its path."""
    if isinstance(obj, list):
        own = [(item, path) for item in obj if isinstance(item, dict)]  # before the rows nested in them
        return own + [row for item in obj for row in committed_rows(item, path)]
    if isinstance(obj, dict):
        return [row for key, value in obj.items() for row in committed_rows(value, (*path, str(key)))]
    return []


def compare(
    rows: Sequence[dict[str, Any]],
    cell: Cell,
    previous: Mapping[str, Any],
    aliases: Mapping[str, str] | None = None,
    keys: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """``cell``'s rows beside the committed rows they re-derive: the committed rows whose keys equal the
    cell's ``match`` (``_under``: a name on the row's path; ``{seed}`` is the row's seed) and whose attack
    (``attack`` or ``probe``), attack options (on the keys both name, where the committed row has
    ``options``) and defense (``defense`` or ``setting``, where they have one; ours renamed by ``aliases``)
    are the row's. ``keys`` names a score differently in the committed rows (ours -> theirs);
    ``previous`` is the mean of the score over every matching committed row (``previous_rows`` of them,
    e.g. one per seed of a former script), ``delta`` = ours - previous for each score both have."""
    candidates = committed_rows(previous)
    names = {k: (keys or {}).get(k, k) for k in COMPARED}
    out = []
    for r in rows:
        if r["cell"] != cell.name or not cell.match:
            continue
        want = {k: v.format(seed=r["seed"]) if isinstance(v, str) else v for k, v in cell.match.items()}
        under = want.pop(UNDER, None)
        defense = (aliases or {}).get(r["defense"], r["defense"])
        found = [p for p, path in candidates if all(p.get(k) == v for k, v in want.items())
                 and (under is None or under in path)
                 and (p.get("attack") or p.get("probe")) == r["attack"]
                 and _same_options(p.get("options"), r.get("options"))
                 and (p.get("defense") or p.get("setting") or "none") == defense]  # fmt: skip
        if not found:
            continue
        scores = {}
        for k, t in names.items():
            theirs = [p[t] for p in found if _number(p.get(t))]
            if theirs and _number(r.get(k)):
                mean = statistics.fmean(theirs)
                scores[k] = {"ours": r[k], "previous": mean, "delta": r[k] - mean}
        counts = [p.get("n", p.get("images")) for p in found]
        ints = [c for c in counts if isinstance(c, int)]
        n = sum(ints) if len(ints) == len(counts) else None
        out.append({"cell": r["cell"], "seed": r["seed"], "defense": r["defense"], "attack": r["attack"],
                    "previous_n": n, "previous_rows": len(found), "updates": r["updates"],
                    **scores})  # fmt: skip
    return out


def _same_options(theirs: Any, ours: Any) -> bool:
    """The committed row's attack options agree with ours on every key both name (none: agree)."""
    if not isinstance(theirs, Mapping) or not isinstance(ours, Mapping):
        return True
    return all(theirs[k] == ours[k] for k in set(theirs) & set(ours))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def run_benchmark(
    bench: Benchmark,
    scale: str,
    *,
    out: Path,
    store: ResultStore,
    seeds: Sequence[int] | None = None,
    previous_dir: Path | None = None,
    command: str | None = None,
    cells: Sequence[str] | None = None,
    extra: Sequence[str] = (),
) -> Path:
    """Run every cell of ``scale`` (all validated first), write ``out/<name>_<scale>.json``; returns it.
    ``command``: the command line to record (default: this process's); ``cells`` and ``extra`` as
    :meth:`Benchmark.configs`."""
    plan = bench.configs(scale, seeds, cells=cells, extra=extra)
    store.check()
    env = environment()  # the code that runs the cells (a later commit during a long run is not it)
    rows: list[dict[str, Any]] = []
    for cell, seed, cfg in plan:
        log.info("benchmark %s: cell %s, seed %d", bench.name, cell.name, seed)
        if cfg.grid.defenses:
            grid = run_grid(cfg, store=store)
            for c in grid.cells:
                rows += _mean_rows(cell, seed, c.outcome, c.label, bench.stats, bench.tail, bench.texts)
        else:
            outcome = run_experiment(cfg, store=store)
            rows += _mean_rows(
                cell, seed, outcome, defenses_label(cfg.defenses), bench.stats, bench.tail, bench.texts
            )
    rows = _with_cost(rows)
    by_id = {r.run_id: r for r in store.runs()}
    run_commits = sorted(
        {str(by_id[r["run_id"]].environment.get("git_commit")) for r in rows if r["run_id"] in by_id}
    )
    payload: dict[str, Any] = {
        "benchmark": bench.name, "claim": bench.claim, "scale": scale,
        "seeds": list(seeds if seeds is not None else bench.seeds),
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "config": str(bench.source) if bench.source else None,
        "git": {"commit": env["git_commit"], "runs": run_commits}, "code": env["code"],
        "machine": machine_info(),
        "store": str(store.path),
        "paper": dict(bench.paper), "rows": rows,
    }  # fmt: skip
    comparisons = comparisons_for(bench, scale, rows, previous_dir or out)
    if comparisons:
        payload["previous"] = comparisons
    path = out / f"{bench.name}_{scale}.json"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(payload, indent=1, default=str)))
    return path


def comparisons_for(
    bench: Benchmark, scale: str, rows: Sequence[dict[str, Any]], previous_dir: Path
) -> list[dict[str, Any]]:
    """Every row of ``rows`` beside the committed rows it re-derives (:func:`compare`), each cell against
    its first ``previous`` file that exists under ``previous_dir``."""
    comparisons = []
    ran = {r["cell"] for r in rows}
    for cell in (c for c in bench.cells if c.name in ran):
        candidates = cell.previous or ((bench.previous,) if bench.previous else ())
        names = [c.format(scale=scale) for c in candidates]
        found = next((n for n in names if (previous_dir / n).is_file()), None)
        if found is None:
            if names:
                log.warning(
                    "benchmark %s: no committed result among %s for cell %s", bench.name, names, cell.name
                )
            continue
        committed = json.loads((previous_dir / found).read_text())
        comparisons += [
            {"file": found, **row} for row in compare(rows, cell, committed, bench.aliases, bench.keys)
        ]
    return comparisons


def recompare(bench: Benchmark, result: Path, previous_dir: Path) -> Path:
    """Compare a written result of ``bench`` with the committed results again (no cell is run), e.g. after a
    run whose ``--out`` held no committed files; rewrites ``result`` with its ``previous`` section."""
    data = json.loads(result.read_text())
    if data.get("benchmark") != bench.name:
        raise ConfigError(f"{result} is a result of {data.get('benchmark')!r}, not of {bench.name!r}")
    comparisons = comparisons_for(bench, data["scale"], data["rows"], previous_dir)
    data.pop("previous", None)
    if comparisons:
        data["previous"] = comparisons
    atomic_write(result, lambda tmp: tmp.write_text(json.dumps(data, indent=1, default=str)))
    return result


def describe(path: Path) -> str:
    """A one-line account of a result file (for the CLI)."""
    data = json.loads(path.read_text())
    commit = data["git"]["commit"][:12]
    return f"{data['benchmark']} ({data['scale']}): {len(data['rows'])} rows, commit {commit}"
