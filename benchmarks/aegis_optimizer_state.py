"""Aegis' synthetic step and the client's Adam state (issue 22): a one-round probe of the early-round gap.

Over paper 000's 60-round protocol (``configs/aegis_generator_utility.toml``: OrganAMNIST, 100 label-skew
clients, FedAvg with Adam lr 1e-3, E = 3, B = 64, M = 2,048, lambda weighting) Aegis with the diffusion
cache trails no defense by 3-5 points in rounds 20-36 and by < 1 point from round 37 on. Under lambda
weighting the one synthetic step per epoch carries ``M / B`` = 32x a real step's gradient; with the
client's Adam state shared ("shared", Algorithm 1 read literally) that gradient enters the second moment
~1,000x a real gradient's square and the first moment 32x, and the real steps after it follow it.

The probe: the no-defense federation is trained to rounds ``at`` (the engine's rounds, seeded as the
benchmark); from each of those global models the same ``clients`` clients (seeded) train one round with each
arm (same batches), their updates are averaged (FedAvg, weights n_i), and the new global model is scored on
the first 2,000 test images. Arms: ``none``; Aegis ``shared`` (the default); Aegis ``separate``
(``optimizer_state = "separate"``: the synthetic step on an Adam state of its own); Aegis ``same_lr``
(the synthetic step at a real step's weight). Also per arm: the real stream's Adam second moment (mean
``sqrt(v)`` over coordinates) after each epoch's synthetic step, and the seconds per image of the real steps
(epochs 2-3) and of the synthetic step, side by side in this process (the round-time question: is a
synthetic micro-batch of 256 dearer per image than a real batch of 64?).

A one-round probe is not the 60-round protocol: it says which arm moves the global model least away from
where no defense takes it, from the same model, on the same clients.

    python benchmarks/aegis_optimizer_state.py --scale smoke|small --threads 2
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gradleak.defenses.base import Defense
from gradleak.defenses.in_loop import build_defenses
from gradleak.experiments.benchmark import load_benchmark
from gradleak.experiments.measurement import configure_torch, make_parser, parse_args, write_result
from gradleak.experiments.runner import build_simulation
from gradleak.federation import derive_seed
from gradleak.federation.server import apply_update, weighted_mean
from gradleak.metrics.utility import top1_accuracy
from gradleak.tasks.client import train_client

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
CONFIG = HERE / "configs" / "aegis_generator_utility.toml"
NAME = "aegis_optimizer_state"
TEST_IMAGES = 2000


@dataclass(frozen=True)
class Scale:
    at: tuple[int, ...]  # rounds of the no-defense federation after which the arms are compared
    clients: int  # clients per comparison
    generator: str  # "diffusion": the config's public generator and its shared pool; "gaussian": built-in


SCALES = {
    "smoke": Scale((1,), 2, "gaussian"),
    "small": Scale((10, 22, 34), 10, "diffusion"),
    "paper": Scale((10, 16, 22, 28, 34, 40), 10, "diffusion"),
}

ARMS: dict[str, dict[str, Any] | None] = {  # Aegis options over the config's (None: no defense)
    "none": None,
    "shared": {},
    "separate": {"optimizer_state": "separate"},
    "same_lr": {"normalization": "same_lr"},
}


class _Probe(Defense):
    """Last in the chain: at each epoch end (after Aegis' synthetic step) the time and the real stream's
    Adam second moment, mean ``sqrt(v)``; first in the chain (``before``): the time before that step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.sqrt_v: list[float] = []

    def on_epoch_end(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.times.append(time.perf_counter())
        v = [s["exp_avg_sq"].flatten() for s in optimizer.state.values() if "exp_avg_sq" in s]
        self.sqrt_v.append(float(torch.cat(v).sqrt().mean()) if v else float("nan"))


def one_round(sim: Any, cids: list[int], training: Any, arm: dict[str, Any] | None, aegis: dict[str, Any],
              test: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:  # fmt: skip
    """Every client of ``cids`` trains from the global model with the arm's defense; FedAvg; accuracy."""
    updates, sqrt_v, real_s, syn_s, real_n, m = [], [], [], [], 0, 0
    for cid in cids:
        before, after = _Probe(), _Probe()
        defenses = [] if arm is None else build_defenses([("aegis", {**aegis, **arm})])
        m = defenses[0].config.cache_size if defenses else 0  # type: ignore[attr-defined]
        start = time.perf_counter()
        res = train_client(cid, sim.model, sim.clients[cid], training, [before, *defenses, after],
                           torch.Generator().manual_seed(derive_seed(cid, 0x0A5)))  # fmt: skip
        if res.update is None:
            raise RuntimeError(f"client {cid} withheld its update: {res.error}")
        ends = [start, *after.times[:-1]]  # each epoch's real steps start where the last epoch ended
        real_s.append(sum(b - a for a, b in zip(ends[1:], before.times[1:], strict=True)))  # epochs 2..E
        syn_s.append(sum(b - a for a, b in zip(before.times, after.times, strict=True)))
        real_n += (len(before.times) - 1) * len(sim.clients[cid])
        sqrt_v.append(after.sqrt_v)
        updates.append(res.update)
    model = copy.deepcopy(sim.model)
    apply_update(model, weighted_mean(updates))  # FedAvg, weights n_i
    return {
        "accuracy": top1_accuracy(model, *test),
        "adam_sqrt_v_by_epoch": np.nanmean(np.array(sqrt_v), axis=0).tolist(),
        "real_ms_per_image": 1000 * sum(real_s) / max(real_n, 1),
        "synthetic_ms_per_image": (
            1000 * sum(syn_s) / (len(cids) * len(sqrt_v[0]) * m) if arm is not None else None
        ),
    }


def run(seed: int, scale: Scale) -> dict[str, Any]:
    bench = load_benchmark(CONFIG)
    _, _, cfg = bench.configs("paper", [seed])[0]
    aegis = dict(cfg.grid.defenses[1].options)
    if scale.generator == "gaussian":
        aegis = {"cache": {"size": 256}}
    sim = build_simulation(cfg)  # the no-defense federation (the grid's defenses are the arms here)
    test = (sim.test.images[:TEST_IMAGES], sim.test.labels[:TEST_IMAGES])
    training = cfg.fl.training
    rows = []
    for r in range(max(scale.at)):
        sim.run_round(r)
        if r + 1 not in scale.at:
            continue
        rng = np.random.default_rng(derive_seed(seed, 0x57A7E, r))
        cids = sorted(rng.choice(len(sim.clients), scale.clients, replace=False).tolist())
        base = top1_accuracy(sim.model, *test)
        row: dict[str, Any] = {"after_round": r + 1, "clients": cids, "accuracy_before": base, "arms": {}}
        for name, arm in ARMS.items():
            row["arms"][name] = one_round(sim, cids, training, arm, aegis, test)
            print(f"  round {r + 1}: {name} {row['arms'][name]}", flush=True)
        none = row["arms"]["none"]["accuracy"]
        row["gap_points"] = {k: 100 * (v["accuracy"] - none) for k, v in row["arms"].items() if k != "none"}
        print(f"  round {r + 1}: gap to none (points) {row['gap_points']}", flush=True)
        rows.append(row)
    mean = {k: float(np.mean([row["gap_points"][k] for row in rows])) for k in ARMS if k != "none"}
    return {"aegis": aegis, "rows": rows, "mean_gap_points": mean}


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    args = parse_args(parser, argv)
    configure_torch(args.threads)
    scale = SCALES[args.scale]
    results = {}
    for s in args.seeds:
        print(f"{NAME} --scale {args.scale}: seed {s}, {scale}", flush=True)
        results[f"seed{s}"] = run(s, scale)
        print(f"  mean gap to none (points): {results[f'seed{s}']['mean_gap_points']}", flush=True)
    payload = {
        "setting": {
            "config": str(CONFIG.relative_to(HERE)),
            "scale": vars(scale) | {"at": list(scale.at)},
            "arms": ARMS,
            "test_images": TEST_IMAGES,
        },
        "results": results,
    }
    print(f"wrote {write_result(NAME, args.scale, payload, seeds=args.seeds, out=args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
