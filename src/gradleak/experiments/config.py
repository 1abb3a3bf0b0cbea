"""Experiment configuration: a TOML file parsed into validated dataclasses, with ``key=value`` overrides.

Layout (every section optional except where noted; see ``examples/`` and the embedded ``demo.toml``)::

    [experiment]  name, seed, data_root
    [data]        dataset, train_split, test_split, train_limit, test_limit, num_clients, partition,
                  [data.partition_options]
    [model]       name, [model.options]
    [fl]          rounds, fraction, server_lr, server_optimizer, server_weight_decay, secure_aggregation,
                  eval_every, [fl.training]
    [engine]      name ("inprocess" or "flower": Flower's simulation engine on Ray), [engine.options]
    [audit]       clients, grant_labels, grant_lengths, training_public, [audit.training],
                  [[audit.attacks]] (name + options)
    [[defenses]]  name + options

Unknown keys, wrong types and unknown registry names are rejected before any work starts.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradleak.attacks import model_modifying
from gradleak.data.partition import partition_options
from gradleak.defenses.presets import resolve
from gradleak.device import DeviceError, parse_device
from gradleak.federation.engines import FederationCheck
from gradleak.federation.server import clients_per_round, update_kind
from gradleak.federation.simulation import PICKS, FLConfig
from gradleak.models.adapters import AdapterConfig
from gradleak.models.text import TASKS as TEXT_TASKS
from gradleak.options import OptionError, check_value
from gradleak.plugins import PluginError, is_plugin_file, load_plugins
from gradleak.registry import ATTACKS, DATASETS, DEFENSES, ENGINES, MODELS, Registry
from gradleak.spec import ComponentSpec
from gradleak.types import MODES, AttackNeeds, LocalTraining
from gradleak.update import DEFAULT_BATCHING, DEFAULT_LOSS
from gradleak.validation import safe_name


class ConfigError(ValueError):
    """A configuration problem; the message names the key."""


def _known(registry: Registry[Any], name: str, key: str) -> None:
    """``name`` is registered in ``registry``; else a ConfigError naming ``key`` and the known names."""
    try:
        registry.entry(name)
    except KeyError as exc:
        raise ConfigError(f"{key}: {exc}") from None


@dataclass(frozen=True)
class ExperimentSection:
    """``name``: the run's name, also its output folder's (letters, digits, ``.``, ``_``, ``=``, ``-``; no
    path).
    ``plugins``: modules (installed module names, or ``.py`` paths relative to the config file, which load
    only when the caller trusts the config's code: ``gradleak run --trust-config-plugins``) imported before
    the rest of the config is read, so that it can name the data sets, models, attacks and defenses they
    register (:mod:`gradleak.plugins`). ``resource_limits``: refuse a run whose estimated cost does not fit
    this machine (:mod:`gradleak.experiments.resources`); false runs it anyway. ``device``: where the model,
    the clients' training, the defenses in their loop and the attacks compute (``"cpu"``, ``"cuda"``,
    ``"cuda:1"``; :mod:`gradleak.device`); a device this machine lacks is refused before any work."""

    name: str = "experiment"
    seed: int = 0
    data_root: str | None = None
    plugins: list[str] = field(default_factory=list)
    resource_limits: bool = True
    device: str = "cpu"

    def __post_init__(self) -> None:
        try:
            safe_name(self.name, "experiment.name")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        try:
            object.__setattr__(self, "device", str(parse_device(self.device, "experiment.device")))
        except DeviceError as exc:
            raise ConfigError(str(exc)) from None
        if not isinstance(self.plugins, list) or not all(isinstance(p, str) and p for p in self.plugins):
            raise ConfigError(
                f"experiment.plugins must be a list of module names or paths, got {self.plugins!r}"
            )


@dataclass(frozen=True)
class DataSection:
    dataset: str = "organamnist"
    train_split: str = "train"
    test_split: str = "test"
    train_limit: int | None = None
    test_limit: int | None = None
    num_clients: int = 100
    partition: str = "label_skew"
    partition_options: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)  # the loader's, e.g. medmnist's flag
    holdout: float = 0.2  # test share when train_split == test_split (CIFAR-10 and PathMNIST: test only)

    def __post_init__(self) -> None:
        if not 0.0 < self.holdout < 1.0:
            raise ConfigError(f"data.holdout must be in (0, 1), got {self.holdout}")
        n = self.num_clients
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"data.num_clients must be an int >= 1, got {self.num_clients!r}")
        for key in ("train_limit", "test_limit"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise ConfigError(f"data.{key} must be >= 1, got {v}")


@dataclass(frozen=True)
class ModelSection:
    """The global model: a registered ``name`` with its ``options``. ``task`` (text models only):
    ``"causal_lm"`` or ``"classification"``, by default the model's own (``gradleak list``). ``seed``: the
    initialisation seed, by default derived from ``experiment.seed``. ``mode``: the module mode the
    clients train in, ``"train"`` (BatchNorm normalises with the batch's statistics and updates its running
    ones; dropout on) or ``"eval"`` (running statistics, no dropout); by default the task's (images
    ``"train"``, as a PyTorch loop trains; text ``"eval"``, paper 002's fine-tuning). ``adapter`` (text
    models): train adapters (LoRA, bottleneck) instead of the whole model
    (:mod:`gradleak.models.adapters`)."""

    name: str = "aegis_cnn"
    options: Mapping[str, Any] = field(default_factory=dict)
    task: str | None = None
    seed: int | None = None
    mode: str | None = None
    adapter: AdapterConfig | None = None

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in MODES:
            raise ConfigError(f"model.mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.task is not None and self.task not in TEXT_TASKS:
            raise ConfigError(f"model.task must be one of {list(TEXT_TASKS)}, got {self.task!r}")


@dataclass(frozen=True)
class EngineSection:
    """Where the clients train (:mod:`gradleak.federation.engines`); the results do not depend on it."""

    name: str = "inprocess"
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AuditSection:
    """Which updates get attacked and what the attacker is granted.

    ``clients``: how many of the next round's sampled clients to audit (0 disables the audit).
    ``training``: the recipe of the audited round (e.g. FedSGD on a small batch).
    ``training_public``: whether the attacker knows that recipe; ``grant_labels``: whether it knows labels;
    ``grant_lengths``: whether it knows each text sample's length (LAMP's ``know_padding``; text data only).
    ``max_samples``: audited clients keep only ``max_samples`` of their samples (None: all), the first ones
    or, with ``pick = "random"``, a seeded random subset (the same for every attack of the audit); the first
    samples of a client of a class-ordered data set (CIFAR-10) are one or two classes.
    ``public_dataset`` / ``public_split`` / ``public_limit``: the server's auxiliary data for malicious-model
    attacks (imprint bins, autoencoders); by default the experiment's held-out test set, never client data.
    ``views``: how many times the server broadcasts the audited model to the audited clients (1: once).
    Each time a client trains on the same samples with fresh randomness (its defenses' noise draws; a
    FedAvg client's batch order; a FedSGD client's batch must be all its audited samples, so
    ``max_samples <= training.batch_size``); an
    honest-server attack's observation carries the further updates as ``Observation.views``
    (:mod:`gradleak.attacks.noise`: what averaging them buys; every repeat is held in memory for the
    whole audit, K full updates per audited client); malicious-model attacks see one round; refused under
    secure aggregation (the server sees only a sum).
    """

    clients: int = 1
    max_samples: int | None = None
    pick: str = "first"
    public_dataset: str | None = None
    public_split: str | None = None
    public_limit: int | None = 1000
    training: LocalTraining = field(default_factory=lambda: LocalTraining(protocol="fedsgd", batch_size=4))
    training_public: bool = True
    grant_labels: bool = False
    grant_lengths: bool = False
    attacks: tuple[ComponentSpec, ...] = (ComponentSpec("ig"),)
    views: int = 1

    def __post_init__(self) -> None:
        if self.clients < 0:
            raise ConfigError(f"audit.clients must be >= 0, got {self.clients}")
        if not isinstance(self.views, int) or isinstance(self.views, bool) or self.views < 1:
            raise ConfigError(f"audit.views must be an int >= 1, got {self.views!r}")
        for key in ("max_samples", "public_limit"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise ConfigError(f"audit.{key} must be >= 1, got {v}")
        if self.pick not in PICKS:
            raise ConfigError(f"audit.pick must be one of {list(PICKS)}, got {self.pick!r}")
        if self.public_dataset is not None:
            _known(DATASETS, self.public_dataset, "audit.public_dataset")


@dataclass(frozen=True)
class GridSection:
    """A defense x attack grid on one federation (:mod:`gradleak.experiments.grid`): every cell runs the
    experiment with one of ``defenses`` (``"none"`` is the undefended baseline) and every attack of
    ``[audit]``, with the same seed, so the same partition, sampled clients and audited clients."""

    defenses: tuple[ComponentSpec, ...] = ()


@dataclass(frozen=True)
class ExperimentConfig:
    experiment: ExperimentSection = field(default_factory=ExperimentSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    fl: FLConfig = field(default_factory=FLConfig)
    audit: AuditSection = field(default_factory=AuditSection)
    defenses: tuple[ComponentSpec, ...] = ()
    engine: EngineSection = field(default_factory=EngineSection)
    grid: GridSection = field(default_factory=GridSection)

    def __post_init__(self) -> None:
        _known(DATASETS, self.data.dataset, "data.dataset")
        try:
            DATASETS.make_config(self.data.dataset, self.data.options)
        except OptionError as exc:
            raise ConfigError(f"data.options: {exc}") from None
        _known(MODELS, self.model.name, "model.name")
        if self.model.task is not None and MODELS.entry(self.model.name).modality != "text":
            raise ConfigError(f"model.task is for text models; {self.model.name!r} is not one")
        if MODELS.entry(self.model.name).modality == "text":  # a transformer's own loss, its own batches
            for key, recipe in (("fl.training", self.fl.training), ("audit.training", self.audit.training)):
                if (recipe.loss, recipe.batching) != (DEFAULT_LOSS, DEFAULT_BATCHING):
                    raise ConfigError(
                        f"{key}: loss = {recipe.loss!r}, batching = {recipe.batching!r} are for image "
                        f"classification; a text model trains with cross_entropy and random batches"
                    )
        _known(ENGINES, self.engine.name, "engine.name")
        try:
            engine = ENGINES.make_config(self.engine.name, self.engine.options)
        except OptionError as exc:
            raise ConfigError(f"engine: {exc}") from None
        for i, spec in enumerate(self.audit.attacks):
            _known(ATTACKS, spec.name, f"audit.attacks[{i}].name")
        for i, spec in enumerate(self.defenses):
            _known(DEFENSES, spec.name, f"defenses[{i}].name")
        for i, spec in enumerate(self.grid.defenses):
            _known(DEFENSES, spec.name, f"grid.defenses[{i}].name")
        try:
            valid = partition_options(self.data.partition)
        except ValueError as exc:
            raise ConfigError(f"data.partition: {exc}") from None
        unknown = sorted(set(self.data.partition_options) - set(valid))
        if unknown:
            raise ConfigError(
                f"unknown option(s) {unknown} in [data.partition_options] for {self.data.partition!r}; "
                f"valid options: {sorted(valid)}"
            )
        for name, value in self.data.partition_options.items():  # typed like their defaults
            _check_type(value, type(valid[name]), f"data.partition_options.{name}")
        if self.grid.defenses and self.defenses:
            raise ConfigError(
                "grid.defenses gives each cell its defense; leave [[defenses]] empty in a grid config"
            )
        labels = [cell_label(s) for s in self.grid.defenses]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"grid.defenses lists the same cell twice: {labels}")
        for key, registry, specs in (("audit.attacks", ATTACKS, self.audit.attacks),
                                     ("defenses", DEFENSES, self.defenses),
                                     ("grid.defenses", DEFENSES, self.grid.defenses)):  # fmt: skip
            for i, spec in enumerate(specs):
                try:
                    registry.make_config(spec.name, spec.options)
                except OptionError as exc:
                    raise ConfigError(f"{key}[{i}]: {exc}") from None
        self._check_modalities()
        self._check_adapters()
        if self.audit.clients > 0:
            self._check_attack_needs()
        a = self.audit
        if (
            a.views > 1
            and a.training.protocol == "fedsgd"
            and (a.max_samples is None or a.max_samples > a.training.batch_size)
        ):
            raise ConfigError(
                f"audit.views = {a.views} needs every view computed on the same samples, but a FedSGD client "
                f"draws its batch of {a.training.batch_size} afresh from "
                f"{'all its samples' if a.max_samples is None else f'its {a.max_samples} audited samples'} "
                "each time: set audit.max_samples <= audit.training.batch_size (the batch is then all of "
                "them)"
            )
        if a.views > 1 and a.training.protocol == "fedsgd" and a.training.batching != DEFAULT_BATCHING:
            raise ConfigError(
                f"audit.views = {a.views} needs every view computed on the same samples, but "
                f"batching = {a.training.batching!r} draws each view's FedSGD batch from one class of a "
                "fresh shuffle: use random batching with audit.max_samples <= audit.training.batch_size"
            )
        averaging = [i for i, spec in enumerate(a.attacks) if spec.options.get("average_views")]
        if averaging and a.views == 1 and a.clients > 0:
            raise ConfigError(
                f"audit.attacks[{averaging[0]}] averages views, but audit.views = 1 gives it one: set "
                "audit.views > 1 or drop average_views"
            )
        if a.views > 1 and a.clients > 0 and all(model_modifying(s.name, s.options) for s in a.attacks):
            raise ConfigError(
                f"audit.views = {a.views}, but every attack of the audit modifies the model, and "
                "malicious-model attacks see one round: views would be trained and never read"
            )
        if a.views > 1 and self.fl.secure_aggregation:
            raise ConfigError(
                f"audit.views = {a.views} hands an attack several updates of one client, but "
                "fl.secure_aggregation shows the server only their sum: set audit.views = 1"
            )
        per_round = clients_per_round(self.data.num_clients, self.fl.fraction)
        if self.audit.clients > per_round:
            raise ConfigError(
                f"audit.clients = {self.audit.clients} exceeds the {per_round} clients sampled per round "
                f"(fl.fraction = {self.fl.fraction} of data.num_clients = {self.data.num_clients}); lower "
                "audit.clients or raise fl.fraction"
            )
        if isinstance(engine, FederationCheck):
            try:
                engine.check_federation(secure_aggregation=self.fl.secure_aggregation, per_round=per_round,
                                        audited=self.audit.clients,
                                        random_subset=self.audit.pick == "random"
                                        and self.audit.max_samples is not None)  # fmt: skip
            except ValueError as exc:
                raise ConfigError(f"engine.options: {exc}") from None

    def _check_attack_needs(self) -> None:
        """Every attack can read what the audited round sends (:class:`~gradleak.types.AttackNeeds`)."""
        training = self.audit.training
        kind = update_kind(training)
        for i, spec in enumerate(self.audit.attacks):
            needs = getattr(ATTACKS.get(spec.name), "needs", AttackNeeds())
            if kind not in needs.update_kinds:
                kinds = " or ".join(needs.update_kinds)
                raise ConfigError(
                    f"audit.attacks[{i}] {spec.name!r} inverts {kinds} updates, but "
                    f"audit.training.protocol = {training.protocol!r} sends a {kind}"
                )
            if needs.public_recipe and not self.audit.training_public:
                raise ConfigError(
                    f"audit.attacks[{i}] {spec.name!r} needs the client's training recipe, but "
                    "audit.training_public = false hides it"
                )
            if (
                needs.sgd_delta
                and kind == "delta"
                and not (self.audit.training_public and training.plain_sgd)
            ):
                raise ConfigError(
                    f"audit.attacks[{i}] {spec.name!r} reads a FedAvg delta as plain SGD's mean gradient: it "
                    "needs audit.training_public = true and a plain SGD recipe (no momentum, no weight "
                    f"decay, random batches); got optimizer {training.optimizer!r}, momentum "
                    f"{training.momentum}, weight_decay {training.weight_decay}, "
                    f"batching {training.batching!r}"
                )

    def _check_modalities(self) -> None:
        """Every attack (of an audit that runs: ``audit.clients > 0``), defense and model must work on the
        data set's modality."""
        task = DATASETS.entry(self.data.dataset).modality
        parts: list[tuple[str, str | None]] = [("model.name", MODELS.entry(self.model.name).modality)]
        if self.model.adapter is not None:  # adapters wrap or hook the transformer family map's layers
            parts.append(("model.adapter", "text"))
        attacks = self.audit.attacks if self.audit.clients > 0 else ()
        parts += [(f"audit.attacks[{i}]", ATTACKS.entry(s.name).modality) for i, s in enumerate(attacks)]
        parts += [(f"defenses[{i}]", DEFENSES.entry(s.name).modality) for i, s in enumerate(self.defenses)]
        parts += [
            (f"grid.defenses[{i}]", DEFENSES.entry(s.name).modality) for i, s in enumerate(self.grid.defenses)
        ]
        if self.audit.grant_lengths:
            parts.append(("audit.grant_lengths", "text"))
        for key, modality in parts:
            if modality is not None and task is not None and modality != task:
                raise ConfigError(
                    f"{key} works on {modality} tasks, but data.dataset = {self.data.dataset!r} holds "
                    f"{task} data"
                )

    def _check_adapters(self) -> None:
        """A model that trains adapters only (LoRA, bottleneck) gets no defense that is defined on full
        fine-tuning (``Defense.adapters``), refused now rather than in every client's setup."""
        if self.model.adapter is None:
            return
        for key, specs in (("defenses", self.defenses), ("grid.defenses", self.grid.defenses)):
            for i, spec in enumerate(specs):
                if not getattr(DEFENSES.get(spec.name), "adapters", True):
                    raise ConfigError(
                        f"{key}[{i}] {cell_label(spec)!r} is defined on full fine-tuning, but model.adapter "
                        "trains adapters only; defend an adapter update with update_noise, dp_sgd or "
                        "pruning (docs/lora.md)"
                    )

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _check_type(value: Any, hint: Any, where: str) -> Any:
    try:
        return check_value(value, hint, where)
    except OptionError as exc:
        raise ConfigError(str(exc)) from None


