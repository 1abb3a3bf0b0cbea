"""Random configs and overrides: each is accepted or refused with a ConfigError that names the key; nothing
else escapes (no TypeError, no traceback from deep inside), and an accepted config re-validates."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradleak.experiments import load_config
from gradleak.experiments.config import ConfigError

KEYS = [
    "experiment.name", "experiment.seed", "experiment.data_root",
    "data.dataset", "data.train_split", "data.test_split", "data.train_limit", "data.test_limit",
    "data.num_clients", "data.partition", "data.holdout", "data.partition_options.classes_per_client",
    "data.partition_options.alpha", "model.name", "model.options.hidden",
    "fl.rounds", "fl.fraction", "fl.server_lr", "fl.secure_aggregation", "fl.eval_every",
    "fl.training.protocol", "fl.training.epochs", "fl.training.batch_size", "fl.training.lr",
    "fl.training.optimizer", "fl.training.shuffle",
    "audit.clients", "audit.max_samples", "audit.public_dataset", "audit.public_split", "audit.public_limit",
    "audit.training.batch_size", "audit.training.protocol", "audit.training_public", "audit.grant_labels",
    "audit.attacks.0.name", "audit.attacks.0.max_iterations", "audit.attacks.0.lr",
    "audit.attacks.0.tv_weight", "audit.attacks.0.restarts", "audit.attacks.0.bogus", "audit.attacks",
    "defenses", "experiment.bogus", "bogus.key", "fl.training.bogus",
]  # fmt: skip

NAMES = ["organamnist", "cifar10", "ig", "dlg", "dager", "robbing_the_fed", "aegis", "aegis_llm", "pruning",
         "lenet", "label_skew", "dirichlet", "fedsgd", "adam", "sgd", "xyz", ""]  # fmt: skip

toml_scalars = st.one_of(
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.booleans(),
    st.sampled_from(NAMES),
    st.text(alphabet="abc_09", max_size=6),
)


def as_toml(value: object) -> str:
    """The override's right-hand side as a user would type it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(as_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {as_toml(v)}" for k, v in value.items()) + "}"
    return f'"{value}"'


values = st.one_of(
    toml_scalars,
    st.lists(toml_scalars, max_size=3),
    st.lists(st.fixed_dictionaries({"name": st.sampled_from(NAMES)}), max_size=2),
    st.fixed_dictionaries({"name": st.sampled_from(NAMES), "max_iterations": toml_scalars}),
)
overrides = st.lists(st.tuples(st.sampled_from(KEYS), values), min_size=1, max_size=4)


def _mentions_key(message: str, items: list[tuple[str, object]]) -> bool:
    """The error names one of the overridden keys (its last component, or the component before an index)."""
    low = message.lower()
    for key, _ in items:
        parts = [p for p in key.split(".") if not p.isdigit()]
        if any(p.lower() in low for p in parts[-2:]):
            return True
    return False


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=overrides)
def test_random_overrides_are_accepted_or_refused_with_a_config_error_naming_the_key(items):
    from gradleak.cli.demo import demo_config_path

    lines = [f"{key}={as_toml(value)}" for key, value in items]
    try:
        cfg = load_config(demo_config_path(), lines)
    except ConfigError as exc:
        assert _mentions_key(str(exc), items), (lines, str(exc))
        return
    again = load_config(cfg.to_dict())  # what was accepted stays valid (e.g. stored and re-read)
    assert again == cfg


@settings(max_examples=200, deadline=None)
@given(doc=st.dictionaries(
    st.sampled_from(["experiment", "data", "fl", "audit", "model", "defenses", "x"]),
    st.one_of(toml_scalars, st.dictionaries(st.sampled_from(KEYS), toml_scalars, max_size=3)),
    max_size=4,
))  # fmt: skip
def test_random_config_documents_are_accepted_or_refused_with_a_config_error(doc):
    try:
        load_config(doc)
    except ConfigError as exc:
        assert str(exc)
