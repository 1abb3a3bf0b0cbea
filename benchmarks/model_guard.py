"""The client's guard against malicious models (issue 49, item 3): detection and false alarms.

Real FedAvg federations (Dirichlet non-IID, every client every round) over several data sets, models and
seeds (:mod:`gradleak.experiments.guard_trials`): before every round each client's guard checks the global
model on its own data (an alarm is a false alarm); at the first round, mid-training and after the last,
a malicious server sends each client a model rewritten by each attack that keeps the client's architecture
(Robbing the Fed's and LOKI's bins in the first linear layer, trap weights, class fishing) and two
adaptive evasions (noisy bins, trap weights with random halves); a refusal is a detection. Counted with
exact one-sided 95 % bounds, with and without a trusted initial model (``--untrusted-start``).

    python benchmarks/model_guard.py --scale smoke|small|paper [--seeds S ...] [--untrusted-start]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from gradleak.experiments.guard_trials import GuardSetting, run_trial, summarise
from gradleak.experiments.measurement import make_parser, parse_args, write_result

HERE = Path(__file__).resolve().parent
NAME = "model_guard"
SETTINGS = {  # (data set, model) pairs and rounds per scale
    "smoke": ([("femnist", "mlp")], 2),
    "small": ([("femnist", "mlp"), ("femnist", "sme_cnn"), ("cifar10", "aegis_cnn")], 6),
    "paper": (
        [
            ("femnist", "mlp"), ("femnist", "sme_cnn"), ("femnist", "lenet"),
            ("cifar10", "mlp"), ("cifar10", "aegis_cnn"), ("cifar10", "sme_cifar_cnn"),
            ("organamnist", "mlp"), ("organamnist", "sme_cnn"), ("pathmnist", "aegis_cnn"),
        ],
        12,
    ),
}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], HERE / "results")
    parser.add_argument(
        "--untrusted-start", action="store_true", help="clients do not know the initial model"
    )
    args = parse_args(parser, argv)
    if args.seeds == [0] and args.scale == "paper":
        args.seeds = [0, 1, 2, 3, 4]
    torch.set_num_threads(args.threads or 1)
    logging.disable(logging.WARNING)  # a false alarm is logged; the counts are the result
    pairs, rounds = SETTINGS[args.scale]
    start = time.perf_counter()
    trials = [
        run_trial(
            GuardSetting(d, m, seed, rounds=rounds, trusted_start=not args.untrusted_start), progress=True
        )
        for d, m in pairs
        for seed in args.seeds
    ]
    summary = summarise(trials)
    h = summary["honest"]
    print(
        f"honest: {h['models_with_an_alarm']} alarms on {h['models_checked']} models "
        f"(95% upper bound {h['false_alarm_rate_95_upper']:.2%}), "
        f"max honest drift {h['max_honest_drift']:.3f}"
    )
    for label, a in summary["attacks"].items():
        lower = a["detection_rate_95_lower"]
        print(f"{label}: refused {a['refused']}/{a['checked']} (95% lower {lower:.1%}), "
              f"checks {a['checks_fired']}, leak {a['mean_share_recovered']}")  # fmt: skip
    payload = {
        "trusted_start": not args.untrusted_start,
        "settings": [f"{d}/{m}" for d, m in pairs],
        "rounds": rounds,
        "seconds": time.perf_counter() - start,
        "summary": summary,
        "per_trial": [t.as_dict() for t in trials],
    }
    name = NAME if not args.untrusted_start else f"{NAME}_untrusted_start"
    path = write_result(name, args.scale, payload, seeds=args.seeds, out=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
