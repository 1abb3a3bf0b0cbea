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
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradleak.attacks import model_modifying
from gradleak.audit.choice import budget_warnings
from gradleak.experiments import columns
from gradleak.experiments.config import ComponentSpec, cell_label, defenses_label
from gradleak.experiments.store import ResultStore, RunRow
from gradleak.experiments.verdicts import node_verdicts, withheld_lines
from gradleak.registry import ATTACKS, DEFENSES
from gradleak.update import DEFAULT_BATCHING, DEFAULT_LOSS
from gradleak.validation import RUN_ID

CSS = """
body { font-family: sans-serif; max-width: 72rem; margin: 2rem auto; color: #111; line-height: 1.4; }
table { border-collapse: collapse; margin: 1rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #888; padding: 0.3rem 0.5rem; text-align: right; }
th { background: #eee; } td.name { text-align: left; }
.legend li { margin: 0.2rem 0; } figure { margin: 1rem 0; }
img { max-width: 100%; image-rendering: pixelated; }
mark { background: #ddd; font-weight: bold; }
.note { background: #f6f6f6; border-left: 4px solid #555; padding: 0.5rem 1rem; }
"""

LEADING = (
    ("defense", "the cell's defense (none: no defense)"),
    ("attack", "the attack and its options"),
    ("updates", "attacked updates (clients, or secure-aggregation sums) the row averages; each score is "
     "their mean ± standard deviation; 'withheld': audited clients that sent no update (a defense failed "
     "closed; the reason is in the run's records)"),
)  # fmt: skip
COST = ("cost", "FL time over the no-defense cell's, same machine and code (n/a without a none cell); a "
        "ratio of wall times, noisy for short runs or on a busy machine")  # fmt: skip


def legend(modality: str, utility: Sequence[columns.Column]) -> list[tuple[str, str]]:
    """The verdict table's columns in order, each with its one-line meaning."""
    cols = [*columns.PRIVACY[modality], *utility]
    return [*LEADING, *((c.header, c.meaning) for c in cols), COST]


CAVEATS = (
    "Each number is measured on the audited clients of this run; it is evidence about this deployment's "
    "recipe, not a bound for other data, models or attacks.",
    "Aegis and AEGIS give no formal privacy guarantee: they are tested against the attacks listed here.",
    "Secure aggregation hides individual updates, not the aggregate: an attack on the sum is shown as such.",
    "Differential-privacy noise here is tuned per experiment; no (epsilon, delta) is claimed unless stated.",
    "PSNR is capped at 100 dB (identical images).",
    "A text attack that recovers nothing under a defense shows what that attack cannot read, not that no "
    "attack can (docs/threat-models.md).",
)


def _mean_sd(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} &plusmn; {sd:.2f}"


MARKERS = ("circle", "square", "triangle", "diamond", "cross", "plus")  # told apart in greyscale
W, H, PAD = 560, 320, 56


def _marker(kind: str, x: float, y: float, r: float) -> str:
    style = "fill='none' stroke='black' stroke-width='1.6'"
    if kind == "circle":
        return f"<circle cx='{x:.1f}' cy='{y:.1f}' r='{r:.1f}' {style}/>"
    if kind == "square":
        return f"<rect x='{x - r:.1f}' y='{y - r:.1f}' width='{2 * r:.1f}' height='{2 * r:.1f}' {style}/>"
    points = {
        "triangle": [(0, -r), (r, r), (-r, r)],
        "diamond": [(0, -r), (r, 0), (0, r), (-r, 0)],
    }.get(kind)
    if points is not None:
        pts = " ".join(f"{x + dx:.1f},{y + dy:.1f}" for dx, dy in points)
        return f"<polygon points='{pts}' {style}/>"
    d = r * (0.7 if kind == "cross" else 1.0)
    a, b = ((-d, -d, d, d), (-d, d, d, -d)) if kind == "cross" else ((-d, 0, d, 0), (0, -d, 0, d))
    return "".join(f"<line x1='{x + u0:.1f}' y1='{y + v0:.1f}' x2='{x + u1:.1f}' y2='{y + v1:.1f}' "
                   f"stroke='black' stroke-width='1.6'/>" for u0, v0, u1, v1 in (a, b))  # fmt: skip


