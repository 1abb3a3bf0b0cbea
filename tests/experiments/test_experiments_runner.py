"""End-to-end runs on real data (tiny scale), the store's all-or-nothing writes, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import re
import sqlite3

import pytest

from gradleak.cli import main
from gradleak.experiments import ResultStore, load_config, run_experiment

TINY = [
    "data.train_limit=600", "data.test_limit=200", "data.num_clients=10", "fl.rounds=1", "fl.fraction=0.2",
    "fl.training.epochs=1", "audit.attacks.0.max_iterations=20", "audit.training.batch_size=2",
    "audit.clients=1",
]  # fmt: skip


def demo_cfg(extra=()):
    from gradleak.cli.demo import demo_config_path

    return load_config(demo_config_path(), TINY + list(extra))


def _count(db, table):
    return sqlite3.connect(db).execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]


def test_run_writes_store_exports_and_figure(tmp_path):
    store = ResultStore(tmp_path / "r.sqlite")
    out = run_experiment(demo_cfg(), store=store, out_dir=tmp_path / "figs")
    rounds, attacks = out.of_kind("round"), out.of_kind("attack")
    assert len(rounds) == 1 and len(rounds[0]["clients"]) == 2 and 0.0 <= rounds[0]["accuracy"] <= 1.0
    assert len(attacks) == 1
    a = attacks[0]
    assert a["attack"] == "ig" and a["batch_size"] == 2 and len(a["psnr"]) == 2
    assert 0 <= a["reconstruction_rate"] <= 1 and a["lpips"] is None and "unavailable" in a["lpips_note"]
    assert out.figures and out.figures[0].stat().st_size > 1000
    runs = store.runs()
    assert [r.run_id for r in runs] == [out.run_id] and runs[0].config["fl"]["rounds"] == 1
    assert runs[0].environment["git_commit"]
    assert len(store.records(out.run_id)) == len(out.records)
    exported = json.loads(store.export_json(out.run_id, tmp_path / "r.json").read_text())
    assert exported["records"][-1]["kind"] == "summary"
    header = store.export_csv(out.run_id, tmp_path / "a.csv", "attack").read_text().splitlines()[0]
    assert "psnr_mean" in header


def test_same_seed_same_results(tmp_path):
    a = run_experiment(demo_cfg())
    b = run_experiment(demo_cfg())
    assert a.of_kind("round")[0]["accuracy"] == b.of_kind("round")[0]["accuracy"]
    assert a.of_kind("attack")[0]["psnr"] == b.of_kind("attack")[0]["psnr"]


TIMING = {"seconds", "fl_seconds", "total_seconds", "attack_seconds"}


def untimed(records):
    """Records without wall-clock fields: what two runs of one config must agree on."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def test_failure_mid_run_keeps_finished_units_and_the_rerun_resumes(tmp_path, monkeypatch):
    db = tmp_path / "r.sqlite"
    store = ResultStore(db)
    reference = run_experiment(demo_cfg(), store=store, out_dir=tmp_path / "ref")  # uninterrupted
    import gradleak.audit.scoring as setup

    def broken(*args, **kwargs):
        raise RuntimeError("attack crashed")

    with monkeypatch.context() as m:
        m.setattr(setup, "score_images", broken)
        with pytest.raises(RuntimeError, match="attack crashed"):
            run_experiment(demo_cfg(), store=store, out_dir=tmp_path / "figs")
    assert [r.run_id for r in store.runs()] == [reference.run_id]  # the failed run is not complete
    unfinished = [r for r in store.runs(include_unfinished=True) if r.status == "running"]
    assert len(unfinished) == 1
    stored = store.records(unfinished[0].run_id)
    assert [r["kind"] for r in stored] == ["round"]  # the finished round is kept, no partial attack row
    assert not (tmp_path / "figs").exists()  # no figure of the failed unit either
    resumed = run_experiment(demo_cfg(), store=store, out_dir=tmp_path / "figs")
    assert resumed.resumed and resumed.run_id == unfinished[0].run_id
    assert untimed(store.records(resumed.run_id)) == untimed(store.records(reference.run_id))
    assert [r.run_id for r in store.runs()] == [reference.run_id, resumed.run_id]
    assert _count(db, "records") == len(store.records(reference.run_id)) * 2  # nothing duplicated
    assert _count(db, "checkpoints") == 0  # dropped once the runs completed


