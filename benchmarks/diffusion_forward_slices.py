"""How many images per UNet forward the diffusion sampler should use on the CPU, measured side by side.

The sampler draws and steps ``sampling.batch_size`` images together (256 by default); on the CPU the UNet
evaluates them in slices of ``DiffusionGenerator.cpu_forward_images``
(:data:`gradleak.defenses.aegis.generators.diffusion.CPU_FORWARD_IMAGES`). This script samples the same
labels from the same noise with the batch in one forward and in slices of 128, 64, 32 and 16 images,
interleaved over ``repeats`` rounds so that a slow spell of the machine hits every variant, and reports the
median seconds, the ratio to one forward, and the largest difference of the samples from one forward's
(GroupNorm normalises each image on its own, so slicing should not change them beyond rounding).

The generator is a benchmark's public diffusion arm (``--config``), reloaded from its store (trained there
first when absent: about 43 minutes on 2 cores for the 6,000-step OrganAMNIST one); ``smoke`` replaces its
training by 20 steps.

    python benchmarks/diffusion_forward_slices.py --scale small --threads 2 \
        --config benchmarks/configs/aegis_generators_6000.toml
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from gradleak.defenses.aegis.generators.diffusion import fit_diffusion
from gradleak.experiments.measurement import configure_torch, make_parser, parse_args, write_result
from gradleak.progress import bar
from public_generators import public_arms

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
NAME = "diffusion_forward_slices"
SLICES = (128, 64, 32, 16)  # besides the whole batch in one forward
# scale -> (images sampled per variant and round, rounds)
SCALES = {"smoke": (32, 1), "small": (1024, 3), "paper": (2048, 5)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    parser.add_argument("--config", type=Path, required=True, help="a benchmark with a public diffusion arm")
    args = parse_args(parser, argv)
    threads = configure_torch(args.threads)
    seed = args.seeds[0]
    config = public_arms(args.config, "small", seed)[0]  # its first public generator, as the runs train it
    if args.scale == "smoke":
        short = dataclasses.replace(config.training, steps=20)
        config = dataclasses.replace(config, training=short, store=None)
    made = fit_diffusion(config.public.load(), config)
    images, repeats = SCALES[args.scale]
    labels = torch.tensor(made.classes).repeat(images // len(made.classes) + 1)[:images]
    whole = config.sampling.batch_size
    variants = [whole, *(s for s in SLICES if s < whole)]
    seconds: dict[int, list[float]] = {v: [] for v in variants}
    samples: dict[int, torch.Tensor] = {}
    with bar(desc="forward slices", total=repeats * len(variants), unit="run") as progress:
        for _ in range(repeats):
            for v in variants:
                made.cpu_forward_images = v
                start = time.perf_counter()
                samples[v] = made.sample(labels, generator=torch.Generator().manual_seed(seed))
                seconds[v].append(time.perf_counter() - start)
                progress.update()
    base = statistics.median(seconds[whole])
    rows = [
        {
            "forward_images": v,
            "seconds": seconds[v],
            "median_seconds": statistics.median(seconds[v]),
            "ratio_to_one_forward": statistics.median(seconds[v]) / base,
            "max_abs_diff": float((samples[v] - samples[whole]).abs().max()),
        }  # fmt: skip
        for v in variants
    ]
    for r in rows:
        print(f"  {r['forward_images']:4d} images/forward: {r['median_seconds']:.2f} s "
              f"({r['ratio_to_one_forward']:.2f} x one forward), "
              f"max |diff| {r['max_abs_diff']:.2e}")  # fmt: skip
    payload = {"config": str(args.config), "generator": made.info,
               "training": dataclasses.asdict(config.training),
               "sampling": dataclasses.asdict(config.sampling),
               "images": images, "repeats": repeats, "torch_threads": threads, "rows": rows}  # fmt: skip
    path = write_result(NAME, args.scale, payload, seeds=[seed], out=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