@dataclass(frozen=True)
class _Axes:
    """A plot's data ranges and their map to SVG coordinates."""

    x0: float
    x1: float
    y0: float
    y1: float

    @staticmethod
    def around(xs: Sequence[float], ys: Sequence[float]) -> _Axes:
        """Ranges around the points (10 % margins across; up from 0 or the lowest point)."""
        x0, x1 = min(xs), max(xs)
        x0, x1 = (x0 - 0.05, x1 + 0.05) if x1 - x0 < 1e-9 else (x0 - 0.1 * (x1 - x0), x1 + 0.1 * (x1 - x0))
        y0, y1 = min(0.0, min(ys)), max(ys)
        return _Axes(x0, x1, y0, y1 + (0.1 * (y1 - y0) if y1 > y0 else 1.0))

    def at(self, x: float, y: float) -> tuple[float, float]:
        return (PAD + (x - self.x0) / (self.x1 - self.x0) * (W - 2 * PAD),
                H - PAD - (y - self.y0) / (self.y1 - self.y0) * (H - 2 * PAD))  # fmt: skip


def tradeoff(rows: Sequence[dict[str, Any]], modality: str) -> list[str]:
    """Per attack, an inline SVG with one point per defense: utility (test accuracy) across, the headline
    leakage (the modality's first privacy column: above the null floor) up; each defense its own marker
    shape (readable in greyscale), labelled with its name and cost ratio; no script."""
    headline = columns.PRIVACY[modality][0]
    out = ["<h2>Privacy and utility</h2>",
           f"<p>One point per defense: {html.escape(headline.header)} (mean over the attacked updates; lower "
           "is more private) against the test accuracy after the same rounds (higher is more useful); the "
           "label gives the defense and its FL time over no defense.</p>"]  # fmt: skip
    defenses = list(dict.fromkeys(r["defense"] for r in rows))
    for attack in dict.fromkeys(r["attack"] for r in rows):
        points = []
        for r in rows:
            leak = _values(r["records"], headline.key)
            if r["attack"] == attack and leak and isinstance(r["accuracy"], int | float):
                points.append((r["defense"], float(r["accuracy"]), statistics.fmean(leak), r["cost"]))
        if not points:
            continue
        ax = _Axes.around([p[1] for p in points], [p[2] for p in points])
        x0, x1, y0, y1, at = ax.x0, ax.x1, ax.y0, ax.y1, ax.at

        svg = [f"<figure><svg class='tradeoff' role='img' width='{W}' height='{H}' viewBox='0 0 {W} {H}'>"
               f"<title>{html.escape(attack)}: privacy against utility</title>",
               f"<line x1='{PAD}' y1='{H - PAD}' x2='{W - PAD}' y2='{H - PAD}' stroke='black'/>",
               f"<line x1='{PAD}' y1='{PAD}' x2='{PAD}' y2='{H - PAD}' stroke='black'/>",
               f"<text x='{W / 2}' y='{H - 16}' text-anchor='middle' font-size='12'>test accuracy</text>",
               f"<text x='14' y='{H / 2}' font-size='12' transform='rotate(-90 14 {H / 2})' "
               f"text-anchor='middle'>{html.escape(headline.header)}</text>"]  # fmt: skip
        for value, anchor in ((x0, "start"), (x1, "end")):
            svg.append(f"<text x='{at(value, y0)[0]:.1f}' y='{H - PAD + 14}' font-size='10' "
                       f"text-anchor='{anchor}'>{value:.3f}</text>")  # fmt: skip
        for value in (y0, y1):
            svg.append(f"<text x='{PAD - 4}' y='{at(x0, value)[1]:.1f}' font-size='10' text-anchor='end'>"
                       f"{value:.2f}</text>")  # fmt: skip
        for defense, x, y, cost in points:
            px, py = at(x, y)
            kind = MARKERS[defenses.index(defense) % len(MARKERS)]
            label = defense if cost is None else f"{defense} (x{cost:.2f})"
            left = px > 0.6 * W  # labels of points on the right run leftwards, inside the plot
            tx, anchor = (px - 9, "end") if left else (px + 9, "start")
            svg.append(f"<g class='point'>{_marker(kind, px, py, 6)}<text x='{tx:.1f}' y='{py - 8:.1f}' "
                       f"font-size='11' text-anchor='{anchor}'>{html.escape(label)}</text></g>")  # fmt: skip
        svg.append(f"</svg><figcaption>{html.escape(attack)}</figcaption></figure>")
        out.append("".join(svg))
    return out


