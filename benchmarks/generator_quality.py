"""Aegis' generators side by side (issue 22): the quality gate, the cache build and the cost of each.

Paper 000's federation (``configs/base/paper000_setting.toml``: OrganAMNIST, 100 label-skew clients, <= 5
classes). Generators, each scored by :mod:`gradleak.defenses.aegis.generators.quality` (a reference
``aegis_cnn`` trained
on real training images; held-out real test images; memorisation against the images the generator was fit
on):

- ``diffusion_public``: the diffusion generator trained on the sanctioned public split (OrganAMNIST val),
  one for every client; ``gaussian_public``: the PCA generator fit on the same split;
- ``diffusion_own`` / ``gaussian_own``: fit on one client's own share (the generator never leaves it);
- ``oracle``: real test images the clients do not hold (a perfect generator);
- ``diffusion_public_trailing`` / ``diffusion_public_guidance1``: the public diffusion generator sampled
  with "trailing" timestep spacing, or without classifier-free guidance (half the cost per image);
- ``diffusion_public_<n>steps``: the public diffusion generator trained for another number of steps (the
  scale's ``shorter``, or ``--public-steps``), scored against the same reference: what training length buys.
  ``--rows`` computes only the rows named (e.g. ``oracle gaussian_public diffusion_public_6000steps``:
  the reference's rows again, as a check, beside a new one).

For each: fit seconds, seconds to sample M images, parameters and file size, and the Aegis cache build for
that client (M = 2,048 at small / paper scale accepted against its share, at most 4 M candidates: rejection
rate, seconds).

    python benchmarks/generator_quality.py --scale smoke|small|paper --threads 2 [--device cuda]

``--device cuda`` trains and samples the diffusion generators on a GPU (everything else stays on the CPU);
the paper scale was run so, on the device machine lent to a session (docs/reproducing.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gradleak.data import ImageDataset, load_dataset
from gradleak.defenses.aegis.cache import CacheConfig, build_cache
from gradleak.defenses.aegis.generators.base import ConditionalGenerator, PublicSplit
from gradleak.defenses.aegis.generators.diffusion import DiffusionGeneratorConfig, fit_diffusion
from gradleak.defenses.aegis.generators.gaussian import ClassGaussianGenerator
from gradleak.defenses.aegis.generators.oracle import RealImageGenerator
from gradleak.defenses.aegis.generators.quality import QualityConfig, Reference
from gradleak.experiments.config import load_config
from gradleak.experiments.measurement import configure_torch, make_parser, parse_args, timed, write_result
from gradleak.experiments.runner import build_simulation
from gradleak.options import build_dataclass

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
SETTING = HERE / "configs" / "base" / "paper000_setting.toml"
NAME = "generator_quality"
CANDIDATES = (
    4.0  # the cache build gives up after 4 x M candidates (a generator the filter rejects: a finding)
)

# other sampling options of the public diffusion generator (its default: DPM-Solver++, 10 "leading" steps,
# guidance 1.5): the last step at t = 999 instead of 900, and no guidance (half the UNet forwards)
SAMPLING_VARIANTS: dict[str, dict[str, Any]] = {
    "diffusion_public_trailing": {"spacing": "trailing"},
    "diffusion_public_guidance1": {"guidance": 1.0},
}


@dataclass(frozen=True)
class Scale:
    classifier_images: int  # OrganAMNIST train images the reference classifier learns from
    heldout: int  # test images scored against (the next ones feed the oracle)
    public_limit: int | None  # val images the public generators fit on
    steps: int  # diffusion training steps
    samples_per_class: int
    client: int  # the client whose share the own generators fit on
    M: int  # cache size; also the images timed for sampling
    shorter: tuple[int, ...] = ()  # other training lengths of the public diffusion generator


SCALES = {
    "smoke": Scale(1000, 300, 500, 50, 20, 0, 128),
    "small": Scale(10000, 3000, None, 1500, 100, 0, 2048),
    "paper": Scale(34561, 6000, None, 6000, 500, 0, 2048, shorter=(1500,)),
}


def sampling_seconds(source: ConditionalGenerator, classes: list[int], m: int) -> tuple[float, float]:
    labels = torch.tensor(classes).repeat(m // len(classes) + 1)[:m]
    _, wall, cpu = timed(lambda: source.sample(labels, generator=torch.Generator().manual_seed(0)))
    return wall, cpu


def measure(
    name: str, make: Any, fit_on: ImageDataset, client: ImageDataset, ref: Reference, m: int
) -> dict[str, Any]:
    print(f"  {name}: fit on {len(fit_on)} images", flush=True)
    source, fit, fit_cpu = timed(make)
    report = ref.score(name, source, fit_on, classes=sorted(int(v) for v in client.labels.unique()))
    row: dict[str, Any] = {
        "generator": name,
        "fit_images": len(fit_on),
        "fit_seconds": fit,
        "fit_cpu_seconds": fit_cpu,
        **{k: v for k, v in report.as_dict().items() if k != "classes"},
        "per_class": [asdict(c) for c in report.classes],
    }
    row["sample_seconds_M"], row["sample_cpu_seconds_M"] = sampling_seconds(
        source, [c.label for c in report.classes], m
    )
    if hasattr(source, "parameters"):
        row["parameters"] = int(source.parameters)
    info = getattr(source, "info", {})
    for key in ("train_seconds", "train_cpu_seconds", "train_loss"):  # from the file when it was reused
        if key in info:
            row[key] = info[key]
    saved = info.get("saved") or info.get("reused")
    if saved:
        row["file_bytes"] = Path(saved).stat().st_size
    try:
        cache, _, cache_cpu = timed(
            lambda: build_cache(
                source,
                client,
                CacheConfig(size=m, max_candidates_factor=CANDIDATES),
                generator=torch.Generator().manual_seed(0),
            )
        )
        row["cache"] = {k: cache.stats[k] for k in ("candidates", "rejection_rate", "budget", "seconds")}
        row["cache"]["cpu_seconds"] = cache_cpu
    except Exception as exc:  # a generator whose candidates the filter rejects: that is the finding
        row["cache"] = {"error": str(exc)}
    print(
        f"    accuracy {row['accuracy']:.3f} frechet {row['frechet']:.2f} copy rate {row['copy_rate']:.3f} "
        f"fit {fit:.0f}s ({fit_cpu / 60:.1f} CPU-min) sample {row['sample_seconds_M']:.0f}s "
        f"cache {row['cache']}",
        flush=True,
    )
    return row


def print_gate(rows: list[dict[str, Any]], real_accuracy: float) -> None:
    """The gate as a table a user reads: per class and generator, fidelity / Frechet / copy rate."""
    print(f"\nquality gate (reference classifier on held-out real images: {real_accuracy:.3f})")
    print("| generator | class | classified as requested | Frechet | median NN distance | copy rate |")
    for row in rows:
        for c in row["per_class"]:
            print(f"| {row['generator']} | {c['label']} | {c['accuracy']:.3f} | {c['frechet']:.1f} | "
                  f"{c['nn_distance']:.4f} | {c['copy_rate']:.3f} |")  # fmt: skip
        flag = "MEMORISES" if row["memorised"] else "ok"
        print(f"| {row['generator']} | all | {row['accuracy']:.3f} | {row['frechet']:.1f} | "
              f"{row['nn_distance']:.4f} | {row['copy_rate']:.3f} ({flag}) |")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    parser.add_argument(
        "--store", default="benchmarks/.state/generators", help="folder of trained generators"
    )
    parser.add_argument("--device", default="cpu", help="where the diffusion generators train and sample")
    parser.add_argument(
        "--public-steps",
        type=int,
        nargs="+",
        help="other training lengths of the public diffusion generator (default: the scale's)",
    )
    parser.add_argument(
        "--rows",
        nargs="+",
        help="only these rows (names as in the result); the result is then written as "
        "generator_quality_rows_<scale>.json beside the full one",
    )
    args = parse_args(parser, argv)
    scale = SCALES[args.scale]
    public_steps = tuple(args.public_steps) if args.public_steps else scale.shorter
    if any(n < 1 for n in public_steps):
        parser.error(f"--public-steps must be >= 1, got {list(public_steps)}")
    chosen = set(args.rows) if args.rows else None
    threads = configure_torch(args.threads)
    seed = args.seeds[0]
    print(f"{NAME} --scale {args.scale}: {scale}, seed {seed}, torch threads {threads}", flush=True)

    cfg = load_config(SETTING, ["audit.clients=0", f"experiment.seed={seed}"])
    client = build_simulation(cfg).clients[scale.client]
    assert isinstance(client, ImageDataset)
    classifier_data = load_dataset("organamnist", "train", limit=scale.classifier_images)
    test = load_dataset("organamnist", "test", limit=2 * scale.heldout)
    heldout = test.subset(list(range(scale.heldout)))
    oracle_pool = test.subset(list(range(scale.heldout, len(test))))
    public = PublicSplit("organamnist", "val", scale.public_limit)
    public_data = public.load()

    def diffusion(train_on: str, steps: int = scale.steps, **sampling: Any) -> DiffusionGeneratorConfig:
        return build_dataclass(
            DiffusionGeneratorConfig,
            {
                "train_on": train_on,
                "public": asdict(public),
                "training": {"steps": steps},
                "sampling": sampling,
                "seed": seed,
                "store": args.store,
                "device": args.device,
            },
            where="diffusion",
        )

    # every row: (name, the images it is fit on, how to make it), made only when chosen (--rows)
    specs: list[tuple[str, ImageDataset, Any]] = [
        ("oracle", client, lambda: RealImageGenerator(oracle_pool)),
        ("gaussian_public", public_data, lambda: ClassGaussianGenerator.fit(public_data)),
        ("gaussian_own", client, lambda: ClassGaussianGenerator.fit(client)),
        ("diffusion_public", public_data, lambda: fit_diffusion(client, diffusion("public"))),
        ("diffusion_own", client, lambda: fit_diffusion(client, diffusion("own"))),
    ]
    for name, sampling in SAMPLING_VARIANTS.items():  # the same stored public generator, sampled otherwise
        specs.append(
            (
                name,
                public_data,
                lambda sampling=sampling: fit_diffusion(client, diffusion("public", **sampling)),
            )
        )
    for steps in public_steps:
        specs.append(
            (f"diffusion_public_{steps}steps", public_data,
             lambda steps=steps: fit_diffusion(client, diffusion("public", steps)))
        )  # fmt: skip
    names = [name for name, _, _ in specs]
    if chosen is not None and chosen - set(names):
        parser.error(f"--rows {sorted(chosen - set(names))} unknown; rows: {names}")
    ref = Reference(
        classifier_data, heldout, QualityConfig(samples_per_class=scale.samples_per_class, seed=seed)
    )
    print(
        f"  reference classifier: {ref.real_accuracy:.3f} on {len(heldout)} held-out test images", flush=True
    )

    rows = []
    for name, fit_on, make in specs:
        if chosen is None or name in chosen:
            rows.append(measure(name, make, fit_on, client, ref, scale.M))
            if name in SAMPLING_VARIANTS:
                rows[-1]["sampling"] = SAMPLING_VARIANTS[name]
    payload = {
        "setting": {
            "federation": str(SETTING.relative_to(HERE)),
            "client": scale.client,
            "client_images": len(client),
            "client_classes": sorted(int(v) for v in client.labels.unique()),
            "public": asdict(public),
            "heldout": f"organamnist/test[:{scale.heldout}]",
            "oracle_pool": f"organamnist/test[{scale.heldout}:{2 * scale.heldout}]",
            "classifier": f"aegis_cnn, organamnist/train[:{scale.classifier_images}]",
            "diffusion": asdict(diffusion("public")),
            **asdict(scale),
            "shorter": list(public_steps),
        },
        "device": args.device,
        "reference_accuracy": ref.real_accuracy,
        "torch_threads": threads,
        "rows": rows,
    }
    print_gate(rows, ref.real_accuracy)
    path = write_result(
        NAME if chosen is None else f"{NAME}_rows", args.scale, payload, seeds=[seed], out=args.out
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