def _build(cls: type, data: Mapping[str, Any], where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"[{where}] must be a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [{where}]; valid keys: {sorted(fields)}")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        hint = hints[key]
        sub = f"{where}.{key}"
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
        inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)] if optional else []
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, sub)  # type: ignore[arg-type]
        elif inner:  # an optional table: a table or nothing
            if value is None:
                kwargs[key] = None
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"{sub} must be a table, got {type(value).__name__} {value!r}")
            kwargs[key] = _build(typing.cast(type, inner[0]), value, sub)
        elif typing.get_origin(hint) is tuple:
            if not isinstance(value, list):
                raise ConfigError(f"{sub}: expected an array of tables, got {type(value).__name__}")
            kwargs[key] = tuple(_spec(v, f"{sub}[{i}]", key == "defenses") for i, v in enumerate(value))
        else:
            kwargs[key] = _check_type(value, hint, sub)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"[{where}]: {exc}") from None


def cell_label(spec: ComponentSpec) -> str:
    """A grid cell's name: ``none``, ``aegis``, ``batch_noise(sigma=0.01)``, a preset (``aegis_2ch``)."""
    if spec.label is not None:
        return spec.label
    if not spec.options:
        return spec.name
    return f"{spec.name}({', '.join(f'{k}={v}' for k, v in sorted(spec.options.items()))})"


