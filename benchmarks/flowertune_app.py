"""examples/flowertune under ``flwr run`` (issue 52, item 1): what gradleak's ServerApp audit reads from a
federated LoRA fine-tuning of a causal LM when only the adapters travel, with and without the ClientApp's
defense mod.

Each arm runs the app on 4 simulated SuperNodes (Ray), 2 rounds, 2 nodes a round, every reply attacked by
``dager_lora_fedavg`` and scored against the node's sentences beside the norm-matched null (the app's
``truth=``). Arms: ``none`` (no defense) and ``update_noise`` (the app's default: clip 1, sigma 0.01).

- smoke: the GPT-2 arch tiny, r = 32, 2 sentences a node of <= 10 tokens, batch 2 (the test's setting);
- small: SmolLM2-135M with its real weights, r = 256 (DAGER's rank), 8 sentences a node of <= 24 tokens,
  batch 8 (the app's defaults).

    python benchmarks/flowertune_app.py --scale smoke|small
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from gradleak.experiments.measurement import make_parser, parse_args, write_result
from gradleak.experiments.store import ResultStore
from gradleak.experiments.verdicts import verdict
from gradleak.integrations.flower.cli_run import run_app

HERE = Path(__file__).resolve().parent
APP = HERE.parent / "examples" / "flowertune"
NAME = "flowertune_app"
SCALES = {
    "smoke": ("model='gpt2_tiny'", "lora-r=32", "lora-alpha=64", "dataset-size=8", "batch-size=2",
              "max-tokens=10"),
    "small": (),  # the app's pyproject.toml defaults
}  # fmt: skip
ARMS = ("none", "update_noise")
KEYS = ("round", "node_id", "partition_id", "rouge1", "rouge2", "exact", "floor_null_rouge1", "side_b",
        "rank_l1", "attack_seconds", "refused")  # fmt: skip


def run_arm(scale: str, defense: str, work: Path) -> dict[str, Any]:
    home = work / "flwr"
    t0 = time.perf_counter()
    done = run_app(APP, home, supernodes=4, run_config=(*SCALES[scale], f"defense='{defense}'"), timeout=3000)
    if done.returncode != 0:
        raise RuntimeError(f"flwr run failed ({done.returncode}): {done.tail(2000)}")
    store = ResultStore(home / "audit.sqlite")
    (run,) = store.runs()
    records = store.records(run.run_id, "attack")
    other = {k: len(store.records(run.run_id, k)) for k in ("rejected", "client_error", "attack_error")}
    return {"defense": defense, "wall_seconds": time.perf_counter() - t0, "other_records": other,
            "records": [{k: r.get(k) for k in KEYS} | {"verdict": verdict(r)} for r in records]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], HERE / "results")
    args = parse_args(parser, argv)
    if args.scale not in SCALES:
        parser.error(f"scales: {sorted(SCALES)}")
    arms = []
    for defense in ARMS:
        with tempfile.TemporaryDirectory() as work:
            arms.append(run_arm(args.scale, defense, Path(work)))
        r1 = [round(float(r["rouge1"]), 3) for r in arms[-1]["records"]]
        print(f"{defense}: ROUGE-1 by reply {r1}, {arms[-1]['wall_seconds']:.0f} s", flush=True)
    summary = {arm["defense"]: {"leaking_replies": sum("LEAKS" in r["verdict"] for r in arm["records"]),
                                "replies": len(arm["records"]), "wall_seconds": arm["wall_seconds"]}
               for arm in arms}  # fmt: skip
    payload = {"summary": summary, "arms": arms, "run_config": SCALES[args.scale]}
    path = write_result(NAME, args.scale, payload, seeds=args.seeds, out=args.out)
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
