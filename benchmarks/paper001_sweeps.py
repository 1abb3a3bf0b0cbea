"""Shared driver of paper 001's sweep benchmarks (node count, class deficiency, matched compute).

Each sweep is a list of cells (dataset, victim, classes, attack, options); every cell runs for every seed,
the result file is rewritten after each finished victim, and the summary averages over seeds.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from _common import write_result
from paper001_common import Victim, aggregate, run_attack, victim_update


def add_steps_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", nargs="+", type=int, help="subset of the scale's local steps T")


def select_epochs(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    k: int,
    batch_size: int,
    epochs: tuple[int, ...],
) -> tuple[tuple[int, ...], str]:
    """The scale's epochs whose T is in ``--steps`` (all without it) and the result-name suffix for a
    subset ("" for all, else e.g. "_T100")."""
    chosen = tuple(e for e in epochs if not args.steps or Victim(k, batch_size, e).steps in args.steps)
    if not chosen:
        parser.error(f"--steps {args.steps}: none of the scale's T")
    if chosen == epochs:
        return chosen, ""
    return chosen, "_T" + "_".join(str(Victim(k, batch_size, e).steps) for e in chosen)


@dataclass(frozen=True)
class Cell:
    key: str  # summary key, e.g. "cifar10/T=100/m=7"
    dataset: str
    victim: Victim
    attack: str
    options: dict[str, Any] = field(default_factory=dict)
    classes: int | None = None  # client batch drawn from this many classes (CIFAR only)


def run_cells(
    name: str,
    args: argparse.Namespace,
    cells: Sequence[Cell],
    setting: dict[str, Any],
    extra: Callable[[dict[str, dict[str, Any]]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def payload() -> dict[str, Any]:
        summary = {}
        for c in cells:
            rs = [r for r in records if r["cell"] == c.key]
            if rs:
                summary[c.key] = aggregate(rs)
        out = {
            "setting": setting,
            "summary": summary,
            "wall_seconds": time.perf_counter() - t0,
            "runs": records,
        }
        if extra is not None:
            out["derived"] = extra(summary)
        return out

    groups: dict[tuple[str, Victim, int | None], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.dataset, c.victim, c.classes), []).append(c)
    for seed in args.seeds:
        for (ds, victim, classes), cs in groups.items():
            obs, truth, _ = victim_update(ds, victim, seed, classes)
            for c in cs:
                r = run_attack(c.attack, obs, truth, seed, {"max_iterations": 1000, **c.options})
                r.update(
                    {"cell": c.key, "dataset": ds, "steps": victim.steps, "k": victim.k, "classes": classes}
                )
                records.append(r)
                print(
                    f"  seed {seed} {c.key:28s} PSNR {r['psnr_mean']:6.2f} SSIM {r['ssim_mean']:.3f} "
                    f"honest {r['lsim_honest']:.4f} calib. {r['lsim_calibrated']:.4f} {r['seconds']:.0f}s",
                    flush=True,
                )
            write_result(name, args.scale, payload(), seeds=args.seeds, out=args.out)
    final = payload()
    path = write_result(name, args.scale, final, seeds=args.seeds, out=args.out)
    for key, s in final["summary"].items():
        print(
            f"{key:28s} PSNR {s['psnr_mean']:6.2f} honest {s['lsim_honest']:.4f} "
            f"calibrated {s['lsim_calibrated']:.4f}"
        )
    if "derived" in final:
        print(final["derived"])
    print(f"wrote {path}")
    return final