def glossary(runs: Sequence[RunRow]) -> list[str]:
    """The attacks and defenses of the report in plain words (each registry entry's summary)."""
    attacks = dict.fromkeys(a["name"] for run in runs for a in run.config["audit"]["attacks"])
    defenses = dict.fromkeys(d["name"] for run in runs for d in run.config.get("defenses") or [])
    out = ["<h3>The attacks and defenses</h3><ul class='glossary'>"]
    for kind, registry, names in (("attack", ATTACKS, attacks), ("defense", DEFENSES, defenses)):
        for name in names:
            summary = registry.entry(name).summary if name in registry else "(not registered here)"
            out.append(f"<li><b>{html.escape(name)}</b> ({kind}): {html.escape(summary)}</li>")
    out.append("</ul>")
    return out


def _number(value: Any, digits: int = 3) -> str:
    return "n/a" if not isinstance(value, int | float) else f"{value:.{digits}f}"


def marked(text: str, truth_words: set[str]) -> str:
    """``text`` escaped, each word that occurs in ``truth_words`` wrapped in ``<mark>`` (recovered)."""
    return " ".join(
        f"<mark>{html.escape(w)}</mark>" if w in truth_words else html.escape(w) for w in text.split(" ")
    )


def _texts(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Each text attack's reconstructions beside the client's true sequences (the first update's): each
    true sequence with the reconstruction matched to it, its words that occur in that sequence marked; a
    token-set attack's recovered tokens in one row, those that occur in the batch marked."""
    out = ["<h2>Text reconstructions</h2>",
           "<p>Marked words of a reconstruction occur in the true sequence beside it (for a token set: "
           "anywhere in the batch).</p>"]  # fmt: skip
    for row in rows:
        rec = next((r for r in row["records"] if r.get("true_texts")), None)
        if rec is None:
            continue
        who = "secure-aggregation sum" if rec.get("aggregated") else f"client {rec.get('client_id')}"
        title = f"{row['defense']}: {row['attack']} on {who}"
        out.append(f"<h3>{html.escape(title)}</h3>")
        out.append("<table class='texts'><tr><th>true sequence</th><th>its matched reconstruction</th></tr>")
        truth, matched = rec["true_texts"], rec.get("matched_texts") or []
        for k, t in enumerate(truth):
            f = matched[k] if k < len(matched) else ""
            out.append(f"<tr><td class='name'>{html.escape(t)}</td>"
                       f"<td class='name'>{marked(f, set(t.split(' ')))}</td></tr>")  # fmt: skip
        if not matched and rec.get("texts"):  # a token set, scored against the whole batch
            batch = {w for t in truth for w in t.split(" ")}
            found = " ".join(rec["texts"])
            out.append(f"<tr><td class='name'><i>recovered token set</i></td>"
                       f"<td class='name'>{marked(found, batch)}</td></tr>")  # fmt: skip
        out.append("</table>")
    return out


def _values(records: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), int | float)]


def _defense_label(config: dict[str, Any]) -> str:
    return defenses_label(
        [ComponentSpec(d["name"], d.get("options", {})) for d in config.get("defenses") or []]
    )


def _attack_label(spec: dict[str, Any]) -> str:
    return cell_label(ComponentSpec(spec["name"], spec.get("options", {})))