def test_a_run_failing_between_fl_rounds_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """Killed after round 0 of 3: the resumed run restores the model and the sampler from the stored
    checkpoint and gives the rounds and the audit of an uninterrupted run."""
    from gradleak.experiments import runner
    from gradleak.federation.simulation import FederatedSimulation

    monkeypatch.setattr(runner, "CHECKPOINT_OVERHEAD", 0.0)  # a checkpoint after every round
    cfg = demo_cfg(["fl.rounds=3"])
    reference = run_experiment(cfg, store=ResultStore(tmp_path / "ref.sqlite"))
    store = ResultStore(tmp_path / "r.sqlite")
    original = FederatedSimulation.run_round

    def dies_in_round_1(self, round_idx):
        if round_idx == 1:
            raise KeyboardInterrupt("killed")
        return original(self, round_idx)

    with monkeypatch.context() as m:
        m.setattr(FederatedSimulation, "run_round", dies_in_round_1)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(cfg, store=store)
    (unfinished,) = store.runs(include_unfinished=True)
    assert store.units(unfinished.run_id) == {"round/0"} and store.checkpoint(unfinished.run_id) is not None
    calls = []
    monkeypatch.setattr(
        FederatedSimulation, "run_round", lambda self, r: calls.append(r) or original(self, r)
    )
    resumed = run_experiment(cfg, store=store)
    assert resumed.resumed and calls == [1, 2]  # round 0 was not trained again
    assert untimed(resumed.records) == untimed(reference.records)


def test_rounds_wait_for_a_slow_checkpoint_and_a_kill_before_it_redoes_them(tmp_path, monkeypatch):
    """A process commits its first round with a checkpoint (which measures the writing time); when
    checkpoints take long to write (here: never due again before the last round), later rounds wait and are
    committed together with the next one in one transaction. Killed in round 3 of 4, rounds 1 and 2 are
    lost with it; the rerun, resumed after round 0, trains rounds 1-3 again and gives the uninterrupted
    run's records."""
    from gradleak.experiments import runner
    from gradleak.federation.simulation import FederatedSimulation

    cfg = demo_cfg(["fl.rounds=4", "audit.clients=0"])
    reference = run_experiment(cfg, store=ResultStore(tmp_path / "ref.sqlite"))
    monkeypatch.setattr(runner, "CHECKPOINT_OVERHEAD", 1e12)
    commits: list[tuple[str, tuple[str, ...], str | None]] = []
    commit = ResultStore.commit_unit

    def spy(self, run_id, unit, records=(), *, checkpoint=None, also=()):
        commits.append((unit, tuple(also), checkpoint.unit if checkpoint else None))
        return commit(self, run_id, unit, records, checkpoint=checkpoint, also=also)

    monkeypatch.setattr(ResultStore, "commit_unit", spy)
    original = FederatedSimulation.run_round

    def dies_in_round_3(self, round_idx):
        if round_idx == 3:
            raise KeyboardInterrupt("killed")
        return original(self, round_idx)

    store = ResultStore(tmp_path / "r.sqlite")
    with monkeypatch.context() as m:
        m.setattr(FederatedSimulation, "run_round", dies_in_round_3)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(cfg, store=store)
    (unfinished,) = store.runs(include_unfinished=True)
    assert commits == [("round/0", (), "round/0")] and store.units(unfinished.run_id) == {"round/0"}
    calls: list[int] = []
    monkeypatch.setattr(
        FederatedSimulation, "run_round", lambda self, r: calls.append(r) or original(self, r)
    )
    resumed = run_experiment(cfg, store=store)
    assert resumed.resumed and calls == [1, 2, 3]
    assert commits[1:] == [("round/1", (), "round/1"), ("round/2", ("round/3",), "round/3")]
    assert untimed(resumed.records) == untimed(reference.records)


def test_missing_data_file_is_one_clear_error(tmp_path):
    cfg = demo_cfg([f"experiment.data_root='{tmp_path}'"])
    with pytest.raises(FileNotFoundError, match="organamnist.npz"):
        run_experiment(cfg, store=ResultStore(tmp_path / "r.sqlite"))
    assert not (tmp_path / "r.sqlite").exists()