def defenses_label(specs: Sequence[ComponentSpec]) -> str:
    """A run's defenses in one label: ``none``, ``aegis``, ``pruning(ratio=0.9) + batch_noise(...)``."""
    return " + ".join(cell_label(s) for s in specs) or "none"


def _spec(value: Any, where: str, presets: bool = False) -> ComponentSpec:
    """A component from TOML: a name, or a table of name and options (or the ``to_dict`` form, ``name``,
    ``options``, ``label``); with ``presets`` (defense lists), a preset's name stands for its defense and
    options, options beside it overriding the preset's."""
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, Mapping) or "name" not in value:
        raise ConfigError(f"{where}: expected a table with a 'name' key, got {value!r}")
    if not isinstance(value["name"], str):
        raise ConfigError(
            f"{where}.name: expected a string, got {type(value['name']).__name__} {value['name']!r}"
        )
    name = str(value["name"])
    opts = {k: v for k, v in value.items() if k != "name"}
    if isinstance(opts.get("options"), Mapping) and set(opts) <= {"options", "label"}:
        return ComponentSpec(name, dict(opts["options"]), opts.get("label"))  # a spec written by to_dict
    return resolve(ComponentSpec(name, opts), presets=presets)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"fl.rounds=2"`` -> (["fl", "rounds"], 2); the value is read as TOML, else kept as a string."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys in the raw TOML dict; ``audit.attacks.0.max_iterations=50`` indexes arrays."""
    for item in overrides:
        path, value = parse_override(item)
        node: Any = raw
        for i, part in enumerate(path[:-1]):
            if isinstance(node, list):
                node = node[_index(part, node, path[: i + 1])]
            elif isinstance(node, dict):
                node = node.setdefault(part, {})
            else:
                raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[:i])} is not a table")
        last = path[-1]
        if isinstance(node, list):
            node[_index(last, node, path)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[:-1])} is not a table")
    return raw


