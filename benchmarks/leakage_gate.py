"""The client's leakage gate (issue 49, item 4): recall, false triggers and cost on a labelled set.

Client updates (FedSGD on the client's batch) over data sets, models, seeds, batch sizes and client
defenses (none, pruning 50 % / 99 %, update noise), each labelled by the full attack (Inverting Gradients
at ``--full-iterations``) through the audit pipeline and floors: leaky when its leakage above the floor
exceeds the gate's threshold (3 dB by default). The gate decides from its fast attack (IG at 100
iterations) on the same update (:mod:`gradleak.experiments.gate_trials`). Reported: recall and
false-trigger rate with exact one-sided 95 % bounds, the gate's seconds beside the client's training
seconds (its share of the client's round), and a threshold sweep.

    python benchmarks/leakage_gate.py --scale smoke|small|paper [--seeds S ...] [--full-iterations N]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from gradleak.audit.gate import GateConfig
from gradleak.experiments.gate_trials import CLIENT_DEFENSES, SCALES, items_for, run_items, summarise
from gradleak.experiments.measurement import make_parser, parse_args, write_result

HERE = Path(__file__).resolve().parent
NAME = "leakage_gate"
SETTINGS = SCALES  # the labelled set per scale, shared with the other labelled-set benchmark


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], HERE / "results")
    parser.add_argument("--full-iterations", type=int, default=None, help="IG iterations of the label attack")
    args = parse_args(parser, argv)
    if args.seeds == [0] and args.scale == "paper":
        args.seeds = [0, 1]
    torch.set_num_threads(args.threads or 1)
    logging.disable(logging.WARNING)  # every trigger is logged; the counts are the result
    pairs, batches, full = SETTINGS[args.scale]
    full = args.full_iterations or full
    config = GateConfig()
    start = time.perf_counter()
    outcomes = run_items(items_for(pairs, args.seeds, batches, list(CLIENT_DEFENSES)), config=config,
                         full_iterations=full, progress=True)  # fmt: skip
    summary = summarise(outcomes, config.threshold_db)
    s = summary
    print(f"{s['updates']} updates, {s['leaky']} leaky: recall {s['recall']:.1%} "
          f"(95% lower {s['recall_95_lower']:.1%}), false triggers {s['false_trigger_rate']:.1%} "
          f"(95% upper {s['false_trigger_rate_95_upper']:.1%}), gate {s['gate_seconds_mean']:.2f} s "
          f"= {s['gate_share_of_round_mean']:.0%} of the client's round")  # fmt: skip
    payload = {
        "settings": [f"{d}/{m}" for d, m in pairs],
        "batches": batches,
        "client_defenses": {k: [list(x) for x in v] for k, v in CLIENT_DEFENSES.items()},
        "gate": {
            "attack": [config.attack.name, dict(config.attack.options)],
            "threshold_db": config.threshold_db,
            "defenses": [list(d) for d in config.defenses],
        },  # fmt: skip
        "full_attack": ["ig", {"max_iterations": full}],
        "seconds": time.perf_counter() - start,
        "summary": summary,
        "per_update": [o.as_dict() for o in outcomes],
    }
    path = write_result(NAME, args.scale, payload, seeds=args.seeds, out=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
