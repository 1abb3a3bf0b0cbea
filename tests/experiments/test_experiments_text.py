"""Text audits through the same runner as image audits, from TOML (issue 18, item 1): a federation of
text clients trains a transformer, the audited clients' FedSGD gradients are attacked, each score stands
beside the same attack on a norm-matched random update (the text null floor, item 3), and a grid's cells
share the federation and the audited clients."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradleak.experiments import ResultStore, load_config, run_experiment
from gradleak.experiments.config import ConfigError
from gradleak.experiments.grid import run_grid
from gradleak.experiments.setup import build_setup
from gradleak.federation import derive_seed
from gradleak.metrics.text import decode

ROOT = Path(__file__).resolve().parents[2]
WIKI = ROOT / "examples" / "wikitext2_gpt2_dager.toml"
SMALL = ["data.train_limit=120", "data.test_limit=40", "data.num_clients=6", "fl.fraction=0.5"]


def test_a_causal_lm_audit_runs_from_toml_and_dager_reads_the_clients_text(tmp_path):
    cfg = load_config(WIKI, SMALL)
    out = run_experiment(cfg, store=ResultStore(tmp_path / "s.sqlite"))
    rounds, attacks = out.of_kind("round"), out.of_kind("attack")
    summary = out.of_kind("summary")[0]
    assert summary["task"] == "causal_lm" and len(rounds) == 2
    # utility: AdamW FedAvg lowers the test perplexity from round to round; the summary is the last round's
    assert rounds[1]["perplexity"] < rounds[0]["perplexity"] < 60000
    assert summary["final_perplexity"] == rounds[1]["perplexity"]
    assert summary["final_accuracy"] == rounds[1]["accuracy"]
    dager = [r for r in attacks if r["attack"] == "dager"]
    assert len(dager) == 2 and len({r["client_id"] for r in dager}) == 2
    # the clients' true sequences come from the training texts (decoded with the model's tokenizer)
    setup = build_setup(cfg)
    train_texts = set(decode(setup.tokenizer, setup.train.batch().sequences()))
    for r in dager:
        assert r["batch_size"] == 2 and set(r["true_texts"]) <= train_texts
        # DAGER is exact on an undefended gradient of 2 x <= 16 tokens in a 64-wide model: every sequence
        assert sorted(r["texts"]) == sorted(r["true_texts"]) and r["exact"] == 1.0 and r["rouge1"] == 1.0
        # beside its floor: on a random update of the same norm DAGER finds nothing
        assert r["floor_null_rouge1"] == 0.0 and r["rouge1_beyond_floor"] == 1.0 and r["valid"] is True
    rows = [r for r in attacks if r["attack"] == "embedding_norm"]
    for r in rows:  # an unordered token set, scored as one: high ROUGE-1, no exact sequence
        assert 0.5 < r["rouge1"] < 1.0 and r["exact"] == 0.0 and r["recovered_sequences"] == 1


def test_a_text_grid_shares_the_federation_and_aegis_blocks_dager(tmp_path):
    cfg = load_config(WIKI, [*SMALL, "fl.rounds=1", "grid.defenses=['none', 'aegis_llm']",
                             "audit.attacks=[{name = 'dager', vocab = 'embedding'}]"])  # fmt: skip
    grid = run_grid(cfg, store=ResultStore(tmp_path / "g.sqlite"))
    none, aegis = (c.outcome for c in grid.cells)
    assert none.of_kind("round")[0]["clients"] == aegis.of_kind("round")[0]["clients"]
    by_client = [{r["client_id"]: r for r in o.of_kind("attack")} for o in (none, aegis)]
    assert set(by_client[0]) == set(by_client[1]) and len(by_client[0]) == 2
    for cid, plain in by_client[0].items():
        defended = by_client[1][cid]
        assert defended["true_texts"] == plain["true_texts"]  # the same audited batch in both cells
        assert plain["rouge1"] == 1.0 and defended["rouge1"] == 0.0 and defended["texts"] == []
    rows = {r["defense"]: r for r in grid.summary()}
    assert rows["none"]["rouge1_beyond_floor"] == 1.0 and rows["aegis_llm"]["rouge1_beyond_floor"] == 0.0
    assert rows["aegis_llm"]["perplexity"] == aegis.of_kind("summary")[0]["final_perplexity"]


def test_the_model_seed_is_derived_or_given(tmp_path):
    cfg = load_config(WIKI, [*SMALL, "model.seed=7"])
    assert cfg.model.seed == 7
    a, b = build_setup(cfg), build_setup(load_config(WIKI, [*SMALL, "model.seed=7"]))
    c = build_setup(load_config(WIKI, SMALL))  # derived from experiment.seed
    wa, wb, wc = (next(s.model.parameters()) for s in (a, b, c))
    assert bool((wa == wb).all()) and not bool((wa == wc).all())
    assert derive_seed(0, 0x30DE) != 7


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.name='aegis_cnn'"], "model.task is for text models"),
    (["model.task='classification'"], "has no labels"),
    (["model.task='masked_lm'"], "model.task must be one of"),
    (["data.partition='label_skew'"], "splits by label.*has no labels"),
    (["data.options.max_tokens=100"], "max_tokens"),
    (["audit.attacks=['ig']"], "works on image tasks"),
    (["audit.attacks=['lamp']", "audit.training={protocol='fedavg', optimizer='adam', batch_size=2}"],
     r"'lamp' reads a FedAvg delta as plain SGD's mean gradient.*optimizer 'adam'"),
    (["audit.attacks=['tag']", "audit.training={protocol='fedavg', batch_size=2}",
      "audit.training_public=false"], r"'tag' reads a FedAvg delta as plain SGD's mean gradient"),
])  # fmt: skip
def test_bad_text_configs_fail_before_any_training(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_experiment(load_config(WIKI, [*SMALL, *overrides]), store=ResultStore(tmp_path / "s.sqlite"))
    assert not (tmp_path / "s.sqlite").exists() or not ResultStore(tmp_path / "s.sqlite").runs()
