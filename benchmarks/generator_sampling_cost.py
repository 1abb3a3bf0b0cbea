"""Issue 22's cost budget on PathMNIST: what the own-share generator's sampler options save, side by side.

``generator_steps.py`` measured the shortest-trained own-share diffusion column (600 steps) at 22.9 and 30.3
CPU-minutes for its first two clients against the budget of 30 (training + Aegis' cache build); most of the
second client's is the cache build (5,120 candidates at a 57 % rejection rate, each candidate 10
DPM-Solver++ steps with classifier-free guidance: two UNet forwards a step). This script keeps that
column's trained generator and varies only how it samples, in one run: the column as configured, no
guidance (one forward a step), 6 solver steps, and both. For each chosen client and variant it reports
the quality gate (``generator_steps.measure``: class fidelity, Frechet distance, memorisation against the
client's own share, the reference trained on the other clients) and the cost (training CPU time of the
stored generator + the cache build timed here).

    python benchmarks/generator_sampling_cost.py --scale small --clients 1 --threads 2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from generator_steps import BENCHMARK, SCALES, aegis_columns, column_name, measure, reference_for, save
from gradleak.data import ImageDataset
from gradleak.defenses.aegis.defense import AegisConfig
from gradleak.experiments.benchmark import load_benchmark
from gradleak.experiments.measurement import configure_torch, make_parser, parse_args
from gradleak.experiments.runner import build_simulation

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
NAME = "generator_sampling_cost"
# sampler options replaced on the column's own (variant name -> DiffusionSamplingConfig fields)
VARIANTS: dict[str, dict[str, Any]] = {
    "as_configured": {},
    "guidance1": {"guidance": 1.0},
    "steps6": {"steps": 6},
    "guidance1_steps6": {"guidance": 1.0, "steps": 6},
}


def shortest_column(columns: list[AegisConfig]) -> AegisConfig:
    """The diffusion column trained the fewest steps (the cost lever's starting point)."""
    diffusion = [c for c in columns if c.generator == "diffusion"]
    if not diffusion:
        raise SystemExit(f"{BENCHMARK} has no diffusion column")
    return min(diffusion, key=lambda c: c.diffusion.training.steps)


def variant(config: AegisConfig, sampling: dict[str, Any]) -> AegisConfig:
    d = config.diffusion
    return dataclasses.replace(
        config, diffusion=dataclasses.replace(d, sampling=dataclasses.replace(d.sampling, **sampling))
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    parser.add_argument("--clients", type=int, nargs="+", default=[1], help="client ids (default: 1)")
    args = parse_args(parser, argv)
    scale = SCALES[args.scale]
    threads = configure_torch(args.threads)
    seed = args.seeds[0]
    _, _, cfg = load_benchmark(BENCHMARK).configs(args.scale, [seed])[0]
    column = shortest_column(aegis_columns(cfg))
    configs = {name: variant(column, sampling) for name, sampling in VARIANTS.items()}  # checked first
    sim = build_simulation(cfg)
    unknown = sorted(set(args.clients) - set(range(len(sim.clients))))
    if unknown:
        parser.error(f"--clients {unknown}: the federation has clients 0..{len(sim.clients) - 1}")
    assert isinstance(sim.test, ImageDataset)
    print(f"{NAME} --scale {args.scale}: {column_name(column)}, clients {args.clients}, threads {threads}")
    rows = []
    for cid in args.clients:
        client, ref = reference_for(sim, cid, scale, seed)
        for name, config in configs.items():
            row = measure(config, client, ref, time_cache=True)
            sampling = dataclasses.asdict(config.diffusion.sampling)
            rows.append({"client": cid, "variant": name, "sampling": sampling,
                         "reference_accuracy": ref.real_accuracy, **row})  # fmt: skip
    setting = {"column": dataclasses.asdict(column), "clients": args.clients, "variants": VARIANTS}
    save(NAME, args, setting, threads, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
