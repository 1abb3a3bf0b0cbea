"""The HTML audit report (issue 20, first part): written by ``gradleak run`` for a grid, self-contained
(no script, no network, images embedded), one verdict row per defense x attack with the stored values."""

from __future__ import annotations

import base64
import os
import re
import shutil
import statistics
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from browser import FLAGS, console_lines, needs_chromium, probed_dom
from gradleak.cli import main
from gradleak.experiments import ResultStore
from gradleak.experiments.store import RunRow

ROOT = Path(__file__).resolve().parents[2]
GRID = ROOT / "examples" / "organamnist_grid.toml"
TINY = [
    "data.train_limit=1500", "data.test_limit=300", "data.num_clients=20", "fl.rounds=1", "fl.fraction=0.2",
    "audit.clients=2", "audit.training.batch_size=2", "audit.attacks.0.max_iterations=4",
    "grid.defenses=['none', {name = 'pruning', ratio = 0.9}]",
]  # fmt: skip


class Page(HTMLParser):
    """The verdict table's rows, the images' sources and every external reference."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.images: list[str] = []
        self.external: list[str] = []
        self.scripts = 0
        self._in_table = self._in_cell = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table" and a.get("id") == "verdict":
            self._in_table = True
        elif tag == "tr" and self._in_table:
            self.rows.append([])
        elif tag in ("td", "th") and self._in_table:
            self._in_cell = True
            self.rows[-1].append("")
        elif tag == "img":
            self.images.append(a.get("src", ""))
        elif tag == "script":
            self.scripts += 1
        for key in ("src", "href"):
            if a.get(key, "").startswith(("http:", "https:", "//")):
                self.external.append(a[key])

    def handle_endtag(self, tag):
        if tag == "table":
            self._in_table = False
        elif tag in ("td", "th"):
            self._in_cell = False

    def handle_data(self, data):
        if self._in_table and self._in_cell:
            self.rows[-1][-1] += data


@pytest.fixture(scope="module")
def grid_out(tmp_path_factory) -> Path:
    """A small real grid run by the command (2 cells x IG on 2 audited clients); its output folder."""
    out = tmp_path_factory.mktemp("report") / "out"
    assert main(["--quiet", "run", str(GRID), *TINY, "--out", str(out)]) == 0
    return out


def test_a_grid_run_writes_a_self_contained_report_with_one_row_per_cell_and_attack(grid_out):
    out = grid_out
    page = Page()
    page.feed((out / "grid" / "report.html").read_text(encoding="utf-8"))
    header, *rows = page.rows
    assert header[:4] == ["defense", "attack", "updates", "PSNR over floor"]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("none", "ig(lr=0.1, max_iterations=4, tv_weight=0.0001)", "2"),
        ("pruning(ratio=0.9)", "ig(lr=0.1, max_iterations=4, tv_weight=0.0001)", "2"),
    ]  # fmt: skip
    store = ResultStore(out / "results.sqlite")
    runs = {r.name: r for r in store.runs()}
    for row, name in zip(rows, ("grid.none", "grid.pruning-ratio=0.9"), strict=True):
        records = store.records(runs[name].run_id, "attack")
        for column, key in ((3, "psnr_mean_beyond_floor"), (5, "psnr_mean")):
            values = [r[key] for r in records]
            expected = f"{statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f}"
            assert row[column] == expected, (name, key)
        summary = store.records(runs[name].run_id, "summary")[0]
        assert row[header.index("test acc")] == f"{summary['final_accuracy']:.3f}"
        assert row[header.index("epsilon")] == "n/a"  # neither defense states a formal guarantee
    assert rows[0][header.index("cost")] == "1.00"  # cost of the none cell
    # the privacy-utility plot: one inline SVG for the attack, one marked point per defense, named
    page_text = (out / "grid" / "report.html").read_text(encoding="utf-8")
    svgs = re.findall(r"<svg class='tradeoff'.*?</svg>", page_text, flags=re.S)
    assert len(svgs) == 1 and svgs[0].count("<g class='point'>") == 2
    assert "none (x1.00)" in svgs[0] and "pruning(ratio=0.9) (x" in svgs[0]
    assert page.scripts == 0 and page.external == []
    assert len(page.images) == 4  # one figure per attacked update and cell
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_command_names_an_unknown_run(tmp_path, capsys):
    store = ResultStore(tmp_path / "s.sqlite")
    store.begin_run(RunRow("r1", "x", "2026-12-01T00:00:00", "", {}, {}, "running", None))
    assert main(["report", str(tmp_path / "s.sqlite"), "nope-1"]) == 2
    assert re.search(r"no run \['nope-1'\] in .*s\.sqlite", capsys.readouterr().err)


@needs_chromium
def test_the_report_opens_in_a_real_browser_with_every_image_loaded_and_no_console_error(grid_out, tmp_path):
    """Debian's chromium, headless: the page loads without console messages, its images decode under the
    report's Content-Security-Policy (natural width > 0: a test-only copy adds the probe script, and to
    its policy only the right to run it; the report has none), a screenshot is kept."""
    report = grid_out / "grid" / "report.html"
    dom = probed_dom(report, tmp_path)
    assert "images:4:loaded" in dom.stdout, dom.stdout[-500:]
    assert dom.stdout.count('class="tradeoff"') == 1  # the privacy-utility plot, rendered in the DOM
    assert console_lines(dom) == []
    assert dom.stdout.count("<tr>") == 3  # the verdict table: header + 2 cells x 1 attack
    shot = Path(os.environ.get("GRADLEAK_ARTIFACTS", tmp_path)) / "report.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["chromium", *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                    "--window-size=1280,2000", report.as_uri()],
                   capture_output=True, timeout=120, check=True)  # fmt: skip
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


TEXT_GRID = ROOT / "examples" / "wikitext2_gpt2_dager.toml"
TEXT_TINY = [
    "data.train_limit=120", "data.test_limit=40", "data.num_clients=6", "fl.fraction=0.5", "fl.rounds=1",
    "grid.defenses=['none', 'aegis_llm']", "audit.attacks=[{name = 'dager', vocab = 'embedding'}]",
    "experiment.name='textgrid'",
]  # fmt: skip


class Texts(HTMLParser):
    """The rows of the report's text tables (true sequence, recovered)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._on = self._cell = False

    def handle_starttag(self, tag, attrs):
        if tag == "table" and dict(attrs).get("class") == "texts":
            self._on = True
        elif tag == "tr" and self._on:
            self.rows.append([])
        elif tag == "td" and self._on:
            self._cell = True
            self.rows[-1].append("")

    def handle_endtag(self, tag):
        self._on = self._on and tag != "table"
        self._cell = self._cell and tag != "td"

    def handle_data(self, data):
        if self._cell:
            self.rows[-1][-1] += data


