"""The own-share generator's cost against issue 22's budget and what fewer training steps give up (PathMNIST).

Issue 22's cost target: generator training + cache build <= 30 CPU-minutes per client. On PathMNIST's
federation (``configs/aegis_generators_pathmnist.toml``: its 512-image test subset over 8 clients, 41-91
images each, the other 206 held out) every client trains its diffusion generator on its own share. This
script takes that benchmark's audited clients and its Aegis columns at the same scale (the PCA generator and
the own-share diffusion generator at each training length it lists), and for each client and column reports

- the generator's training CPU time (a stored generator keeps the time it was trained in: the benchmark's
  own training, reloaded bit-identically by content),
- the quality gate (:mod:`gradleak.defenses.aegis.generators.quality`): a reference ``aegis_cnn`` trained on
  the *other* clients' images, scored on the 206 held-out images; memorisation judged against the client's
  own share,
- for the first ``cost_clients`` clients, Aegis' cache build exactly as the defense runs it
  (:func:`~gradleak.defenses.aegis.defense.cache_from_data`: M accepted images), wall and CPU seconds
  timed in this process,

and the cost per client (training + cache build, CPU-minutes summed over torch's threads).

    python benchmarks/generator_steps.py --scale smoke|small|paper --threads 2
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gradleak.data import ImageDataset
from gradleak.defenses.aegis.defense import AegisConfig, cache_from_data
from gradleak.defenses.aegis.generators.quality import QualityConfig, Reference
from gradleak.experiments.benchmark import load_benchmark
from gradleak.experiments.config import ExperimentConfig
from gradleak.experiments.measurement import configure_torch, make_parser, parse_args, timed, write_result
from gradleak.experiments.runner import build_simulation
from gradleak.registry import DEFENSES, GENERATORS

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
BENCHMARK = HERE / "configs" / "aegis_generators_pathmnist.toml"
NAME = "generator_steps"
BUDGET_CPU_MINUTES = 30.0  # issue 22
# the reference sees about 450 images: the gate's default 5 epochs (made for 10,000) would be 35 steps
REFERENCE_EPOCHS = 40


@dataclass(frozen=True)
class Scale:
    samples_per_class: int  # generated images per class for the quality gate
    feature_dims: int  # Frechet on this many principal directions (about 23 held-out images per class)
    cost_clients: int  # clients whose cache build is timed (about 5 minutes each at M = 2,048)


SCALES = {"smoke": Scale(10, 4, 1), "small": Scale(100, 8, 2), "paper": Scale(200, 8, 8)}


def column_name(config: AegisConfig) -> str:
    if config.generator == "diffusion":
        return f"diffusion_{config.diffusion.train_on}_{config.diffusion.training.steps}"
    return config.generator


def measure(config: AegisConfig, client: ImageDataset, ref: Reference, time_cache: bool) -> dict[str, Any]:
    """One client's generator for one column: its gate, its training time, and (``time_cache``) the cache."""
    name = column_name(config)
    source = GENERATORS.get(config.generator)(client, config.generator_options, generator=None)
    report = ref.score(name, source, client)
    info = getattr(source, "info", {})
    row: dict[str, Any] = {
        "generator": name,
        "client_images": len(client),
        "train_steps": config.diffusion.training.steps if config.generator == "diffusion" else None,
        "train_seconds": info.get("train_seconds"),
        "train_cpu_seconds": info.get("train_cpu_seconds"),
        "train_device": info.get("device", "cpu"),  # files of earlier versions: trained on the CPU
        **{k: v for k, v in report.as_dict().items() if k != "classes"},
        "per_class": [asdict(c) for c in report.classes],
    }
    if time_cache:
        cache, wall, cpu = timed(lambda: cache_from_data(client, config))
        stats = cache.stats
        row["cache"] = {"images": len(cache), "rejection_rate": stats["rejection_rate"],
                        "candidates": stats["candidates"], "seconds": wall, "cpu_seconds": cpu}  # fmt: skip
        row["cost_cpu_minutes"] = ((row["train_cpu_seconds"] or 0.0) + cpu) / 60
        # a budget of CPU-minutes says nothing of a generator trained on a GPU (its file is reused anyway)
        on_cpu = row["train_device"] == "cpu"
        row["within_budget"] = row["cost_cpu_minutes"] <= BUDGET_CPU_MINUTES if on_cpu else None
    print(
        f"  {name}: accuracy {row['accuracy']:.3f} frechet {row['frechet']:.1f} NN {row['nn_distance']:.4f} "
        f"copy rate {row['copy_rate']:.3f} train {(row['train_cpu_seconds'] or 0) / 60:.1f} CPU-min "
        f"cache {row.get('cache')} cost {row.get('cost_cpu_minutes')}",
        flush=True,
    )
    return row


