"""Privacy/utility plane of paper 002's Figures 3/4 from the committed AEGIS benchmark results.

Reads ``aegis_llm_privacy_<model>_<scale>.json`` (ROUGE-1 per defense and probe) and
``aegis_llm_utility_<model>_<scale>.json`` (perplexity or accuracy per defense) for each pretrained model that
has both, and draws one panel per model: x = the best attack's R-1 (the maximum over the probes run on that
defense of the mean over data sets: DAGER, embedding norm and MLP-SVD for AEGIS variants, DAGER alone for the
baselines), y = the utility metric, one point per defense. The paper's ideal region is R-1 < 0.05 at utility
no worse than undefended. Writes ``benchmarks/results/aegis_llm_pareto_<scale>.png`` and a JSON table of the
points. No training happens here.

    python benchmarks/aegis_llm_pareto.py --scale small
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gradleak.experiments.measurement import make_parser, parse_args, write_result  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
NAME = "aegis_llm_pareto"
MODELS = {"smollm2": "perplexity", "minilm": "accuracy"}


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS_DIR / "legacy" / name  # the former scripts' per-model results
    return json.loads(path.read_text())["result"] if path.exists() else None


def points(model: str, scale: str) -> list[dict[str, Any]]:
    privacy = _load(f"aegis_llm_privacy_{model}_{scale}.json")
    utility = _load(f"aegis_llm_utility_{model}_{scale}.json")
    if privacy is None or utility is None:
        return []
    by_probe: dict[str, dict[str, list[float]]] = {}
    for c in privacy["summary"]:
        by_probe.setdefault(c["defense"], {}).setdefault(c["probe"], []).append(c["rouge1"])
    metric = MODELS[model]
    util = {r["setting"]: r[metric] for r in utility["rows"] if metric in r}
    out = []
    for d, probes in by_probe.items():
        if d in util:
            means = {p: statistics.fmean(v) for p, v in probes.items()}
            best = max(means, key=lambda p: means[p])
            out.append({"model": model, "defense": d, "best_rouge1": means[best], "best_probe": best,
                        "dager_rouge1": means.get("dager"), metric: util[d]})  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(make_parser(__doc__.splitlines()[0], RESULTS_DIR), argv)
    table = {m: points(m, args.scale) for m in MODELS}
    table = {m: p for m, p in table.items() if p}
    if not table:
        raise SystemExit(f"no model has both privacy and utility results at scale {args.scale!r}")
    fig, axes = plt.subplots(1, len(table), figsize=(5.5 * len(table), 4.2), squeeze=False)
    for ax, (model, pts) in zip(axes[0], table.items(), strict=True):
        metric = MODELS[model]
        for p in pts:
            color = "tab:green" if p["defense"].startswith("aegis") else "tab:gray"
            ax.scatter(p["best_rouge1"], p[metric], color=color)
            ax.annotate(p["defense"], (p["best_rouge1"], p[metric]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")  # fmt: skip
        base = next((p[metric] for p in pts if p["defense"] == "none"), None)
        if base is not None:
            ax.axhline(base, color="tab:red", lw=0.8, ls="--", label="undefended utility")
        ax.axvline(0.05, color="tab:blue", lw=0.8, ls=":", label="broken attack (R-1 0.05)")
        ax.set_xlabel("best attack ROUGE-1 (lower = more private)")
        ax.set_ylabel(f"{metric} ({'lower' if metric == 'perplexity' else 'higher'} = better)")
        ax.set_title(f"{model} ({args.scale} scale)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    png = RESULTS_DIR / f"{NAME}_{args.scale}.png"
    fig.savefig(png, dpi=120)
    path = write_result(
        NAME, args.scale, {"figure": png.name, "points": table}, seeds=args.seeds, out=args.out
    )
    print(f"wrote {png} and {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
