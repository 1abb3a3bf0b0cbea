"""Config parsing and validation: every bad input gives one clear error naming the problem."""

from __future__ import annotations

import pytest

from gradleak.cli.demo import demo_config_path
from gradleak.experiments.config import ConfigError, load_config, parse_override


def test_demo_config_is_valid_and_overridable():
    cfg = load_config(
        demo_config_path(), ["fl.rounds=1", "audit.attacks.0.max_iterations=5", "experiment.name=x"]
    )
    assert cfg.fl.rounds == 1 and cfg.experiment.name == "x"
    assert cfg.audit.attacks[0].name == "ig" and cfg.audit.attacks[0].options["max_iterations"] == 5
    assert cfg.fl.training.optimizer == "adam" and cfg.fl.training.lr == pytest.approx(1e-3)
    assert cfg.audit.training.protocol == "fedsgd" and cfg.audit.training.batch_size == 4
    assert dict(cfg.data.partition_options) == {"max_classes_per_client": 5}


def test_override_values_are_typed():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=0.5") == (["a"], 0.5)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=organamnist") == (["a"], "organamnist")
    assert parse_override('a="3"') == (["a"], "3")
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("novalue")


@pytest.mark.parametrize(
    ("raw", "pattern"),
    [
        ({"fl": {"roundz": 2}}, r"unknown key\(s\) \['roundz'\] in \[config.fl\]"),
        ({"bogus": {}}, r"unknown key\(s\) \['bogus'\] in \[config\]"),
        ({"fl": {"rounds": "two"}}, r"config.fl.rounds: expected int, got str 'two'"),
        ({"fl": {"rounds": 2.5}}, r"config.fl.rounds: expected int"),
        ({"fl": {"fraction": 2.0}}, r"fraction must be in \(0, 1\]"),
        ({"fl": {"training": {"optimizer": "rmsprop"}}}, r"must be one of \['adam', 'adamw', 'sgd'\]"),
        ({"data": {"dataset": "mnist"}}, r"unknown dataset 'mnist'; known datasets: cifar10"),
        ({"model": {"name": "resnet"}}, r"unknown model 'resnet'"),
        ({"audit": {"attacks": [{"name": "magic"}]}}, r"unknown attack 'magic'"),
        (
            {"audit": {"attacks": [{"name": "ig", "iters": 3}]}},
            r"unknown option\(s\) \['iters'\] for attack 'ig'",
        ),
        ({"defenses": [{"name": "pruning", "ratio": 1.5}]}, r"pruning ratio must be in \[0, 1\)"),
        ({"data": {"partition": "weird"}}, r"unknown partitioner 'weird'"),
        (
            {"data": {"partition_options": {"k": 3}}},
            r"unknown option\(s\) \['k'\] in \[data.partition_options\]",
        ),
        ({"fl": 3}, r"\[config.fl\] must be a table"),
        ({"fl": {"training": {"batching": "sorted"}}}, r"batching must be one of \['random', 'same_label'\]"),
        (
            {
                "data": {"dataset": "rotten_tomatoes"},
                "model": {"name": "gpt2_tiny"},
                "fl": {"training": {"loss": "mse"}},
            },
            r"fl.training: loss = 'mse', batching = 'random' are for image classification",
        ),  # fmt: skip
    ],
)
def test_bad_config_is_one_clear_error(raw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(raw)


def test_bad_override_paths():
    with pytest.raises(ConfigError, match="not an index"):
        load_config(demo_config_path(), ["audit.attacks.5.lr=1"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/x.toml")


def test_invalid_toml(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[fl\nrounds = 1")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(p)


def test_a_renamed_preset_still_runs_with_a_warning_and_presets_resolve_once_everywhere(caplog):
    """The dp_* presets were batch_noise, which states no epsilon, under a DP name (issue 51 defect): they are
    batch_noise_* now; the old names still resolve, to the same defense and options, with a warning that
    says why, in a config, in defend() and as a (name, options) pair (a pair was not resolved before)."""
    import logging

    from gradleak.defenses.in_loop import build_defenses
    from gradleak.defenses.presets import resolve
    from gradleak.registry import PRESETS

    new = PRESETS.create("batch_noise_0.01")
    assert (new.defense, dict(new.options)) == ("batch_noise", {"clip": 1.0, "sigma": 0.01, "batch_size": 1})
    with caplog.at_level(logging.WARNING, logger="gradleak.registry"):
        old = resolve("dp_0.01")
    assert (old.name, dict(old.options), old.label) == ("batch_noise", dict(new.options), "dp_0.01")
    assert "'dp_0.01' is now called 'batch_noise_0.01'" in caplog.text and "no epsilon" in caplog.text
    built = build_defenses(["batch_noise_0.1", ("dp_0.001", {"clip": 2.0})])
    got = [(d.name, d.config.sigma, d.config.clip) for d in built]
    assert got == [("batch_noise", 0.1, 1.0), ("batch_noise", 0.001, 2.0)]
    assert "dp_0.01" not in PRESETS.names() and "batch_noise_0.01" in PRESETS.names()


def test_a_defense_preset_stands_for_its_defense_and_options_and_labels_its_cell():
    from gradleak.experiments.config import cell_label, defenses_label, load_config
    from gradleak.registry import PRESETS

    text = {"data": {"dataset": "rotten_tomatoes", "train_split": "all", "test_split": "all"},
            "model": {"name": "gpt2_tiny"}, "audit": {"attacks": ["dager"]},
            "grid": {"defenses": ["none", "aegis_2ch", {"name": "dp_0.01", "clip": 0.5}]}}  # fmt: skip
    cfg = load_config(text)
    single = load_config({**text, "grid": {}, "defenses": ["prune_90"]})
    none, two, dp = cfg.grid.defenses
    assert (two.name, dict(two.options), cell_label(two)) == ("aegis_llm", {"flood_mlp": False}, "aegis_2ch")
    assert dp.name == "batch_noise" and dict(dp.options) == {
        **PRESETS.create("batch_noise_0.01").options,
        "clip": 0.5,
    }
    assert cell_label(dp) == "dp_0.01(clip=0.5)" and cell_label(none) == "none"
    assert defenses_label(single.defenses) == "prune_90" and single.defenses[0].options == {"ratio": 0.9}
    assert load_config(cfg.to_dict()) == cfg  # the stored form reads back as the same config
    with pytest.raises(ConfigError, match="unknown defense 'prune_42'"):
        load_config({**text, "grid": {}, "defenses": ["prune_42"]})
