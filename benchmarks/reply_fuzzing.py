"""Adversarial reply fuzzing of gradleak's Flower audit wrappers (issue 49, item 2).

Seeded hostile or malformed train replies (non-finite, mistyped or misshapen arrays, missing or extra keys,
integer buffers out of range, forged sample counts, extra or non-finite metrics, records missing or
doubled, undecodable bytes, error replies, duplicates, replies from nodes never asked) mixed with honest
ones, over many rounds of ``AuditStrategy`` around Flower's FedAvg (Flower's own round loop) and of
``LegacyAuditStrategy`` around Flower's legacy FedAvg (:mod:`gradleak.integrations.flower.fuzzing`).
Counted: federation aborts (target 0), rounds whose aggregate differs from the FedAvg of the well-formed
replies alone (target 0: no value of a rejected reply in any aggregate), malformed replies without a
rejection record naming their node and reason (target 0), well-formed replies rejected (target 0).

    python benchmarks/reply_fuzzing.py --scale smoke|small|paper [--seeds S ...]
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from gradleak.experiments.measurement import make_parser, parse_args, write_result
from gradleak.integrations.flower.fuzzing import fuzz_legacy_api, fuzz_message_api

HERE = Path(__file__).resolve().parent
NAME = "reply_fuzzing"
ROUNDS = {"smoke": 10, "small": 40, "paper": 200}  # per seed and API; 8 nodes, half the replies hostile


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], HERE / "results")
    args = parse_args(parser, argv)
    if args.seeds == [0] and args.scale != "smoke":
        args.seeds = [0, 1, 2]
    rounds = ROUNDS[args.scale]
    logging.disable(logging.WARNING)  # every rejection is logged; the counts are the result
    apis = {}
    for api, fuzz in (("message", fuzz_message_api), ("legacy", fuzz_legacy_api)):
        reports = [fuzz(seed, rounds) for seed in args.seeds]
        mutations: Counter[str] = Counter()
        for r in reports:
            mutations.update(r.mutations)
        apis[api] = {
            "replies": sum(r.replies for r in reports),
            "malformed": sum(r.malformed for r in reports),
            "well_formed": sum(r.well_formed for r in reports),
            "rounds": rounds * len(reports),
            "aborts": sum(len(r.aborts) for r in reports),
            "rounds_with_a_wrong_aggregate": sum(len(r.mismatched_rounds) for r in reports),
            "malformed_not_recorded": sum(len(r.unrecorded) for r in reports),
            "well_formed_rejected": sum(len(r.wrongly_rejected) for r in reports),
            "max_relative_aggregate_difference": max(r.max_abs_diff for r in reports),
            "seconds": sum(r.seconds for r in reports),
            "mutations": dict(sorted(mutations.items())),
            "per_seed": [r.as_dict() for r in reports],
        }
        a = apis[api]
        print(f"{api}: {a['replies']} replies ({a['malformed']} malformed) over {a['rounds']} rounds: "
              f"{a['aborts']} aborts, {a['rounds_with_a_wrong_aggregate']} wrong aggregates, "
              f"{a['malformed_not_recorded']} unrecorded, {a['well_formed_rejected']} wrongly rejected "
              f"({a['seconds']:.1f} s)")  # fmt: skip
    ok = all(
        a["aborts"] == a["rounds_with_a_wrong_aggregate"] == a["malformed_not_recorded"]
        == a["well_formed_rejected"] == 0 for a in apis.values()
    )  # fmt: skip
    payload = {"setting": {"nodes": 8, "hostile_fraction": 0.5, "rounds_per_seed": rounds,
                           "model": "FuzzNet (conv + BatchNorm + linear: float and int64 arrays)",
                           "tolerance": "relative 1e-5 of the largest entry aggregated"},
               "apis": apis, "targets_met": ok}  # fmt: skip
    path = write_result(NAME, args.scale, payload, seeds=args.seeds, out=args.out)
    print(f"wrote {path}; targets met: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