def setup_text(run: RunRow) -> list[str]:
    """The run's setup in plain words."""
    c, env = run.config, run.environment
    data, fl, audit, model = c["data"], c["fl"], c["audit"], c["model"]
    tr, at = fl["training"], audit["training"]
    task = f" ({model['task']})" if model.get("task") else ""
    secure = "only the sum of the round's updates (secure aggregation)" if fl.get("secure_aggregation") else (
        "every sampled client's update")  # fmt: skip
    control = (
        "it may modify the model it broadcasts (a malicious server)"
        if any(model_modifying(a["name"], a.get("options")) for a in audit["attacks"])
        else "it follows the protocol and analyses what it receives (honest-but-curious)"
    )
    return [
        f"Threat model: the server sees {secure}; {control}.",
        f"Data: {data['dataset']}, {data['num_clients']} clients, partition {data['partition']} "
        f"{data.get('partition_options') or ''}.",
        f"Model: {model['name']}{task}. FL: {fl['rounds']} rounds, {fl['fraction']:.0%} of clients "
        "per round, "
        f"{tr['protocol']} ({tr.get('optimizer', 'sgd')}, lr {tr['lr']}, batch {tr['batch_size']}, "
        f"{tr.get('epochs', 1)} epoch(s){recipe_extras(tr)}).",
        f"Audit: {audit['clients']} sampled client(s), {at['protocol']} on batches of {at['batch_size']}"
        f"{recipe_extras(at)}; "
        f"recipe {'known' if audit.get('training_public', True) else 'hidden'} to the attacker; labels "
        f"{'granted' if audit.get('grant_labels') else 'recovered by the attack'}"
        f"{'; text lengths granted' if audit.get('grant_lengths') else ''}.",
        *(f"Warning: {w}" for w in budget_warnings([ComponentSpec(a["name"], a.get("options", {}))
                                                      for a in audit["attacks"]])),
        f"Attacks: {', '.join(_attack_label(a) for a in audit['attacks'])}. Seed {c['experiment']['seed']}. "
        f"Code: gradleak {env.get('gradleak', '')} (commit {env.get('git_commit', 'unknown')[:12]}), torch "
        f"{env.get('torch', '?')}.",
    ]  # fmt: skip


def is_flower(run: RunRow) -> bool:
    """A run an audit wrapper on a Flower server wrote (``AuditStrategy``, ``LegacyAuditStrategy``)."""
    return run.config.get("engine") == "flower"


def flower_setup_text(run: RunRow) -> list[str]:
    """A Flower audit's setup in plain words (its wrapper's configuration)."""
    c, env = run.config, run.environment
    api = "legacy API (SecAgg+ capable)" if c.get("api") == "legacy" else "message API"
    seen = (
        "only the secure aggregate" if c.get("secure_aggregation") is True else "each train reply it received"
    )
    attacks = ", ".join(str(a.get("name")) for a in c.get("attacks", [])) or "none"
    lines = [
        f"Threat model: a Flower server ({c.get('strategy', '?')}, {api}) that attacks {seen}; every "
        "reply was checked first (rejected ones are in the run's records).",
        f"Attacks: {attacks} ({c.get('attack_choice', 'configured')}). Seed {c.get('seed')}.",
        *(f"Warning: {w}" for w in c.get("warnings", [])),
    ]
    if c.get("malicious"):
        nodes = c.get("malicious_nodes") or "every"
        lines.append(
            f"Malicious server: {c['malicious'][0]} sent to {nodes} sampled node(s) per audited round."
        )
    commit = env.get("git_commit", "unknown")[:12]
    lines.append(
        f"Code: gradleak {env.get('gradleak', '')} (commit {commit}), torch {env.get('torch', '?')}."
    )
    return lines


