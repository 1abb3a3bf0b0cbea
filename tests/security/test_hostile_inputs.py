"""A hostile store or config cannot turn gradleak against the person who runs it. Each case below worked
before: a store's client label put ``<script>`` into report.html; a record's ``figure`` (or ``run_id``)
embedded ``/etc/hostname`` or ``../../etc/passwd`` in the report; ``experiment.name = "../../escape"``
wrote outside ``--out``; ``experiment.plugins`` imported a config's own code with no opt-in; ``--plugin``
left the working directory at the front of ``sys.path``; exports of clients' images were world-readable;
``data.num_clients = 10**9`` or ``fl.rounds = 10**9`` were accepted."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
import torch

from gradleak.experiments import ResultStore, load_config
from gradleak.experiments.config import ConfigError
from gradleak.experiments.report import CSP, figure_path, render
from gradleak.experiments.resources import ResourceError, check_resources
from gradleak.experiments.store import RunRow
from gradleak.fileio import atomic_write
from gradleak.plugins import load_plugin

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "src" / "gradleak" / "experiments" / "demo.toml"
TEXT = ROOT / "examples" / "wikitext2_gpt2_dager.toml"


def stored_run(
    tmp_path: Path, records: list[dict], run_id: str = "demo-1", config: Path = DEMO
) -> ResultStore:
    """A store holding one finished run of ``config`` with ``records`` (as a store handed to you)."""
    store = ResultStore(tmp_path / "s.sqlite")
    cfg = load_config(config).to_dict()
    store.begin_run(RunRow(run_id, "demo", "2026-12-01T00:00:00", "", cfg, {}, "running", None))
    store.commit_unit(run_id, "audit", records)
    store.finish_run(run_id, "2026-12-01T00:01:00", [{"kind": "summary", "final_accuracy": 0.5}])
    return store


def test_a_stored_client_label_cannot_put_a_script_into_the_report(tmp_path):
    evil = "<script>alert(1)</script>"
    record = {"kind": "attack", "cell": 0, "client_id": evil, "true_texts": ["a b"], "matched_texts": ["a"]}
    page = render(stored_run(tmp_path, [record], config=TEXT), ["demo-1"])
    assert "Text reconstructions" in page  # the section that printed the label unescaped
    assert evil not in page and "client &lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert f'<meta http-equiv="Content-Security-Policy" content="{CSP}">' in page
    assert "script-src" not in CSP and "default-src 'none'" in CSP and "img-src data:" in CSP


@pytest.mark.parametrize(
    "figure", ["/etc/hostname", "../../../../etc/hostname", "reconstructions_0_0.png/../../x", "x.png"]
)
def test_a_stored_figure_name_cannot_embed_another_file(tmp_path, figure):
    (tmp_path / "figs" / "demo-1").mkdir(parents=True)
    secret = tmp_path / "figs" / "demo-1" / "x.png"
    secret.write_bytes(b"SECRET-BYTES")
    record = {"kind": "attack", "cell": 0, "client_id": 1, "figure": figure}
    page = render(stored_run(tmp_path, [record]), ["demo-1"], tmp_path / "figs")
    assert "data:image/png;base64" not in page


def test_a_stored_run_id_cannot_lead_the_figures_elsewhere(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "reconstructions_0_0.png").write_bytes(b"\x89PNG-not-yours")
    figs = tmp_path / "figs"
    figs.mkdir()
    assert figure_path(figs, "../outside", "reconstructions_0_0.png") is None
    assert figure_path(figs, str(outside), "reconstructions_0_0.png") is None
    (figs / "run-1").mkdir()
    (figs / "run-1" / "reconstructions_0_0.png").write_bytes(b"\x89PNG-ok")
    assert (
        figure_path(figs, "run-1", "reconstructions_0_0.png")
        == (figs / "run-1" / "reconstructions_0_0.png").resolve()
    )


@pytest.mark.parametrize("name", ["../../escape", "/tmp/abs", "a/b", ".hidden", "x..y", "", "a" * 201])
def test_a_run_name_cannot_leave_the_output_folder(name):
    with pytest.raises(ConfigError, match="experiment.name must be 1-200 letters"):
        load_config(DEMO, [f"experiment.name={name!r}"])


def test_a_config_loads_its_own_code_only_when_trusted(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    plugin = tmp_path / "evil.py"
    plugin.write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    config = tmp_path / "c.toml"
    config.write_text(DEMO.read_text().replace("[experiment]", "[experiment]\nplugins = ['evil.py']", 1))
    with pytest.raises(ConfigError, match="--trust-config-plugins"):
        load_config(config)
    assert not marker.exists()
    load_config(config, trust_plugins=True)
    assert marker.exists()


def test_a_config_plugin_by_module_name_is_not_found_in_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "gl_cwd_plugin.py").write_text("raise SystemExit('must not run')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="not found \\(looked in the environment\\)"):
        load_config(DEMO, ["experiment.plugins=['gl_cwd_plugin']"])


def test_a_plugin_by_module_name_leaves_sys_path_as_it_was(tmp_path, monkeypatch):
    (tmp_path / "gl_path_plugin.py").write_text("LOADED = True\n")
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    assert load_plugin("gl_path_plugin").LOADED
    assert sys.path == before  # the working directory no longer shadows later imports
    sys.modules.pop("gl_path_plugin", None)


def test_exports_and_a_new_store_are_their_owners_alone(tmp_path):
    out = atomic_write(tmp_path / "reconstructions_0_0.png", lambda p: p.write_bytes(b"client data"))
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    stored_run(tmp_path, [])
    assert stat.S_IMODE((tmp_path / "s.sqlite").stat().st_mode) == 0o600


def test_a_run_that_cannot_fit_is_refused_before_work_with_the_override(tmp_path):
    model = torch.nn.Linear(1000, 1000)  # 4 MB
    cfg = load_config(DEMO, ["data.num_clients=1000000000"])
    with pytest.raises(ResourceError, match="exceeds the 500 training samples"):
        check_resources(cfg, model, 500)
    cfg = load_config(DEMO, ["fl.rounds=1000000000"])
    with pytest.raises(
        ResourceError, match="local trainings, over 1,000,000; set experiment.resource_limits"
    ):
        check_resources(cfg, model, 10_000)
    cfg = load_config(DEMO, ["audit.views=100000", "audit.max_samples=4"])
    with pytest.raises(ResourceError, match="audit.views = 100000 .* GiB of updates at once"):
        check_resources(cfg, model, 10_000)
    check_resources(
        load_config(DEMO, ["audit.views=100000", "audit.max_samples=4", "experiment.resource_limits=false"]),
        model,
        10_000,
    )
    with pytest.raises(ConfigError, match="data.num_clients: expected int"):
        load_config(DEMO, ["data.num_clients=1e9"])


def test_the_runner_refuses_an_oversized_run_before_the_first_round(tmp_path):
    from gradleak.experiments import run_experiment

    cfg = load_config(DEMO, ["fl.rounds=1000000000", "data.train_limit=300", "data.test_limit=50"])
    with pytest.raises(ConfigError, match="local trainings"):
        run_experiment(cfg, store=ResultStore(tmp_path / "s.sqlite"))
    assert not (tmp_path / "s.sqlite").exists()  # refused before the store was touched
