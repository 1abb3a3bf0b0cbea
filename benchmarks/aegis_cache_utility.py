"""Is an Aegis cache good training data? A minutes-long proxy for the accuracy cost of Aegis (paper 000).

Aegis trains each client on its synthetic cache at the same per-sample weight as its real images (lambda
weighting: M = 2048 synthetic against ~350 real samples), so the cache's worth *as training data* bounds what
Aegis costs in accuracy (the FL utility run, ``configs/aegis_table1.toml`` at paper scale, takes hours per
seed for 60 rounds). Per client of paper 000's federation (the engine's,
``configs/base/paper000_setting.toml``: OrganAMNIST, 100 label-skew clients, <= 5 classes), the initial
``aegis_cnn`` is trained with Adam lr 1e-3, B = 64, for the same number of steps (``EPOCHS`` epochs of the
client's share) on

- ``real``: the client's own n images;
- ``cache_n``: n images of its cache (the one its Aegis builds: by default the built-in generator fit on
  its share, after acceptance; ``defenses.aegis_synthetic.cache_from_data``; ``--generator diffusion``
  the diffusion generator trained on the client's share or, ``--train-on public``, once on OrganAMNIST's
  val split; ``--generator oracle`` real val images);
- ``other_real_n``: n real images of the client's labels held by other clients (a perfect generator);
- ``real+cache``: its n real images and the whole cache mixed, every sample weighted alike (lambda);

and tested on the test images of the client's own classes. Reported: mean accuracy per arm and the mean
paired difference to ``real`` with its standard error over clients.

    python benchmarks/aegis_cache_utility.py --scale smoke|small|paper --threads 1 [--components 32]
        [--temperature 1.0] [--generator gaussian|diffusion|oracle] [--train-on own|public] [--steps 1500]
        [--store DIR] [--tag NAME]
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradleak.data import ImageDataset
from gradleak.defenses.aegis.cache import CacheConfig
from gradleak.defenses.aegis.defense import AegisConfig, cache_from_data
from gradleak.defenses.aegis.generators import GaussianGeneratorConfig, PublicSplit
from gradleak.defenses.aegis.generators.diffusion import DiffusionGeneratorConfig, DiffusionTrainingConfig
from gradleak.defenses.aegis.generators.oracle import OracleGeneratorConfig
from gradleak.experiments.config import load_config
from gradleak.experiments.measurement import configure_torch, make_parser, parse_args, write_result
from gradleak.experiments.runner import build_simulation
from gradleak.federation import derive_seed
from gradleak.metrics.utility import top1_accuracy

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
CONFIGS = HERE / "configs"
NAME = "aegis_cache_utility"
M = 2048
EPOCHS = 10
CLIENTS = {"smoke": 2, "small": 12, "paper": 100}
SETTING = CONFIGS / "base" / "paper000_setting.toml"
ARMS = ("real", "cache_n", "other_real_n", "real+cache")


def train(init: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, seed: int) -> nn.Module:
    """Adam lr 1e-3 (paper 000's local optimiser), batches of 64 from a seeded shuffle, ``steps`` steps."""
    model = copy.deepcopy(init)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    done = 0
    while done < steps:
        perm = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), 64):
            idx = perm[i : i + 64]
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            done += 1
            if done == steps:
                break
    return model


def others_of(shares: Sequence[ImageDataset], cid: int) -> ImageDataset:
    """The images of client ``cid``'s labels that the other clients hold."""
    labels = torch.unique(shares[cid].labels)
    rest = ImageDataset.concat([s for i, s in enumerate(shares) if i != cid])
    return rest.subset(torch.nonzero(torch.isin(rest.labels, labels)).flatten().numpy())


PUBLIC = PublicSplit("organamnist", "val")


def aegis_config(args: Any, seed: int) -> AegisConfig:
    """Aegis with the generator the command line names (M = 2048, the memo off: every client builds)."""
    gen = GaussianGeneratorConfig(components=args.components, temperature=args.temperature)
    diffusion = DiffusionGeneratorConfig(train_on=args.train_on, public=PUBLIC, store=args.store,
                                         training=DiffusionTrainingConfig(steps=args.steps))  # fmt: skip
    return AegisConfig(cache=CacheConfig(size=M), generator=args.generator, gaussian=gen, diffusion=diffusion,
                       oracle=OracleGeneratorConfig(PUBLIC), cache_seed=seed, memo_size=0)  # fmt: skip


