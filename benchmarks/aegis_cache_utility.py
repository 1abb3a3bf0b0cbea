"""Is an Aegis cache good training data? A minutes-long proxy for the accuracy cost of Aegis (paper 000).

Aegis trains each client on its synthetic cache at the same per-sample weight as its real images (lambda
weighting: M = 2048 synthetic against ~350 real samples), so the cache's worth *as training data* bounds what
Aegis costs in accuracy (the FL utility run, ``aegis_table1.py --utility-only``, takes ~2 CPU hours per seed
for 60 rounds). Per client of paper 000's partition (OrganAMNIST, 100 label-skew clients, <= 5 classes), the
initial ``aegis_cnn`` is trained with Adam lr 1e-3, B = 64, for the same number of steps (``EPOCHS`` epochs of
the client's share) on

- ``real``: the client's own n images;
- ``cache_n``: n images of its cache (the built-in generator fit on its share, after acceptance);
- ``other_real_n``: n real images of the client's labels held by other clients (a perfect generator);
- ``real+cache``: its n real images and the whole cache mixed, every sample weighted alike (lambda);

and tested on the test images of the client's own classes. Reported: mean accuracy per arm and the mean
paired difference to ``real`` with its standard error over clients.

    python benchmarks/aegis_cache_utility.py --scale smoke|small|paper --threads 1 [--components 32]
        [--temperature 1.0] [--tag NAME]
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from aegis_table1 import federation
from aegis_table2 import client_cache, other_clients
from gradleak.data import load_dataset
from gradleak.fl import derive_seed, evaluate
from gradleak.generators import GaussianGeneratorConfig
from linear_leakage import MODEL, NUM_CLIENTS

from _common import configure_torch, make_parser, parse_args, write_result

NAME = "aegis_cache_utility"
M = 2048
EPOCHS = 10
CLIENTS = {"smoke": 2, "small": 12, "paper": NUM_CLIENTS}
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


def run(seed: int, clients: int, gen: GaussianGeneratorConfig) -> dict[str, Any]:
    pool, parts, init = federation("organamnist", seed)
    test = load_dataset("organamnist", "test")
    rows = []
    for cid in range(clients):
        share = pool.subset(np.sort(parts[cid]))
        n = len(share)
        cache = client_cache(share, M, seed, cid, generator_config=gen)
        labels = torch.unique(share.labels)
        mask = torch.isin(test.labels, labels)
        g = torch.Generator().manual_seed(derive_seed(seed, 0xC0DE, cid))
        pick = torch.randperm(len(cache), generator=g)[:n]
        others = other_clients(pool, parts[cid])
        other = others[torch.randperm(len(others), generator=g)[:n]]
        data = {
            "real": (share.images, share.labels),
            "cache_n": (cache.images[pick], cache.labels[pick]),
            "other_real_n": (pool.images[other], pool.labels[other]),
            "real+cache": (torch.cat([share.images, cache.images]), torch.cat([share.labels, cache.labels])),
        }
        steps = EPOCHS * -(-n // 64)
        acc = {
            arm: evaluate(
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
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--components", type=int, default=GaussianGeneratorConfig.components)
    parser.add_argument("--temperature", type=float, default=GaussianGeneratorConfig.temperature)
    parser.add_argument("--tag", default="", help="suffix for the result file (e.g. a generator variant)")
    args = parse_args(parser, argv)
    configure_torch(args.threads)
    gen = GaussianGeneratorConfig(components=args.components, temperature=args.temperature)
    results = {}
    for s in args.seeds:
        print(f"{NAME} --scale {args.scale}: seed {s}, {CLIENTS[args.scale]} clients, {gen}", flush=True)
        results[f"seed{s}"] = run(s, CLIENTS[args.scale], gen)
        for arm, v in results[f"seed{s}"]["summary"].items():
            print(
                f"  {arm}: mean {v['mean_acc']:.4f}, minus real {v['mean_diff_to_real']:+.4f}",
                f"(se {v['se_diff']})",
            )
    payload = {
        "setting": {
            "dataset": "organamnist",
            "model": MODEL,
            "training": f"Adam lr 1e-3, B = 64, {EPOCHS} epochs of the client's share (same steps per arm)",
            "cache": M,
            "generator": {"kind": "gaussian", "components": gen.components, "temperature": gen.temperature},
            "clients": CLIENTS[args.scale],
        },
        "results": results,
    }
    name = NAME + (f"_{args.tag}" if args.tag else "")
    print(f"wrote {write_result(name, args.scale, payload, seeds=args.seeds, out=args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