def test_cli_run_list_and_errors(tmp_path, capsys):
    from gradleak.cli.demo import demo_config_path

    assert main(["run", demo_config_path(), *TINY, "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "PSNR dB" in text and "test acc" in text and "figure:" in text
    (folder,) = (tmp_path / "demo").iterdir()  # one folder per run
    assert (folder / "attacks.csv").exists() and (folder / "reconstructions_0_0.png").exists()
    assert json.loads((folder / "results.json").read_text())["run_id"] == folder.name
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    for name in ("organamnist", "cifar10", "femnist", "aegis_cnn", "sme_cnn", "lenet", "ig", "label_skew",
                 "rotten_tomatoes", "wikitext2", "gpt2_small", "minilm", "medmnist", "none"):  # fmt: skip
        assert name in listed
    assert re.search(r"dager\s+\[text\]", listed) and re.search(r"ig\s+\[image\]", listed)
    assert re.search(r"generators.*\n(\s+\w+\s+.*\n)*\s+diffusion\s", listed)  # Aegis' generators listed
    assert main(["run", demo_config_path(), "fl.rounds=oops", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "config.fl.rounds: expected int" in err and "Traceback" not in err
    assert not (tmp_path / "bad").exists()
    assert main(["run", demo_config_path(), "audit.attacks.0.name=dlgx", "--out", str(tmp_path / "bad")]) == 2
    assert "unknown attack 'dlgx'" in capsys.readouterr().err


def test_audited_updates_are_what_the_runs_attacks_are_given():
    """runner.audited_updates (for measurements outside a run) observes the clients the run audits, with
    their data; build_simulation is the run's federation."""
    from gradleak.experiments.runner import audited_updates, build_simulation

    cfg = demo_cfg(["audit.clients=2", "fl.fraction=0.3"])
    sim = build_simulation(cfg)
    assert len(sim.clients) == cfg.data.num_clients
    observed = audited_updates(cfg)
    run = run_experiment(cfg)
    attacked = [r for r in run.records if r["kind"] == "attack"]
    assert [o.update.metadata["client_id"] for o, _ in observed] == [r["client_id"] for r in attacked]
    for (obs, truth), rec in zip(observed, attacked, strict=True):
        assert len(truth) == rec["batch_size"] == cfg.audit.training.batch_size
        assert obs.update.kind == "gradient" and obs.training == cfg.audit.training


def test_a_dp_defenses_epsilon_is_recorded_with_every_attacked_update(tmp_path):
    """dp_sgd at a stated sample rate: each attack record carries the accountant's epsilon for the audited
    FedSGD step (one step at q = 0.1, sigma 1), and its delta; a run without a DP defense carries none."""
    from gradleak.defenses.dp_sgd import epsilon

    extra = ["audit.clients=2", "defenses=[{name = 'dp_sgd', sample_rate = 0.1, noise_multiplier = 1.0}]"]
    out = run_experiment(demo_cfg(extra), store=ResultStore(tmp_path / "r.sqlite"))
    attacks = out.of_kind("attack")
    assert len(attacks) == 2
    for a in attacks:
        assert a["epsilon"] == pytest.approx(epsilon(1.0, 0.1, 1, 1e-5), rel=1e-12) and a["delta"] == 1e-5
    plain = run_experiment(demo_cfg(), store=ResultStore(tmp_path / "p.sqlite")).of_kind("attack")
    assert "epsilon" not in plain[0]


def test_a_run_is_resumed_across_commits_that_change_no_code(tmp_path, monkeypatch):
    """The fingerprint reads the code's digest, not the git commit: a docs commit keeps it, a changed
    package file (not a __pycache__ one), an edited plugin or another config gives a new one."""
    import gradleak
    from gradleak.experiments import runner

    cfg, env = demo_cfg(), runner.environment()
    assert env["code"] == runner.code_digest()
    assert runner.fingerprint(cfg, {**env, "git_commit": "another"}) == runner.fingerprint(cfg, env)
    assert runner.fingerprint(cfg, {**env, "code": "other"}) != runner.fingerprint(cfg, env)
    other = dataclasses.replace(
        cfg, experiment=dataclasses.replace(cfg.experiment, seed=cfg.experiment.seed + 1)
    )
    assert runner.fingerprint(other, env) != runner.fingerprint(cfg, env)

    pkg = tmp_path / "gradleak"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "sub" / "m.py").write_text("y = 2\n")

    def digest() -> str:
        runner._package_digest.cache_clear()
        return runner.code_digest()

    monkeypatch.setattr(gradleak, "__file__", str(pkg / "__init__.py"))
    try:
        first = digest()
        (pkg / "sub" / "__pycache__").mkdir()
        (pkg / "sub" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\0")
        assert digest() == first
        (pkg / "sub" / "m.py").write_text("y = 3\n")
        assert digest() != first
        plugin = tmp_path / "my_plugin.py"
        plugin.write_text("z = 1\n")
        changed = digest()
        monkeypatch.setattr(runner, "plugin_sources", lambda: [plugin])
        with_plugin = digest()
        assert with_plugin != changed
        plugin.write_text("z = 2\n")  # an edited plugin is other code
        assert digest() != with_plugin
    finally:
        runner._package_digest.cache_clear()
