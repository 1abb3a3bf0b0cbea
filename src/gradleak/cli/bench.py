"""``gradleak bench FILE --scale small``: run a benchmark config (a paper table as configs of the engine).

Every cell is validated before any work, runs through the experiment runner into one store (default
``benchmarks/.state/<name>_<scale>.sqlite``, not committed: an interrupted benchmark resumes there, finished
cells are reused) and the result JSON goes to ``--out`` (default ``benchmarks/results``), with the command,
git commit, machine, seeds and scale (:mod:`gradleak.experiments.benchmark`).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from gradleak.experiments.benchmark import SCALES, describe, load_benchmark, recompare, run_benchmark
from gradleak.experiments.store import ResultStore


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="run a benchmark config (benchmarks/configs/*.toml) at a scale")
    p.add_argument("config", help="the benchmark TOML file")
    p.add_argument("--scale", choices=SCALES, default="small")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="override the file's seeds")
    p.add_argument("--out", default="benchmarks/results", help="folder of the result JSON")
    p.add_argument(
        "--store", default=None, help="SQLite store (default: benchmarks/.state/NAME_SCALE.sqlite)"
    )
    p.add_argument("--cells", nargs="+", default=None, help="run only these cells of the scale")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="an override applied to every cell after its own (repeatable), e.g. "
                   "experiment.device=cuda")  # fmt: skip
    p.add_argument("--previous", default=None, help="folder of the committed result to compare with "
                   "(default: --out)")  # fmt: skip
    p.add_argument("--compare", default=None, metavar="RESULT", help="run nothing: compare the written "
                   "result RESULT with the committed ones again (rewrites it)")  # fmt: skip
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    bench = load_benchmark(args.config)  # run_benchmark checks every cell before the store is touched
    if args.compare:
        path = recompare(bench, Path(args.compare), Path(args.previous or args.out))
        print(f"compared {path}: {describe(path)}")
        return 0
    store_path = Path(args.store or Path("benchmarks/.state") / f"{bench.name}_{args.scale}.sqlite")
    store_path.parent.mkdir(parents=True, exist_ok=True)
    previous = Path(args.previous) if args.previous else None
    command = " ".join(["gradleak bench", args.config, "--scale", args.scale,
                        *(["--seeds", *map(str, args.seeds)] if args.seeds else []),
                        *(["--cells", *args.cells] if args.cells else []),
                        *(f"--set {shlex.quote(e)}" for e in args.extra)])  # fmt: skip
    path = run_benchmark(bench, args.scale, out=Path(args.out), store=ResultStore(store_path),
                         seeds=args.seeds, previous_dir=previous, command=command, cells=args.cells,
                         extra=args.extra)  # fmt: skip
    print(f"wrote {path}: {describe(path)}")
    return 0
