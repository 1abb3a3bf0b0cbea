"""The audit report: one self-contained HTML page (inline CSS, images embedded, no script, no network).

For one run or the cells of a grid (runs of the same federation with different defenses): the setup in
plain words (threat model, data, model, FL recipe, defenses, attacks, seeds, code version), a verdict table
per defense x attack whose headline is the leakage above the null floor (:mod:`gradleak.metrics.floors`)
with the raw scores, utility and cost beside it, each column explained, the reconstruction figures, and
what the numbers do not promise.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradleak.experiments.config import ComponentSpec, cell_label
from gradleak.experiments.store import ResultStore, RunRow

CSS = """
body { font-family: sans-serif; max-width: 72rem; margin: 2rem auto; color: #111; line-height: 1.4; }
table { border-collapse: collapse; margin: 1rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #888; padding: 0.3rem 0.5rem; text-align: right; }
th { background: #eee; } td.name { text-align: left; }
.legend li { margin: 0.2rem 0; } figure { margin: 1rem 0; }
img { max-width: 100%; image-rendering: pixelated; }
.note { background: #f6f6f6; border-left: 4px solid #555; padding: 0.5rem 1rem; }
"""

COLUMNS = (
    ("defense", "the cell's defense (none: no defense)"),
    ("attack", "the attack and its options"),
    ("updates", "attacked updates (clients, or secure-aggregation sums) the row averages"),
    ("PSNR over floor", "headline leakage: the reconstructions' mean PSNR minus the higher null floor, dB "
     "(> 0: the attack learned something from the update; mean +- standard deviation over the updates)"),
    ("RR over floor", "share of images reconstructed above 18 dB, minus the same share for the higher floor"),
    ("PSNR", "mean PSNR of the optimally matched reconstructions, dB (100 dB = identical images)"),
    ("SSIM", "structural similarity of the matched reconstructions (1 = identical)"),
    ("RR", "reconstruction rate: share of the client's images reconstructed above 18 dB"),
    ("floors (PSNR)", "what needs no update: each image's public class-mean image / a random public image of "
     "its class, scored the same way"),
    ("label acc", "share of the true labels the attack recovered"),
    ("test acc", "the global model's test accuracy after the rounds (utility)"),
    ("cost", "FL time over the no-defense cell's, same machine and code (n/a without a none cell); a ratio "
     "of wall times, noisy for short runs or on a busy machine"),
)  # fmt: skip

MALICIOUS = {"robbing_the_fed", "loki", "scale_mia"}  # the model-modifying attacks (docs/threat-models.md)

CAVEATS = (
    "Each number is measured on the audited clients of this run; it is evidence about this deployment's "
    "recipe, not a bound for other data, models or attacks.",
    "Aegis and AEGIS give no formal privacy guarantee: they are tested against the attacks listed here.",
    "Secure aggregation hides individual updates, not the aggregate: an attack on the sum is shown as such.",
    "Differential-privacy noise here is tuned per experiment; no (epsilon, delta) is claimed unless stated.",
    "PSNR is capped at 100 dB (identical images).",
)


KEYS = (
    "psnr_mean_beyond_floor",
    "reconstruction_rate_beyond_floor",
    "psnr_mean",
    "ssim_mean",
    "reconstruction_rate",
    "floor_class_mean_psnr_mean",
    "floor_random_psnr_mean",
    "label_accuracy",
)


def _mean_sd(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} &plusmn; {sd:.2f}"


def _values(records: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), int | float)]


def _defense_label(config: dict[str, Any]) -> str:
    specs = [ComponentSpec(d["name"], d.get("options", {})) for d in config.get("defenses") or []]
    return " + ".join(cell_label(s) for s in specs) or "none"


def _attack_label(spec: dict[str, Any]) -> str:
    return cell_label(ComponentSpec(spec["name"], spec.get("options", {})))


def setup_text(run: RunRow) -> list[str]:
    """The run's setup in plain words."""
    c, env = run.config, run.environment
    data, fl, audit, model = c["data"], c["fl"], c["audit"], c["model"]
    tr, at = fl["training"], audit["training"]
    secure = "only the sum of the round's updates (secure aggregation)" if fl.get("secure_aggregation") else (
        "every sampled client's update")  # fmt: skip
    names = {a["name"] for a in audit["attacks"]}
    control = (
        "it may modify the model it broadcasts (a malicious server)"
        if names & MALICIOUS
        else "it follows the protocol and analyses what it receives (honest-but-curious)"
    )
    return [
        f"Threat model: the server sees {secure}; {control}.",
        f"Data: {data['dataset']}, {data['num_clients']} clients, partition {data['partition']} "
        f"{data.get('partition_options') or ''}.",
        f"Model: {model['name']}. FL: {fl['rounds']} rounds, {fl['fraction']:.0%} of clients per round, "
        f"{tr['protocol']} ({tr.get('optimizer', 'sgd')}, lr {tr['lr']}, batch {tr['batch_size']}, "
        f"{tr.get('epochs', 1)} epoch(s)).",
        f"Audit: {audit['clients']} sampled client(s), {at['protocol']} on batches of {at['batch_size']}; "
        f"recipe {'known' if audit.get('training_public', True) else 'hidden'} to the attacker; labels "
        f"{'granted' if audit.get('grant_labels') else 'recovered by the attack'}.",
        f"Attacks: {', '.join(_attack_label(a) for a in audit['attacks'])}. Seed {c['experiment']['seed']}. "
        f"Code: gradleak commit {env.get('git_commit', 'unknown')[:12]}, torch {env.get('torch', '?')}.",
    ]  # fmt: skip


def verdict_rows(store: ResultStore, runs: Sequence[RunRow]) -> list[dict[str, Any]]:
    """One row per run (defense) and attack, from the stored records."""
    base = None
    for run in runs:
        if _defense_label(run.config) == "none":
            base = _fl_seconds(store, run)
    rows = []
    for run in runs:
        records = store.records(run.run_id)
        summary = next((r for r in records if r["kind"] == "summary"), {})
        seconds = _fl_seconds(store, run)
        for i, spec in enumerate(run.config["audit"]["attacks"]):
            att = [r for r in records if r["kind"] == "attack" and r.get("cell") == i]
            rows.append({
                "run_id": run.run_id, "defense": _defense_label(run.config), "attack": _attack_label(spec),
                "updates": len(att), "records": att, "accuracy": summary.get("final_accuracy"),
                "cost": seconds / base if base else None,
            })  # fmt: skip
    return rows


def _fl_seconds(store: ResultStore, run: RunRow) -> float:
    summary = next((r for r in store.records(run.run_id, "summary")), {})
    return float(summary.get("fl_seconds", 0.0))


def _figure(path: Path, caption: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")  # fmt: skip


def render(store: ResultStore, run_ids: Sequence[str], figures: Path | None = None) -> str:
    """The report's HTML for ``run_ids`` (a run, or a grid's cells). ``figures``: the folder holding each
    run's ``RUN_ID/`` figure files (the CLI's ``--out/NAME``), to embed them."""
    by_id = {r.run_id: r for r in store.runs(include_unfinished=True)}
    missing = [r for r in run_ids if r not in by_id]
    if missing:
        raise ValueError(f"no run {missing} in {store.path}; `gradleak results {store.path}` lists them")
    runs = [by_id[r] for r in run_ids]
    rows = verdict_rows(store, runs)
    out = ["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
           "<title>gradleak audit report</title>", f"<style>{CSS}</style></head><body>",
           "<h1>Gradient-leakage audit</h1>",
           f"<p>Generated {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC from {html.escape(str(store.path))}; "
           f"runs {', '.join(html.escape(r) for r in run_ids)}.</p>", "<h2>Setup</h2><ul>"]  # fmt: skip
    out += [f"<li>{html.escape(line)}</li>" for line in setup_text(runs[0])]
    out.append(
        f"<li>Defenses compared: {', '.join(html.escape(_defense_label(r.config)) for r in runs)}.</li></ul>"
    )
    out.append(
        "<h2>Verdict</h2><table id='verdict'><tr>" + "".join(f"<th>{c}</th>" for c, _ in COLUMNS) + "</tr>"
    )
    for row in rows:
        rec = row["records"]
        scores = {key: _mean_sd(_values(rec, key)) for key in KEYS}
        floors = f"{scores['floor_class_mean_psnr_mean']} / {scores['floor_random_psnr_mean']}"
        cells = [html.escape(row["defense"]), html.escape(row["attack"]), str(row["updates"]),
                 scores["psnr_mean_beyond_floor"], scores["reconstruction_rate_beyond_floor"],
                 scores["psnr_mean"], scores["ssim_mean"], scores["reconstruction_rate"], floors,
                 scores["label_accuracy"],
                 "n/a" if row["accuracy"] is None else f"{row['accuracy']:.3f}",
                 "n/a" if row["cost"] is None else f"{row['cost']:.2f}"]  # fmt: skip
        out.append("<tr>" + "".join(f"<td class='name'>{c}</td>" if j < 2 else f"<td>{c}</td>"
                                    for j, c in enumerate(cells)) + "</tr>")  # fmt: skip
    out.append("</table><h3>What each column means</h3><ul class='legend'>")
    out += [f"<li><b>{c}</b>: {html.escape(text)}</li>" for c, text in COLUMNS]
    out.append("</ul><h2>Reconstructions</h2>")
    shown = 0
    for row in rows:
        for r in row["records"]:
            name = r.get("figure")
            path = None if figures is None or not name else figures / row["run_id"] / name
            if path is not None and path.is_file():
                who = "secure-aggregation sum" if r.get("aggregated") else f"client {r.get('client_id')}"
                out.append(_figure(path, f"{row['defense']}: {row['attack']} on {who}, originals above "
                                         "reconstructions, PSNR per image"))  # fmt: skip
                shown += 1
    if not shown:
        out.append("<p>No reconstruction figures were found next to the store.</p>")
    out.append("<h2>What these numbers do not promise</h2><div class='note'><ul>")
    out += [f"<li>{html.escape(c)}</li>" for c in CAVEATS]
    out.append("</ul></div></body></html>")
    return "\n".join(out)