def aegis_columns(cfg: ExperimentConfig) -> list[AegisConfig]:
    """The Aegis arms of an experiment config, built by the defense registry (each client builds its cache
    afresh: ``memo_size = 0``)."""
    return [
        DEFENSES.make_config(s.name, {**s.options, "memo_size": 0})
        for s in cfg.grid.defenses
        if s.name == "aegis"
    ]


def reference_for(sim: Any, cid: int, scale: Scale, seed: int) -> tuple[ImageDataset, Reference]:
    """Client ``cid``'s share and its quality reference: an ``aegis_cnn`` trained on the *other* clients'
    images (it never saw the client's), scored on the federation's held-out images."""
    client = sim.clients[cid]
    others = [c for i, c in enumerate(sim.clients) if i != cid and isinstance(c, ImageDataset)]
    assert isinstance(client, ImageDataset) and len(others) == len(sim.clients) - 1
    quality = QualityConfig(samples_per_class=scale.samples_per_class, feature_dims=scale.feature_dims,
                            classifier_epochs=REFERENCE_EPOCHS, seed=seed)  # fmt: skip
    ref = Reference(ImageDataset.concat(others), sim.test, quality)
    print(f"client {cid} ({len(client)} images): reference {ref.real_accuracy:.3f}", flush=True)
    return client, ref


def save(name: str, args: Any, setting: dict[str, Any], threads: int, rows: list[dict[str, Any]]) -> Path:
    """The result of ``rows`` with the benchmark, the budget and the scale beside ``setting``."""
    payload = {
        "setting": {
            "benchmark": str(BENCHMARK.relative_to(HERE)),
            "budget_cpu_minutes": BUDGET_CPU_MINUTES,
            **setting,
            **asdict(SCALES[args.scale]),
        },  # fmt: skip
        "torch_threads": threads,
        "rows": rows,
    }
    path = write_result(name, args.scale, payload, seeds=args.seeds[:1], out=args.out)
    print(f"wrote {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    args = parse_args(parser, argv)
    scale = SCALES[args.scale]
    threads = configure_torch(args.threads)
    seed = args.seeds[0]
    bench = load_benchmark(BENCHMARK)
    _, _, cfg = bench.configs(args.scale, [seed])[0]  # every cell shares the federation and the columns
    columns = aegis_columns(cfg)  # the configs are checked before any work
    print(f"{NAME} --scale {args.scale}: {scale}, seed {seed}, torch threads {threads}", flush=True)
    sim = build_simulation(cfg)
    audited = sim.sample()[: cfg.audit.clients]  # the benchmark's audited clients (all sampled in round 0)
    assert isinstance(sim.test, ImageDataset)
    rows = []
    for k, cid in enumerate(audited):
        client, ref = reference_for(sim, cid, scale, seed)
        for config in columns:
            row = measure(config, client, ref, time_cache=k < scale.cost_clients)
            rows.append({"client": cid, "reference_accuracy": ref.real_accuracy, **row})
    setting = {"clients": audited, "heldout_images": len(sim.test), "columns": [asdict(c) for c in columns]}
    save(NAME, args, setting, threads, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
