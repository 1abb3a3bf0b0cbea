"""Random configs and overrides: each is accepted or refused with a ConfigError that names the key; nothing
else escapes (no TypeError, no traceback from deep inside), and an accepted config re-validates."""

from __future__ import annotations

import math
import re

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
    "audit.grant_lengths",
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
    """The error names one of the overridden keys: its last name as a word (``lr``, ``rounds``), or for
    an array element its array and index as the message writes them (``audit.attacks[0]``)."""
    for key, _ in items:
        parts = key.split(".")
        names = [p for p in parts if not p.isdigit()]
        if re.search(rf"(?<![\w]){re.escape(names[-1])}(?![\w])", message):
            return True
        for j, part in enumerate(parts):  # an array element: ``audit.attacks[0]`` (and what follows)
            if part.isdigit() and f"{'.'.join(parts[:j])}[{part}]" in message:
                return True
    return False


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
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


@settings(max_examples=200, deadline=None, derandomize=True)
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


# overrides that keep a run to about a second, drawn from domains that include edge cases
RUNNABLE = {
    "data.num_clients": st.integers(1, 12),
    "data.partition": st.sampled_from(["iid", "label_skew", "dirichlet"]),
    "fl.rounds": st.integers(0, 2),
    "fl.fraction": st.sampled_from([0.01, 0.25, 0.5, 1.0]),
    "fl.training.protocol": st.sampled_from(["fedsgd", "fedavg"]),
    "fl.training.optimizer": st.sampled_from(["sgd", "adam"]),
    "fl.training.batch_size": st.integers(1, 64),
    "fl.training.lr": st.sampled_from([1e-6, 1e-3, 0.5, 10.0, 1e6]),
    "fl.secure_aggregation": st.booleans(),
    "audit.clients": st.integers(0, 3),
    "audit.max_samples": st.sampled_from([1, 2, 3]),
    "audit.training.protocol": st.sampled_from(["fedsgd", "fedavg"]),
    "audit.training.batch_size": st.integers(1, 4),
    "audit.grant_labels": st.booleans(),
    "audit.training_public": st.booleans(),
    "audit.attacks.0.name": st.sampled_from(["ig", "dlg", "sme"]),
    "model.name": st.sampled_from(["aegis_cnn", "lenet", "sme_cnn"]),
}
BASE = [
    "data.train_limit=240", "data.test_limit=40", "data.num_clients=6", "data.partition_options={}",
    "audit.attacks.0.max_iterations=2", "audit.attacks.0.lr=0.1", "audit.attacks.0.tv_weight=0.0001",
]  # fmt: skip


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    chosen=st.dictionaries(st.sampled_from(sorted(RUNNABLE)), st.none(), min_size=1, max_size=6),
    data=st.data(),
)
def test_an_accepted_random_config_runs_to_the_end(tmp_path_factory, chosen, data):
    """What validation accepts must run: no crash after the checks (results may be poor, never missing)."""
    from gradleak.cli.demo import demo_config_path
    from gradleak.experiments import ResultStore, run_experiment

    lines = list(BASE)
    for key in chosen:
        lines.append(f"{key}={as_toml(data.draw(RUNNABLE[key], label=key))}")
    if any(k.startswith("audit.attacks.0.name") for k in chosen):  # other attacks take other options
        lines = [ln for ln in lines if not ln.startswith(("audit.attacks.0.lr", "audit.attacks.0.tv_weight"))]
    keys = [(ln.split("=")[0], None) for ln in lines]
    try:
        cfg = load_config(demo_config_path(), lines)
    except ConfigError as exc:
        assert _mentions_key(str(exc), keys), (lines, str(exc))
        return
    store = ResultStore(tmp_path_factory.mktemp("run") / "s.sqlite")
    try:
        out = run_experiment(cfg, store=store)
    except ConfigError as exc:  # data-dependent (a partition too fine for the data): before any work
        assert _mentions_key(str(exc), keys) and store.runs(include_unfinished=True) == [], str(exc)
        return
    assert [r.run_id for r in store.runs()] == [out.run_id]
    assert len(out.of_kind("round")) == cfg.fl.rounds and out.records[-1]["kind"] == "summary"
