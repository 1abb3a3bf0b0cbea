"""FL at scale on both engines: rounds per second and peak memory for 100 and 1,000 virtual clients.

Setting (paper 000's federation): OrganAMNIST train (34,581 CT slices), label-skew split into N clients with
at most 5 organs each, ``aegis_cnn``, FedAvg (Adam 1e-3, batch 64, one local epoch), 10 clients per round
(``fl.fraction = 10 / N``), test accuracy after the last round only, no audit. Each cell (N, engine) is
one ``gradleak`` experiment config run by :func:`gradleak.experiments.run_experiment`, in a fresh
subprocess, so that its peak memory is its own: the parent samples the resident memory of the subprocess
and all its descendants (Ray's GCS, raylet and workers included) every 0.2 s and keeps the maximum.

Reported per cell: rounds per second (rounds / the rounds' own wall time), the median round time, the
start-up time (everything before the first round: data, partition; on Flower also Ray and the SuperNodes'
registration), the peak memory, and the test accuracy (both engines must agree: the same seed gives the same
federation). The two engines of one N run one after the other, in alternating order across N.

    python benchmarks/flower_scale.py --scale smoke|small|paper [--seed S]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from gradleak.experiments.measurement import make_parser, parse_args, write_result

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
NAME = "flower_scale"
PER_ROUND = 10
SAMPLE_EVERY = 0.2


@dataclass(frozen=True)
class Scale:
    clients: tuple[int, ...]
    rounds: int
    train_limit: int | None  # None: the whole train split


SCALES = {
    "smoke": Scale(clients=(20, 100), rounds=2, train_limit=2000),
    "small": Scale(clients=(100, 1000), rounds=3, train_limit=None),
    "paper": Scale(clients=(100, 1000), rounds=10, train_limit=None),
}


def config(num_clients: int, engine: str, rounds: int, train_limit: int | None, seed: int) -> dict[str, Any]:
    data: dict[str, Any] = {
        "dataset": "organamnist", "train_split": "train", "test_split": "test", "test_limit": 1000,
        "num_clients": num_clients, "partition": "label_skew",
        "partition_options": {"max_classes_per_client": 5},
    }  # fmt: skip
    if train_limit is not None:
        data["train_limit"] = train_limit
    return {
        "experiment": {"name": NAME, "seed": seed},
        "data": data,
        "model": {"name": "aegis_cnn"},
        "fl": {"rounds": rounds, "fraction": PER_ROUND / num_clients, "eval_every": rounds, "training": {
            "protocol": "fedavg", "epochs": 1, "batch_size": 64, "lr": 1e-3, "optimizer": "adam"}},
        "audit": {"clients": 0},
        "engine": {"name": engine, "options": {"timeout": 600.0} if engine == "flower" else {}},
    }  # fmt: skip


def cell(raw: str) -> dict[str, Any]:
    """Run one config (JSON) in this process; what the parent records."""
    import torch

    from gradleak.experiments import load_config, run_experiment

    torch.set_num_threads(1)  # as each Ray worker runs (one core per client): the same work per client
    t0 = time.perf_counter()
    out = run_experiment(load_config(json.loads(raw)))
    total = time.perf_counter() - t0
    rounds = out.of_kind("round")
    seconds = [float(r["seconds"]) for r in rounds]
    return {"round_seconds": seconds, "total_seconds": total, "startup_seconds": total - sum(seconds),
            "accuracy": rounds[-1]["accuracy"], "sampled": [r["clients"] for r in rounds],
            "dropped": [r["dropped"] for r in rounds]}  # fmt: skip


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass  # a process that ended between listing and reading
    return total


def measure(cfg: dict[str, Any]) -> dict[str, Any]:
    """One cell in a fresh subprocess, with the peak resident memory of its whole process tree."""
    report = Path(tempfile.mkdtemp()) / "cell.json"  # not stdout: Ray and Flower print there too
    child = subprocess.Popen([sys.executable, __file__, "--cell", json.dumps(cfg), "--cell-out", str(report)])
    proc, peak, done = psutil.Process(child.pid), 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_rss(proc))
            time.sleep(SAMPLE_EVERY)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    child.wait(timeout=3600)
    done.set()
    sampler.join()
    if child.returncode != 0:
        raise RuntimeError(f"cell {cfg['data']['num_clients']} clients on {cfg['engine']['name']} failed")
    result: dict[str, Any] = json.loads(report.read_text())
    seconds = result["round_seconds"]
    result.update(
        rounds_per_second=len(seconds) / sum(seconds), median_round_seconds=statistics.median(seconds),
        peak_rss_mib=peak / 2**20,
    )  # fmt: skip
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cell-out", default=None, type=Path, help=argparse.SUPPRESS)
    args = parse_args(parser, argv)
    if args.cell is not None:
        args.cell_out.write_text(json.dumps(cell(args.cell)))
        return 0
    scale, seed = SCALES[args.scale], args.seeds[0]
    print(f"{NAME} --scale {args.scale}: {scale}, seed {seed}", flush=True)
    cells: list[dict[str, Any]] = []
    for i, n in enumerate(scale.clients):
        engines = ("inprocess", "flower") if i % 2 == 0 else ("flower", "inprocess")
        for engine in engines:
            r = measure(config(n, engine, scale.rounds, scale.train_limit, seed))
            cells.append({"clients": n, "engine": engine, **r})
            print(f"  {n:>5} clients, {engine:<9}: {r['rounds_per_second']:.3f} rounds/s (median round "
                  f"{r['median_round_seconds']:.2f} s), start-up {r['startup_seconds']:.1f} s, peak "
                  f"{r['peak_rss_mib']:.0f} MiB, accuracy {r['accuracy']}", flush=True)  # fmt: skip
    by = {(c["clients"], c["engine"]): c for c in cells}
    comparisons = []
    for n in scale.clients:
        a, b = by[(n, "inprocess")], by[(n, "flower")]
        comparisons.append({
            "clients": n, "same_clients": a["sampled"] == b["sampled"],
            "same_accuracy": a["accuracy"] == b["accuracy"],
            "round_time_ratio_flower_over_inprocess": b["median_round_seconds"] / a["median_round_seconds"],
            "memory_ratio_flower_over_inprocess": b["peak_rss_mib"] / a["peak_rss_mib"],
            "startup_flower_minus_inprocess_s": b["startup_seconds"] - a["startup_seconds"],
        })  # fmt: skip
    payload = {
        "setting": {**asdict(scale), "per_round": PER_ROUND, "dataset": "organamnist/train",
                    "partition": "label_skew, <= 5 classes per client", "model": "aegis_cnn",
                    "training": "fedavg, adam 1e-3, batch 64, 1 epoch", "flower": "Ray backend, 1 CPU per "
                    "client, 2 CPUs in all, timeout 600 s", "torch_threads": 1,
                    "memory": f"peak RSS of the cell's process tree, sampled every {SAMPLE_EVERY} s"},
        "cells": cells,
        "comparisons": comparisons,
    }  # fmt: skip
    path = write_result(NAME, args.scale, payload, seeds=[seed], out=args.out)
    for c in comparisons:
        print(
            f"  {c['clients']} clients: Flower/in-process round time "
            f"x{c['round_time_ratio_flower_over_inprocess']:.2f}, memory "
            f"x{c['memory_ratio_flower_over_inprocess']:.2f}, start-up "
            f"+{c['startup_flower_minus_inprocess_s']:.1f} s, same clients {c['same_clients']}, "
            f"same accuracy {c['same_accuracy']}"
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
