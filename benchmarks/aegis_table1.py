"""Paper 000 Table 1 / Table A.4 analogue: round wall-clock of Aegis and baseline defenses, and accuracy.

Paper 000's FL protocol on OrganAMNIST (default): 100 label-skew clients (at most 5 classes), 10 % sampled
per round, FedAvg with Adam lr 1e-3, E = 3, B = 64, the honest ``aegis_cnn``. Every client trains on its
whole share (~350 images). Per sampled client and defense we time its local training
(``train_client``); a round's time is the sum over its sampled clients (clients run sequentially, as on
the paper's single workstation). Reported:

- utility (paper recipe, Adam): test accuracy after ``rounds`` rounds, no defense vs Aegis (M = 2048,
  lambda weighting), same seeds and sampled clients;
- Table 1 analogue: round time of Aegis, gradient compression, DP noise and Soteria as ratios to no
  defense, measured on the same clients in round 1 (Soteria: its first ``--soteria-clients`` clients only,
  ratio per client); and the compute-bound Aegis ratio ``(N_real + M) / N_real`` per client;
- the one-time cache cost (generator fit + candidate generation + acceptance), separately.

    python benchmarks/aegis_table1.py --scale smoke|small|paper --threads 1 [--datasets organamnist]
        [--rounds R] [--utility-only] [--resume | --restart]
        [--components 32 | --cache-source oracle] [--tag NAME]

``--components`` sets the built-in generator's PCA directions per class; ``--cache-source oracle`` replaces
the generator by real images of the client's labels held by other clients (``aegis_table2.oracle_cache``, a
diagnostic of Aegis' cost with a perfect generator, not a defense); give either a ``--tag``.

Both models are saved after every round under ``benchmarks/.state/``; ``--resume`` continues a stopped run
(or extends a finished one to a larger ``--rounds``) with the rounds an uninterrupted run would give; a run
that finds a saved state stops unless ``--resume`` or ``--restart`` (discard it) is given.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from aegis_table2 import client_cache, oracle_cache, other_clients
from gradleak.data import ImageDataset, load_dataset
from gradleak.defenses.aegis_cache import SyntheticCache
from gradleak.defenses.aegis_synthetic import aegis_for_client
from gradleak.defenses.base import Defense
from gradleak.fl import apply_update, derive_seed, evaluate, sample_clients, weighted_mean
from gradleak.fl.client import train_client
from gradleak.generators import GaussianGeneratorConfig
from gradleak.models import build_model
from gradleak.registry import DEFENSES
from gradleak.types import LocalTraining
from linear_leakage import MODEL, NUM_CLIENTS, client_pool

from _common import (
    STATE_DIR,
    configure_torch,
    load_state,
    make_parser,
    parse_args,
    save_state,
    summarize,
    write_result,
)

NAME = "aegis_table1"
M = 2048
ADAM = LocalTraining("fedavg", epochs=3, batch_size=64, lr=1e-3, optimizer="adam")
ROUNDS = {"smoke": 2, "small": 5, "paper": 20}
PAPER_TABLE1 = {  # seconds for the whole training run (MNIST 100 rounds, CIFAR-10 150 rounds)
    "MNIST": {"none": 290.5, "aegis": 1890.1, "compression": 334.5, "dp_noise": 4622.4, "soteria": 19816.2},
    "CIFAR-10": {
        "none": 433.1,
        "aegis": 2339.3,
        "compression": 512.1,
        "dp_noise": 8356.8,
        "soteria": 32482.0,
    },
}
PAPER_ACC = {"organamnist": (58.6, 58.8), "pathmnist": (57.3, 57.2)}  # Table A.4 (none, Aegis)
BASELINES = ("compression", "dp_noise", "soteria")


def timed(
    model: nn.Module, cid: int, data: ImageDataset, defenses: list[Defense], seed: int, rnd: int
) -> Any:
    t0 = time.perf_counter()
    res = train_client(
        cid, model, data, ADAM, defenses, torch.Generator().manual_seed(derive_seed(seed, rnd, cid))
    )
    if res.update is None:
        raise RuntimeError(f"client {cid} withheld its update: {res.error}")
    return res, time.perf_counter() - t0


def tail_mean(rounds_out: Sequence[dict[str, Any]], key: str, last: int) -> float:
    """Mean test accuracy of the last ``last`` rounds (early non-IID FedAvg rounds swing by 10-20 points)."""
    xs = [r[key] for r in rounds_out[-last:]]
    return sum(xs) / len(xs)


def federation(name: str, seed: int) -> tuple[ImageDataset, list[np.ndarray], nn.Module]:
    """Paper 000's federation for ``seed``: the training pool, its 100 label-skew client index sets (<= 5
    classes each) and the initial ``aegis_cnn`` (shared by the utility run and ``aegis_cache_utility``)."""
    pool, parts, _, _ = client_pool(name, seed)
    init = build_model(MODEL, pool.input_shape, pool.num_classes, seed=derive_seed(seed, 0x30DE))
    return pool, parts, init


CACHE_SOURCES = ("gaussian", "oracle")


def run(
    name: str,
    seed: int,
    rounds: int,
    soteria_clients: int,
    baselines: bool = True,
    last: int = 5,
    checkpoint: Callable[[list[dict[str, Any]]], None] | None = None,
    state_path: Path | None = None,
    resume: bool = False,
    restart: bool = False,
    generator: GaussianGeneratorConfig | None = None,
    cache_source: str = "gaussian",
) -> dict[str, Any]:
    """Train both models for ``rounds`` rounds; with ``state_path`` save both after every round.

    ``resume`` continues from the rounds saved at ``state_path`` (the same dataset, seed and settings; the
    round count may grow): the models are reloaded and the client sampler is replayed, so a resumed run
    gives the rounds an uninterrupted one would (everything else is seeded per round and client). A saved
    state is never overwritten by a new run unless ``restart``. ``generator`` configures the built-in
    cache generator (default: ``GaussianGeneratorConfig()``); ``cache_source="oracle"`` replaces the
    generator by :func:`oracle_cache` (a diagnostic).
    """
    if cache_source not in CACHE_SOURCES:
        raise ValueError(f"cache_source must be one of {CACHE_SOURCES}, got {cache_source!r}")
    generator = generator or GaussianGeneratorConfig()
    pool, parts, init = federation(name, seed)
    test = load_dataset(name, "test")
    shares = {i: pool.subset(np.sort(p)) for i, p in enumerate(parts)}
    models = {"none": copy.deepcopy(init), "aegis": copy.deepcopy(init)}
    caches: dict[int, SyntheticCache] = {}
    cache_stats: dict[int, dict[str, Any]] = {}
    rng = np.random.default_rng(derive_seed(seed, 0x5A11))
    rounds_out: list[dict[str, Any]] = []
    baseline_rows: list[dict[str, Any]] = []
    meta = {"benchmark": NAME, "dataset": name, "seed": seed, "cache": M, "training": repr(ADAM)}
    meta |= {"baselines": baselines, "soteria_clients": soteria_clients, "model": MODEL}
    if generator != GaussianGeneratorConfig():  # states saved before this key existed used the default
        meta["generator"] = repr(generator)
    if cache_source != "gaussian":
        meta["cache_source"] = cache_source
    if state_path is not None and state_path.exists() and not (resume or restart):
        raise FileExistsError(f"{state_path} holds a saved run: --resume it, or --restart to discard it")
    saved = load_state(state_path, meta) if (resume and state_path is not None) else None
    if saved is not None:
        rounds_out, baseline_rows, cache_stats = saved["rounds"], saved["baseline_rows"], saved["cache_stats"]
        for label, model in models.items():
            model.load_state_dict(saved["models"][label])
        for _ in rounds_out:  # replay the sampler to where the saved run stopped
            sample_clients(NUM_CLIENTS, 0.1, rng)
        if len(rounds_out) > rounds:
            raise ValueError(f"{state_path} already holds {len(rounds_out)} rounds; ask for >= that many")
        print(f"  {name} seed {seed}: resumed after round {len(rounds_out) - 1} ({state_path})", flush=True)
    for rnd in range(len(rounds_out), rounds):
        sampled = sample_clients(NUM_CLIENTS, 0.1, rng)
        row: dict[str, Any] = {"round": rnd, "clients": sampled, "seconds": {"none": 0.0, "aegis": 0.0}}
        for cid in sampled:
            if cid not in caches:
                caches[cid] = (
                    oracle_cache(
                        pool.subset(other_clients(pool, parts[cid]).numpy()), shares[cid], M, seed, cid
                    )
                    if cache_source == "oracle"
                    else client_cache(shares[cid], M, seed, cid, generator_config=generator)
                )
                cache_stats.setdefault(cid, caches[cid].stats)
        for label, model in models.items():
            updates = []
            for cid in sampled:
                defenses: list[Defense] = [] if label == "none" else [aegis_for_client(caches[cid])]
                res, sec = timed(model, cid, shares[cid], defenses, seed, rnd)
                row["seconds"][label] += sec
                updates.append(res.update)
                if rnd == 0:
                    baseline_rows.append(
                        {"client": cid, "defense": label, "seconds": sec, "n_real": len(shares[cid])}
                    )
            apply_update(model, weighted_mean(updates))
            row[f"acc_{label}"] = evaluate(model, test.images, test.labels)
        if rnd == 0 and baselines:  # baselines: the same clients, the same broadcast model (the initial one)
            for b in BASELINES:
                for j, cid in enumerate(sampled):
                    if b == "soteria" and j >= soteria_clients:
                        break
                    _, sec = timed(init, cid, shares[cid], [DEFENSES.create(b)], seed, rnd)
                    baseline_rows.append(
                        {"client": cid, "defense": b, "seconds": sec, "n_real": len(shares[cid])}
                    )
        print(
            f"  {name} round {rnd}: acc none {row['acc_none']:.4f} aegis {row['acc_aegis']:.4f} | seconds "
            f"none {row['seconds']['none']:.1f} aegis {row['seconds']['aegis']:.1f}",
            flush=True,
        )
        rounds_out.append(row)
        if state_path is not None:
            models_state = {k: m.state_dict() for k, m in models.items()}
            save_state(
                state_path,
                meta,
                {"rounds": rounds_out, "baseline_rows": baseline_rows, "cache_stats": cache_stats}
                | {"models": models_state},
            )
        if checkpoint is not None:
            checkpoint(rounds_out)
    per_client: dict[str, dict[int, float]] = {}
    for r in baseline_rows:
        per_client.setdefault(r["defense"], {})[r["client"]] = r["seconds"]
    ratios = {}
    for d, times in per_client.items():
        if d == "none":
            continue
        rs = [t / per_client["none"][c] for c, t in times.items()]
        ratios[d] = {"median": statistics.median(rs), "per_client": rs, "clients": len(rs)}
    sizes = {r["client"]: r["n_real"] for r in baseline_rows}
    bound = [(n + M) / n for n in sizes.values()]
    return {
        "rounds": rounds_out,
        "client_timings_round0": baseline_rows,
        "ratio_to_none": ratios,
        "aegis_compute_bound_ratio": {"median": statistics.median(bound), "per_client": bound},
        "final_acc": {"none": rounds_out[-1]["acc_none"], "aegis": rounds_out[-1]["acc_aegis"]},
        "last_rounds_mean_acc": {
            "rounds": min(last, len(rounds_out)),
            "none": tail_mean(rounds_out, "acc_none", last),
            "aegis": tail_mean(rounds_out, "acc_aegis", last),
        },
        "round_seconds": {k: summarize([r["seconds"][k] for r in rounds_out]) for k in ("none", "aegis")},
        "cache_one_time_seconds": summarize(
            [c["seconds"] + c["generator_fit_seconds"] for c in cache_stats.values()]
        ),
        "cache_rejection_rate": summarize([c["rejection_rate"] for c in cache_stats.values()]),
        "paper_acc_none_aegis": PAPER_ACC.get(name),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["organamnist"])
    parser.add_argument("--soteria-clients", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=None, help="override the scale's round count")
    parser.add_argument("--utility-only", action="store_true", help="skip the baseline timings")
    parser.add_argument("--last", type=int, default=5, help="report the mean accuracy of the last N rounds")
    parser.add_argument(
        "--resume",
        action="store_true",
        help=f"continue each seed from its state in {STATE_DIR.name}/ (saved after every round)",
    )
    parser.add_argument("--restart", action="store_true", help="discard saved states and start again")
    parser.add_argument(
        "--components",
        type=int,
        default=GaussianGeneratorConfig.components,
        help="PCA directions per class of the built-in cache generator",
    )
    parser.add_argument(
        "--cache-source",
        choices=CACHE_SOURCES,
        default="gaussian",
        help="oracle: real images of other clients instead of generated ones (a diagnostic, not a defense)",
    )
    parser.add_argument("--tag", default="", help="suffix of the result and state file names")
    args = parse_args(parser, argv)
    threads = configure_torch(args.threads)
    rounds = args.rounds or ROUNDS[args.scale]
    print(f"{NAME} --scale {args.scale}: {rounds} rounds, seeds {args.seeds}, threads {threads}", flush=True)
    name = NAME + (f"_utility_r{rounds}" if args.utility_only else "")
    if args.seeds != [0]:  # other seeds get their own file instead of overwriting seed 0's
        name += "_seeds" + "-".join(str(s) for s in args.seeds)
    if args.tag:
        name += f"_{args.tag}"
    generator = GaussianGeneratorConfig(components=args.components)
    results: dict[str, Any] = {}

    def setting() -> dict[str, Any]:
        return {
            "model": MODEL,
            "training": "FedAvg Adam lr 1e-3, E=3, B=64 (paper 000)",
            "cache": M,
            "generator": {"kind": args.cache_source}
            | ({"components": generator.components} if args.cache_source == "gaussian" else {}),
            "clients": NUM_CLIENTS,
            "fraction": 0.1,
            "rounds": rounds,
            "last_rounds_mean": args.last,
            "baselines": {b: str(DEFENSES.make_config(b)) for b in BASELINES},
        }

    for s in args.seeds:
        for n in args.datasets:
            key = f"{n}/seed{s}"

            def checkpoint(rows: list[dict[str, Any]], key: str = key) -> None:  # partial results, per round
                partial = {**results, key: {"partial": True, "rounds": rows}}
                payload = {"setting": setting(), "paper_table1_seconds": PAPER_TABLE1, "results": partial}
                write_result(name, args.scale, payload, seeds=args.seeds, out=args.out)

            tag = f"_{args.tag}" if args.tag else ""
            kind = "utility" if args.utility_only else "full"
            state = STATE_DIR / f"{NAME}_{n}_seed{s}_{kind}{tag}.safetensors"
            results[key] = run(
                n,
                s,
                rounds,
                args.soteria_clients,
                not args.utility_only,
                args.last,
                checkpoint,
                state_path=state,
                resume=args.resume,
                restart=args.restart,
                generator=generator,
                cache_source=args.cache_source,
            )
    for key, r in results.items():
        print(
            key,
            {d: round(v["median"], 2) for d, v in r["ratio_to_none"].items()},
            "bound",
            round(r["aegis_compute_bound_ratio"]["median"], 2),
            "acc",
            r["final_acc"],
            f"mean of last {args.last}",
            r["last_rounds_mean_acc"],
        )
    payload = {"setting": setting(), "paper_table1_seconds": PAPER_TABLE1, "results": results}
    print(f"wrote {write_result(name, args.scale, payload, seeds=args.seeds, out=args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
