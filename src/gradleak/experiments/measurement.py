"""Scripted measurements beside the config benchmarks (:mod:`gradleak.experiments.benchmark`): the options
and the result record of a benchmark that is a script, because what it measures is not an audit (a speed
ratio of two loops run side by side, the geometry of a client's training path, a generator's worth as
training data).

Such a script

1. parses the common options with :func:`make_parser` (``--scale``, ``--seed``/``--seeds``, ``--out``,
   ``--threads``) plus its own, and calls :func:`configure_torch`;
2. measures, and
3. calls :func:`write_result`, which records *how* the numbers were obtained (command line, git commit and
   dirty flag, machine, torch threads, seeds, scale, timestamp) next to them in ``<out>/<name>_<scale>.json``,
   written atomically.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from gradleak.fileio import atomic_write

SCALES = ("smoke", "small", "paper")

DEFAULT_SEED = 0


def make_parser(description: str, results: Path) -> argparse.ArgumentParser:
    """A parser with the options every benchmark shares (``--out`` defaults to ``results``); add the
    script's own before parsing.

    ``--seed S`` may be repeated and ``--seeds S1 S2 ...`` takes several at once; both add to
    ``args.seeds``. Use :func:`parse_args` to fill in the default seed.
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--scale", choices=SCALES, default="smoke", help="problem size (default: smoke)")
    p.add_argument(
        "--seed",
        dest="seeds",
        type=int,
        action="append",
        help=f"a run seed; repeatable (default {DEFAULT_SEED})",
    )
    p.add_argument("--seeds", dest="seeds", type=int, nargs="+", action="extend", help="several run seeds")
    p.add_argument("--out", type=Path, default=results, help=f"results folder (default: {results}/)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's own default)"
    )
    return p


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse, then normalise: ``seeds`` defaults to ``[DEFAULT_SEED]`` and loses duplicates (order kept)."""
    args = parser.parse_args(argv)
    args.seeds = list(dict.fromkeys(args.seeds)) if args.seeds else [DEFAULT_SEED]
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    return args


def timed(step: Callable[[], Any]) -> tuple[Any, float, float]:
    """``step()``'s result, its wall seconds and its CPU seconds (this process, summed over torch's threads:
    the CPU-minutes of a budget)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = step()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def configure_torch(threads: int | None) -> int:
    """Fix torch's intra-op thread count for the whole run (``None``: keep torch's default); returns it."""
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "--no-optional-locks", *args],  # read-only: never take the index lock
            cwd=Path(__file__).resolve().parent,  # the package's checkout (where the code that ran lives)
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def git_info() -> dict[str, Any]:
    """``{"commit": HEAD or None, "dirty": bool or None}``; ``dirty`` means uncommitted changes exist."""
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain")
    return {
        "commit": head.strip() if head else None,
        "dirty": None if status is None else bool(status.strip()),
    }


def machine_info() -> dict[str, Any]:
    """What the timings depend on: platform, CPUs, Python, torch build and thread settings, accelerator."""
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cuda": torch.cuda.is_available(),
        "loadavg": load_average(),
    }
    if info["cuda"]:
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none): a busy machine skews timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def command_line() -> str:
    """The command that produced this run, as a shell would need it typed."""
    return shlex.join([sys.executable, *sys.argv])


def summarize(times: Sequence[float]) -> dict[str, float]:
    """Median, mean, min, max and the quartiles of a list of durations (seconds)."""
    xs = sorted(float(t) for t in times)
    if not xs:
        raise ValueError("cannot summarize an empty list of times")

    def quantile(q: float) -> float:  # linear interpolation, as numpy's default
        pos = q * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {
        "n": len(xs),
        "median": quantile(0.5),
        "mean": sum(xs) / len(xs),
        "min": xs[0],
        "max": xs[-1],
        "q1": quantile(0.25),
        "q3": quantile(0.75),
    }


_NUMBER_LIST = re.compile(r"\[\s+(-?[0-9][-0-9.eE+]*(?:,\s+-?[0-9][-0-9.eE+]*)*)\s+\]")


def compact_number_lists(text: str) -> str:
    """Put each JSON array of plain numbers on one line (per-image lists otherwise take a line per value)."""
    return _NUMBER_LIST.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


def write_result(
    name: str,
    scale: str,
    payload: Mapping[str, Any],
    *,
    seeds: Sequence[int],
    out: Path | str,
) -> Path:
    """Write ``<out>/<name>_<scale>.json`` atomically (temp file in the same folder, then rename).

    The record holds the benchmark name, scale, seeds, UTC timestamp, exact command line, git commit and
    dirty flag, machine description and, under ``"result"``, the benchmark's own ``payload``.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": name,
        "scale": scale,
        "seeds": [int(s) for s in seeds],
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": command_line(),
        "git": git_info(),
        "machine": machine_info(),
        "result": dict(payload),
    }
    text = compact_number_lists(json.dumps(record, indent=2, allow_nan=False)) + "\n"
    target = folder / f"{name}_{scale}.json"
    return atomic_write(target, lambda tmp: tmp.write_text(text, encoding="utf-8"))