def flower_rows(store: ResultStore, run: RunRow) -> list[dict[str, Any]]:
    """One verdict row per attack of a Flower audit (the malicious attack's on the planted nodes apart)."""
    records = store.records(run.run_id)
    attacked = [r for r in records if r["kind"] == "attack"]
    names = [(str(a["name"]), False) for a in run.config.get("attacks", [])]
    if run.config.get("malicious"):
        names.append((str(run.config["malicious"][0]), True))
    rows = []
    for name, malicious in names:
        att = [r for r in attacked if r.get("attack") == name and bool(r.get("malicious")) == malicious]
        failed = [r for r in records if r["kind"] == "attack_error" and r.get("attack") == name]
        withheld = sum(1 for r in records if r["kind"] in ("rejected", "client_error"))
        label = name + (" (malicious)" if malicious else "")
        rows.append({
            "run_id": run.run_id, "defense": "as deployed", "attack": label, "updates": len(att),
            "withheld": withheld, "failed": len(failed), "records": att, "accuracy": None, "utility": {},
            "cost": None,
        })  # fmt: skip
    return rows


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
                "updates": len(att), "withheld": columns.withheld(records, i),
                "failed": columns.failed(records, i),
                "records": att, "accuracy": summary.get("final_accuracy"),
                "utility": {c.key: summary.get(c.key) for c in columns.UTILITY},
                "cost": seconds / base if base else None,
            })  # fmt: skip
    return rows


def _fl_seconds(store: ResultStore, run: RunRow) -> float:
    summary = next((r for r in store.records(run.run_id, "summary")), {})
    return float(summary.get("fl_seconds", 0.0))


FIGURE_NAME = re.compile(r"reconstructions_\d{1,6}_\d{1,6}\.png")  # what the runner writes, nothing else
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"
"""The report's Content-Security-Policy: its inline style, inline SVG and data-URI images, and nothing
that runs or loads (a field a store smuggled past the escaping still could not execute or call home)."""


def figure_path(figures: Path, run_id: object, name: object) -> Path | None:
    """The figure a record names, only inside its run's own folder under ``figures`` and only by the name
    pattern the runner writes (a store is a file anyone may hand you: ``figure = "/etc/passwd"`` or
    ``"../../x"``, or such a ``run_id``, embedded another file in the report)."""
    if not isinstance(name, str) or not FIGURE_NAME.fullmatch(name):
        return None
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        return None
    folder = (figures / run_id).resolve()
    path = (folder / name).resolve()
    if folder.parent != figures.resolve() or path.parent != folder or not path.is_file():
        return None
    return path


