"""The audit's attack inside a ServerApp under ``flwr run`` against the same attack through ``gradleak run``.

Issue 50, item 4: beside Flower and Ray, torch's default threads oversubscribed the cores and IG ran
50-100x slower inside a ServerApp; the audit now bounds its own threads (``AuditStrategy(threads=1)``).
This measures what a user of the quickstart sees, side by side on one machine:

- route ``flower``: ``flwr run examples/flower`` (the quickstart; a local SuperLink in simulation mode,
  4 SuperNodes on Ray, one round, 2 nodes), its ServerApp attacking each reply with PI-SME at ``budget``
  iterations (``attacks="auto"`` for this FedAvg recipe);
- route ``gradleak``: ``gradleak run benchmarks/configs/base/flower_quickstart_inprocess.toml``, the same
  model (a plugin registers the quickstart's ``Net``), the same recipe, the same attack and budget, on 2
  clients.

Each attacked update's record carries the attack's own wall time (``seconds``: the attack alone, no
floors, no training) in both routes; the ratio is the median over the ServerApp's updates to the median
over the runner's, with every repetition's routes run one after the other, alternating which goes first.
Nothing else may run on the machine meanwhile.

    python benchmarks/serverapp_attack_speed.py --scale smoke|small [--repeats N]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradleak.experiments.measurement import make_parser, parse_args, write_result
from gradleak.experiments.store import ResultStore
from gradleak.integrations.flower.cli_run import run_app

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS_DIR = HERE / "results"
NAME = "serverapp_attack_speed"
APP = ROOT / "examples" / "flower"
CONFIG = HERE / "configs" / "base" / "flower_quickstart_inprocess.toml"
BIN = Path(sys.executable).parent
BUDGETS = {"smoke": 20, "small": 300, "paper": 1000}  # PI-SME iterations (300: the quickstart's default)
LIMIT = 1.5  # the bound on the ratio


def attack_seconds(store_path: Path) -> list[dict[str, Any]]:
    store = ResultStore(store_path)
    (run,) = store.runs()
    return [
        {"seconds": float(r["seconds"]), "iterations": int(r["iterations"]), "samples": int(r["num_samples"])}
        for r in store.records(run.run_id, "attack")
    ]


def flower_route(budget: int, work: Path) -> dict[str, Any]:
    home = work / "flwr"
    t0 = time.perf_counter()
    done = run_app(APP, home, supernodes=4, run_config=("num-server-rounds=1", f"audit-budget={budget}"),
                   timeout=3000)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"flwr run failed ({done.returncode}): {done.tail(2000)}")
    return {"updates": attack_seconds(home / "audit.sqlite"), "wall_seconds": time.perf_counter() - t0,
            "threads": 1, "stopped_processes": done.stopped}  # fmt: skip


def gradleak_route(budget: int, work: Path) -> dict[str, Any]:
    command = [str(BIN / "gradleak"), "--quiet", "run", "--trust-config-plugins", str(CONFIG),
               f"audit.attacks.0.max_iterations={budget}", "--out", str(work / "out")]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=3000, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"gradleak run failed ({done.returncode}): {done.stderr[-2000:]}")
    threads = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                                 capture_output=True, text=True, check=True).stdout)  # fmt: skip
    return {"updates": attack_seconds(work / "out" / "results.sqlite"),
            "wall_seconds": time.perf_counter() - t0, "threads": threads}  # fmt: skip


ROUTES = {"flower": flower_route, "gradleak": gradleak_route}


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    parser.add_argument("--repeats", type=int, default=None, help="repetitions (default: 1 smoke, 2 else)")
    args = parse_args(parser, argv)
    budget = BUDGETS[args.scale]
    repeats = args.repeats or (1 if args.scale == "smoke" else 2)
    runs: list[dict[str, Any]] = []
    for rep in range(repeats):
        order = ["flower", "gradleak"] if rep % 2 == 0 else ["gradleak", "flower"]
        for route in order:
            with tempfile.TemporaryDirectory() as work:
                result = ROUTES[route](budget, Path(work))
            runs.append({"repeat": rep, "route": route, **result})
            seconds = [round(u["seconds"], 2) for u in result["updates"]]
            print(f"repeat {rep} {route}: {seconds} s", flush=True)
    per = {r: [u["seconds"] for run in runs if run["route"] == r for u in run["updates"]] for r in ROUTES}
    for route, seconds in per.items():
        if not seconds:
            raise RuntimeError(f"route {route} attacked no update")
    ratio = statistics.median(per["flower"]) / statistics.median(per["gradleak"])
    summary = {
        "budget": budget, "attack": "pisme",
        "median_seconds": {r: statistics.median(s) for r, s in per.items()},
        "ratio_flower_over_gradleak": ratio, "limit": LIMIT, "within_limit": ratio <= LIMIT,
        "issue_before": "IG, 100 iterations on 8 images: 84-140 s per node inside a ServerApp against "
        "1.2-2.2 s with one thread (issue 50, before the audit bounded its threads)",
    }  # fmt: skip
    path = write_result(NAME, args.scale, {"summary": summary, "runs": runs}, seeds=args.seeds, out=args.out)
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