def test_a_text_grid_report_shows_rouge_beside_its_null_and_the_texts(tmp_path):
    out = tmp_path / "out"
    assert main(["--quiet", "run", str(TEXT_GRID), *TEXT_TINY, "--out", str(out)]) == 0
    html_text = (out / "textgrid" / "report.html").read_text(encoding="utf-8")
    page = Page()
    page.feed(html_text)
    header, *rows = page.rows
    assert header[:5] == ["defense", "attack", "updates", "R-1 over null", "ROUGE-1"]
    assert "test ppl" in header and "PSNR dB" not in header
    assert [(r[0], r[1], r[2]) for r in rows] == [("none", "dager(vocab=embedding)", "2"),
                                                  ("aegis_llm", "dager(vocab=embedding)", "2")]  # fmt: skip
    store = ResultStore(out / "results.sqlite")
    runs = {r.name: r for r in store.runs()}
    for row, name in zip(rows, ("textgrid.none", "textgrid.aegis_llm"), strict=True):
        records = store.records(runs[name].run_id, "attack")
        r1 = [r["rouge1"] for r in records]
        assert row[4] == f"{statistics.fmean(r1):.2f} ± {statistics.stdev(r1):.2f}"
        summary = store.records(runs[name].run_id, "summary")[0]
        assert row[header.index("test ppl")] == f"{summary['final_perplexity']:.3f}"
    assert rows[0][4] == "1.00 ± 0.00" and rows[1][4] == "0.00 ± 0.00"  # DAGER exact; AEGIS blocks it
    svgs = re.findall(r"<svg class='tradeoff'.*?</svg>", html_text, flags=re.S)
    assert len(svgs) == 1 and svgs[0].count("<g class='point'>") == 2 and "R-1 over null" in svgs[0]
    texts = Texts()
    texts.feed(html_text)
    none_records = store.records(runs["textgrid.none"].run_id, "attack")
    first = next(r for r in none_records if r.get("true_texts"))
    shown = [r for r in texts.rows if r]  # the rows of the first text table (after its header)
    assert shown[: len(first["true_texts"])] == [[t, t] for t in first["true_texts"]]  # each true = its match
    tables = re.findall(r"<table class='texts'>.*?</table>", html_text, flags=re.S)
    words = sum(len(t.split(" ")) for t in first["true_texts"])
    assert tables[0].count("<mark>") == words and "<mark>" not in tables[-1]  # all recovered; AEGIS: none
    assert "<b>dager</b> (attack)" in html_text and "<b>aegis_llm</b> (defense)" in html_text  # glossary
    if shutil.which("chromium") is not None:  # the text report renders in the browser too
        dom = subprocess.run(
            ["chromium", *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
             "--v=0", "--virtual-time-budget=5000", "--dump-dom",
             (out / "textgrid" / "report.html").as_uri()],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        assert console_lines(dom) == [] and dom.stdout.count('class="tradeoff"') == 1
        assert dom.stdout.count('class="texts"') == 2  # one text table per cell
    assert page.scripts == 0 and page.external == []


def test_figures_show_the_best_median_and_worst_matches_not_the_first():
    from gradleak.experiments.figures import representative

    psnr = [float(v) for v in (5, 40, 12, 33, 18, 27, 9, 50, 21, 15, 44, 30, 7, 25, 36, 11, 19, 48, 23, 14)]
    shown = representative(psnr, per_rank=4)
    by_rank = {r: [psnr[k] for k, rr in shown if rr == r] for r in ("best", "median", "worst")}
    ranked = sorted(psnr, reverse=True)
    assert by_rank["best"] == ranked[:4] and by_rank["worst"] == ranked[-4:]
    assert by_rank["median"] == ranked[8:12]  # the four around the median of 20
    assert len({k for k, _ in shown}) == 12
    few = [3.0, 9.0, 1.0]
    assert representative(few) == [(1, ""), (0, ""), (2, "")]  # all of them, best first
