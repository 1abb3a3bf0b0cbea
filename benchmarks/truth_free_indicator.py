"""The truth-free leakage indicator (issue 50, item 2): its rank correlation and AUC against the truth.

The leakage gate's labelled set of client updates (data sets, models, seeds, batch sizes 1-8, client
defenses none / pruning 50 % / 99 % / update noise), each scored by the full attack with the client's data
and floors (IG at 1,000 iterations: leakage over the higher floor, dB) and, without data, by the fast
attack's fit margin over a norm-matched null update (IG at 100 iterations)
(:mod:`gradleak.experiments.indicator_trials`). Reported: Spearman's rho and the AUC for "leaks" (> 3 dB).

    python benchmarks/truth_free_indicator.py --scale smoke|small|paper [--seeds S ...]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from gradleak.experiments.gate_trials import CLIENT_DEFENSES, SCALES, items_for
from gradleak.experiments.indicator_trials import run_items, summarise
from gradleak.experiments.measurement import make_parser, parse_args, write_result

HERE = Path(__file__).resolve().parent
NAME = "truth_free_indicator"
SETTINGS = SCALES  # the labelled set per scale, shared with the other labelled-set benchmark


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], HERE / "results")
    args = parse_args(parser, argv)
    if args.seeds == [0] and args.scale != "smoke":
        args.seeds = [0, 1]
    torch.set_num_threads(args.threads or 1)
    logging.disable(logging.WARNING)
    pairs, batches, full = SETTINGS[args.scale]
    start = time.perf_counter()
    outcomes = run_items(
        items_for(pairs, args.seeds, batches, list(CLIENT_DEFENSES)), full=full, progress=True
    )
    summary = summarise(outcomes)
    print(f"{summary['scored']} updates scored, {summary['leaky']} leaky: Spearman {summary['spearman']}, "
          f"AUC {summary['auc']}")  # fmt: skip
    payload = {
        "settings": [f"{d}/{m}" for d, m in pairs], "batches": batches, "full_iterations": full,
        "fast_iterations": 100, "seconds": time.perf_counter() - start, "summary": summary,
        "per_update": [o.as_dict() for o in outcomes],
    }  # fmt: skip
    path = write_result(NAME, args.scale, payload, seeds=args.seeds, out=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
