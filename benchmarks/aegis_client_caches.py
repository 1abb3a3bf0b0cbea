"""Build and store the Aegis caches a benchmark's clients will ask for, client by client, ahead of its run.

An Aegis arm with a cache ``store`` keeps each client's built cache there (named by content:
:func:`gradleak.defenses.aegis.defense.cache_from_data`), and its run reloads it. A federation whose
clients each sample their own cache from the public diffusion generator needs about 100 of them for the
60-round protocol, about 2 minutes each on 2 cores: longer than one sitting. This script builds them for
every client of every seed (or ``--clients``), skipping the ones already stored, so the work survives an
interruption or a code change (the run's own checkpoints do not survive a change of code; the caches, keyed
by content, do). Writes each client's build or reload time and rejection rate, or the reason and the time
to it where Aegis refused to build (its pilot draw, :class:`~gradleak.defenses.aegis.cache.CacheError`).
``--audited``: the clients the run's audit attacks (round 0's first ``audit.clients`` sampled), for a
benchmark with no rounds before its audit.

    python benchmarks/aegis_client_caches.py --scale paper --seeds 0 1 --threads 2 \
        --config benchmarks/configs/aegis_generator_utility_6000_draws.toml
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

from gradleak.data import ImageDataset
from gradleak.defenses.aegis.cache import CacheError
from gradleak.defenses.aegis.defense import AegisConfig, cache_from_data
from gradleak.defenses.aegis.generators.base import GeneratorRefusal
from gradleak.experiments.benchmark import load_benchmark
from gradleak.experiments.config import cell_label
from gradleak.experiments.measurement import configure_torch, make_parser, parse_args, timed, write_result
from gradleak.experiments.runner import build_simulation
from gradleak.progress import bar
from gradleak.registry import DEFENSES

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
NAME = "aegis_client_caches"


def stored_arms(config: Path, scale: str, seed: int) -> list[tuple[Any, list[tuple[str, AegisConfig]]]]:
    """Each cell's experiment config at ``scale`` and ``seed`` with its Aegis arms (labelled as the grid
    labels them) that have a cache store (checked before any work); SystemExit where there are none."""
    out = []
    for _, _, cfg in load_benchmark(config).configs(scale, [seed]):
        arms = [(cell_label(s), DEFENSES.make_config(s.name, s.options)) for s in cfg.grid.defenses]
        stored = [
            (n, replace(a, memo_size=0))
            for n, a in arms
            if isinstance(a, AegisConfig) and a.store is not None
        ]
        if stored:
            out.append((cfg, stored))
    if not out:
        raise SystemExit(f"{config} has no Aegis arm with a cache store at scale {scale!r}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    parser.add_argument("--config", type=Path, required=True, help="the benchmark TOML")
    who = parser.add_mutually_exclusive_group()
    who.add_argument("--clients", type=int, nargs="+", default=None, help="client ids (default: all)")
    who.add_argument("--audited", action="store_true", help="the clients the audit attacks (no rounds first)")
    args = parse_args(parser, argv)
    threads = configure_torch(args.threads)
    plan = [(s, cfg, arms) for s in args.seeds for cfg, arms in stored_arms(args.config, args.scale, s)]
    rows: list[dict[str, Any]] = []
    for seed, cfg, arms in plan:
        sim = build_simulation(cfg)
        if args.audited and cfg.fl.rounds:
            raise SystemExit(
                f"--audited needs a benchmark whose audit comes first; it runs {cfg.fl.rounds} rounds"
            )
        ids = sim.sample()[: cfg.audit.clients] if args.audited else args.clients
        ids = ids if ids is not None else list(range(len(sim.clients)))
        if unknown := sorted(set(ids) - set(range(len(sim.clients)))):
            raise SystemExit(f"no clients {unknown}: the federation has {len(sim.clients)}")
        total = len(ids) * len(arms)
        with bar(desc=f"caches of seed {seed}", total=total, unit="client", force=True) as progress:
            for cid in ids:
                client = sim.clients[cid]
                if not isinstance(client, ImageDataset):
                    raise SystemExit(
                        f"client {cid} holds {type(client).__name__}, not images: Aegis needs images"
                    )
                for label, arm in arms:
                    row = {"seed": seed, "experiment": cfg.experiment.name, "arm": label, "client": cid,
                           "images": len(client)}  # fmt: skip
                    build = partial(cache_from_data, client, arm, root=cfg.experiment.data_root)
                    start = time.perf_counter()
                    try:
                        cache, wall, cpu = timed(build)
                    except (CacheError, GeneratorRefusal) as exc:  # refused (the pilot, the candidate
                        # budget, a public split that holds the client's own images): how fast, and why
                        row.update({"cache": 0, "refused": str(exc), "seconds": time.perf_counter() - start})
                        rows.append(row)
                        progress.write(f"seed {seed} client {cid} {label}: refused ({exc})")
                        progress.update()
                        continue
                    row.update({"cache": len(cache), "reloaded": bool(cache.stats.get("reloaded")),
                                "seconds": wall, "cpu_seconds": cpu, "stats": dict(cache.stats)})  # fmt: skip
                    rows.append(row)
                    how = "reloaded" if row["reloaded"] else "built"
                    progress.write(
                        f"seed {seed} client {cid} {label}: {how} in {wall:.0f} s ({cpu / 60:.1f} CPU-m)"
                    )
                    progress.update()
    distinct = dict.fromkeys(a for _, _, cell_arms in plan for _, a in cell_arms)
    payload = {"config": str(args.config), "arms": [asdict(a) for a in distinct], "torch_threads": threads,
               "rows": rows}  # fmt: skip
    path = write_result(NAME, args.scale, payload, seeds=args.seeds, out=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