def _index(part: str, node: list[Any], path: list[str]) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override {'.'.join(path)}: {part!r} is not an index into an array of {len(node)}")
    return int(part)


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """A TOML file as a dict; a missing file or invalid TOML is a :class:`ConfigError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def load_config(
    source: str | Path | Mapping[str, Any],
    overrides: list[str] | None = None,
    *,
    trust_plugins: bool = False,
) -> ExperimentConfig:
    """Parse a TOML file (or an already-loaded mapping), apply overrides, validate everything.

    ``experiment.plugins`` that name a file (code that comes with the config) load only with
    ``trust_plugins``; installed module names load always (installed code is already trusted)."""
    raw = _plain(dict(source)) if isinstance(source, Mapping) else read_toml(source, "config file")
    raw = apply_overrides(raw, overrides or [])
    plugins = (
        raw.get("experiment", {}).get("plugins", []) if isinstance(raw.get("experiment"), Mapping) else []
    )
    if not isinstance(plugins, list) or not all(isinstance(p, str) and p for p in plugins):
        raise ConfigError(f"experiment.plugins must be a list of module names or paths, got {plugins!r}")
    files = [p for p in plugins if is_plugin_file(p)]
    if files and not trust_plugins:
        raise ConfigError(
            f"experiment.plugins names code files {files}: a config cannot run code unless you trust it "
            "(gradleak run --trust-config-plugins, or load_config(..., trust_plugins=True)); or pass them "
            "yourself with --plugin"
        )
    try:  # before the rest is validated: the config may name what they register
        base = None if isinstance(source, Mapping) else Path(source).parent
        load_plugins(plugins, base=base, search_cwd=False)
    except PluginError as exc:
        raise ConfigError(f"experiment.plugins: {exc}") from None
    try:
        cfg: ExperimentConfig = _build(ExperimentConfig, raw, "config")
        return cfg
    except KeyError as exc:  # unknown registry names
        raise ConfigError(str(exc.args[0])) from None