def run(seed: int, clients: int, aegis: AegisConfig) -> dict[str, Any]:
    sim = build_simulation(load_config(SETTING, [f"experiment.seed={seed}", "data.test_limit=100000"]))
    shares = [c for c in sim.clients if isinstance(c, ImageDataset)]
    init, test = sim.model, sim.test
    assert len(shares) == len(sim.clients) and isinstance(test, ImageDataset)
    rows = []
    for cid in range(clients):
        share = shares[cid]
        n = len(share)
        cache = cache_from_data(share, aegis)
        labels = torch.unique(share.labels)
        mask = torch.isin(test.labels, labels)
        g = torch.Generator().manual_seed(derive_seed(seed, 0xC0DE, cid))
        pick = torch.randperm(len(cache), generator=g)[:n]
        others = others_of(shares, cid)
        other = torch.randperm(len(others), generator=g)[:n]
        data = {
            "real": (share.images, share.labels),
            "cache_n": (cache.images[pick], cache.labels[pick]),
            "other_real_n": (others.images[other], others.labels[other]),
            "real+cache": (torch.cat([share.images, cache.images]), torch.cat([share.labels, cache.labels])),
        }
        steps = EPOCHS * -(-n // 64)
        acc = {
            arm: top1_accuracy(
                train(init, x, y, steps, derive_seed(seed, cid)), test.images[mask], test.labels[mask]
            )
            for arm, (x, y) in data.items()
        }
        rows.append({"client": cid, "n_real": n, "classes": labels.tolist(), "acc": acc})
        print(f"  client {cid} (n = {n}): " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()), flush=True)
    summary: dict[str, Any] = {}
    for arm in ARMS:
        diffs = [r["acc"][arm] - r["acc"]["real"] for r in rows]
        summary[arm] = {
            "mean_acc": statistics.mean(r["acc"][arm] for r in rows),
            "mean_diff_to_real": statistics.mean(diffs),
            "se_diff": statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None,
        }
    return {"clients": rows, "summary": summary}


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    parser.add_argument("--components", type=int, default=GaussianGeneratorConfig.components)
    parser.add_argument("--temperature", type=float, default=GaussianGeneratorConfig.temperature)
    parser.add_argument("--generator", default="gaussian", choices=("gaussian", "diffusion", "oracle"))
    parser.add_argument("--train-on", default="own", choices=("own", "public"), help="diffusion: fit on")
    parser.add_argument("--steps", type=int, default=1500, help="diffusion training steps")
    parser.add_argument(
        "--store", default="benchmarks/.state/generators", help="trained diffusion generators"
    )
    parser.add_argument("--tag", default="", help="suffix for the result file (e.g. a generator variant)")
    args = parse_args(parser, argv)
    configure_torch(args.threads)
    results = {}
    for s in args.seeds:
        aegis = aegis_config(args, s)
        print(f"{NAME} --scale {args.scale}: seed {s}, {CLIENTS[args.scale]} clients, {aegis}", flush=True)
        results[f"seed{s}"] = run(s, CLIENTS[args.scale], aegis)
        for arm, v in results[f"seed{s}"]["summary"].items():
            print(
                f"  {arm}: mean {v['mean_acc']:.4f}, minus real {v['mean_diff_to_real']:+.4f}",
                f"(se {v['se_diff']})",
            )
    payload = {
        "setting": {
            "dataset": "organamnist",
            "model": "aegis_cnn",
            "federation": str(SETTING.relative_to(CONFIGS.parent)),
            "training": f"Adam lr 1e-3, B = 64, {EPOCHS} epochs of the client's share (same steps per arm)",
            "cache": M,
            "generator": {"kind": args.generator, "options": asdict(aegis_config(args, 0).generator_options)},
            "clients": CLIENTS[args.scale],
        },
        "results": results,
    }
    name = NAME + (f"_{args.tag}" if args.tag else "")
    print(f"wrote {write_result(name, args.scale, payload, seeds=args.seeds, out=args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
