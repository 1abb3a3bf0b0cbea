"""Train a benchmark's public diffusion generators and sample their shared pools once, on any device.

A benchmark whose Aegis arms use ``generator = "diffusion"`` with ``train_on = "public"`` and a ``pool``
trains that generator and samples its pool in the first run that needs them, then reuses both from the
store (files named by content and options, not by device:
:mod:`gradleak.defenses.aegis.generators.diffusion`). This
script does that step alone, for every such arm of ``--config`` at ``--scale``, so that a GPU can do once
what a CPU run would spend most of an hour on (OrganAMNIST val, 6,000 steps: about 43 minutes on 2 cores;
its 22,528-image pool about 20 more); the benchmark run that follows, anywhere, reloads them. Writes the
training and sampling times, the files and their sizes.

    python benchmarks/public_generators.py --config benchmarks/configs/aegis_generator_utility.toml \
        --scale paper --device cuda --store benchmarks/.state/generators
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gradleak.defenses.aegis.generators.diffusion import (
    DiffusionGeneratorConfig,
    diffusion_source,
    fit_diffusion,
)
from gradleak.experiments.benchmark import load_benchmark
from gradleak.experiments.measurement import configure_torch, make_parser, parse_args, timed, write_result
from gradleak.registry import DEFENSES

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
NAME = "public_generators"


def public_arms(config: Path, scale: str, seed: int) -> list[DiffusionGeneratorConfig]:
    """The distinct public diffusion generators of the benchmark's Aegis arms at ``scale`` (checked first)."""
    found: list[DiffusionGeneratorConfig] = []
    for _, _, cfg in load_benchmark(config).configs(scale, [seed]):
        for spec in (s for s in cfg.grid.defenses if s.name == "aegis"):
            aegis = DEFENSES.make_config(spec.name, spec.options)
            d = aegis.diffusion
            if aegis.generator == "diffusion" and d.train_on == "public" and d not in found:
                found.append(d)
    if not found:
        raise SystemExit(f"{config} has no Aegis arm with a public diffusion generator at scale {scale!r}")
    return found


def prepare(config: DiffusionGeneratorConfig) -> dict[str, Any]:
    """Train (or reload) one generator, then sample (or reload) its pool; the seconds of each."""
    data = config.public.load()  # the public split stands in for a client: same shape and classes
    made, train_wall, train_cpu = timed(lambda: fit_diffusion(data, config))
    row: dict[str, Any] = {
        "training": dataclasses.asdict(config.training),
        "sampling": dataclasses.asdict(config.sampling),
        "device": config.device,
        "parameters": made.parameters,
        "train_images": len(data),
        "info": dict(made.info),
        "seconds": train_wall,
        "cpu_seconds": train_cpu,
    }
    if config.pool:
        source, pool_wall, pool_cpu = timed(
            lambda: diffusion_source(data, config, generator=torch.Generator().manual_seed(0))
        )
        row["pool"] = {"per_class": config.pool, "images": len(source.pool.labels), "seconds": pool_wall,
                       "cpu_seconds": pool_cpu, "digest": source.pool.digest()}  # fmt: skip
    store = Path(config.store) if config.store else None
    row["files"] = (
        {p.name: p.stat().st_size for p in sorted(store.glob("diffusion-*.safetensors"))} if store else {}
    )
    print(f"  {config.training.steps} steps on {config.device}: {row}", flush=True)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    parser.add_argument("--config", type=Path, required=True, help="the benchmark TOML")
    parser.add_argument("--device", default="cpu", help="where the generators train and sample")
    parser.add_argument("--store", default=None, help="folder of the generators (default: the config's)")
    args = parse_args(parser, argv)
    threads = configure_torch(args.threads)
    seed = args.seeds[0]
    configs = [
        dataclasses.replace(d, device=args.device, store=args.store or d.store)
        for d in public_arms(args.config, args.scale, seed)
    ]
    print(f"{NAME}: {len(configs)} public generators of {args.config} at {args.scale} on {args.device}")
    rows = [prepare(c) for c in configs]
    payload = {"config": str(args.config), "torch_threads": threads, "rows": rows}
    path = write_result(NAME, args.scale, payload, seeds=[seed], out=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