def _figure(path: Path, caption: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")  # fmt: skip


def recipe_extras(recipe: Mapping[str, Any]) -> str:
    """A recipe's momentum, loss and batching where they are not the defaults (``", mse loss"``)."""
    out = [f"momentum {recipe['momentum']:g}"] if recipe.get("momentum") else []
    out += [f"{recipe['loss']} loss"] if recipe.get("loss", DEFAULT_LOSS) != DEFAULT_LOSS else []
    out += (
        [f"{recipe['batching']} batches"]
        if recipe.get("batching", DEFAULT_BATCHING) != DEFAULT_BATCHING
        else []
    )
    return "".join(f", {x}" for x in out)


def figure_subject(r: Mapping[str, Any]) -> str:
    """Whose update a figure shows: a client of a simulation, a node in a round of a deployment audit, or
    a secure-aggregation sum."""
    if r.get("aggregated") or r.get("aggregate"):
        return "the secure-aggregation sum" + (f", round {r['round']}" if "round" in r else "")
    if r.get("node_id") is not None:
        return f"node {r['node_id']}, round {r.get('round')}"
    return f"client {r.get('client_id')}"


def render(store: ResultStore, run_ids: Sequence[str], figures: Path | None = None) -> str:
    """The report's HTML for ``run_ids`` (a run, or a grid's cells). ``figures``: the folder holding each
    run's ``RUN_ID/`` figure files (the CLI's ``--out/NAME``), to embed them."""
    by_id = {r.run_id: r for r in store.runs(include_unfinished=True)}
    missing = [r for r in run_ids if r not in by_id]
    if missing:
        raise ValueError(f"no run {missing} in {store.path}; `gradleak results {store.path}` lists them")
    runs = [by_id[r] for r in run_ids]
    flower = all(is_flower(r) for r in runs)
    if not flower and any(is_flower(r) for r in runs):
        raise ValueError("a report compares runs of one kind: Flower audits or gradleak runs, not both")
    rows = [row for r in runs for row in flower_rows(store, r)] if flower else verdict_rows(store, runs)
    out = ["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
           f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
           "<title>gradleak audit report</title>", f"<style>{CSS}</style></head><body>",
           "<h1>Gradient-leakage audit</h1>",
           f"<p>Generated {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC from {html.escape(str(store.path))}; "
           f"runs {', '.join(html.escape(r) for r in run_ids)}.</p>", "<h2>Setup</h2><ul>"]  # fmt: skip
    out += [
        f"<li>{html.escape(line)}</li>" for line in (flower_setup_text if flower else setup_text)(runs[0])
    ]
    if flower:
        out.append("</ul>")
        modality = "text" if any("rouge1" in r for row in rows for r in row["records"]) else "image"
    else:
        labels = ", ".join(html.escape(_defense_label(r.config)) for r in runs)
        out.append(f"<li>Defenses compared: {labels}.</li></ul>")
        modality = columns.modality_of(runs[0].config["data"]["dataset"])
    shown_utility = [c for c in columns.UTILITY if any(row["utility"].get(c.key) is not None for row in rows)]
    out.append(
        "<h2>Verdict</h2><table id='verdict'><tr>"
        + "".join(f"<th>{html.escape(c)}</th>" for c, _ in legend(modality, shown_utility))
        + "</tr>"
    )
    for row in rows:
        rec = row["records"]
        utility = [_number(row["utility"].get(c.key)) for c in shown_utility]
        cells = [html.escape(row["defense"]), html.escape(row["attack"]), columns.updates_label(row),
                 *(_mean_sd(_values(rec, c.key)) for c in columns.PRIVACY[modality]), *utility,
                 _number(row["cost"], 2)]  # fmt: skip
        out.append("<tr>" + "".join(f"<td class='name'>{c}</td>" if j < 2 else f"<td>{c}</td>"
                                    for j, c in enumerate(cells)) + "</tr>")  # fmt: skip
    out.append("</table><h3>What each column means</h3><ul class='legend'>")
    out += [
        f"<li><b>{html.escape(c)}</b>: {html.escape(text)}</li>"
        for c, text in legend(modality, shown_utility)
    ]
    out.append("</ul>")
    if flower:
        out.append("<h2>Per node and round</h2><ul id='node-verdicts'>")
        for run in runs:
            out += [f"<li>{html.escape(line)}</li>" for line in node_verdicts(store.records(run.run_id))]
        out.append("</ul>")
    else:
        lines = [line for run in runs for line in withheld_lines(store.records(run.run_id))]
        if lines:
            out.append("<h2>Clients that sent nothing</h2><ul id='withheld'>")
            out += [f"<li>{html.escape(line)}</li>" for line in lines]
            out.append("</ul>")
    out += [] if flower else glossary(runs)
    out += [] if flower else tradeoff(rows, modality)  # a deployment audit measures no utility
    out += _texts(rows) if modality == "text" else []
    out.append("<h2>Reconstructions</h2>")
    shown = 0
    for row in rows:
        for r in row["records"]:
            path = None if figures is None else figure_path(figures, row["run_id"], r.get("figure"))
            if path is not None:
                shows = (
                    "originals above reconstructions, PSNR per image" if "psnr" in r else "no data to compare"
                )
                caption = f"{row['defense']}: {row['attack']} on {figure_subject(r)}, {shows}"
                out.append(_figure(path, caption))
                shown += 1
    if not shown:
        out.append("<p>No reconstruction figures were found next to the store.</p>")
    out.append("<h2>What these numbers do not promise</h2><div class='note'><ul>")
    out += [f"<li>{html.escape(c)}</li>" for c in CAVEATS]
    out.append("</ul></div></body></html>")
    return "\n".join(out)
