"""Run one experiment: data -> partition -> model -> FL rounds -> audited round -> attacks -> metrics.

Everything that can be checked without training is checked before work starts. Each finished unit (an FL
round, an attacked update, the summary) is committed to the store as one transaction, so a killed run
loses at most the unit in progress and the same command resumes it (:mod:`gradleak.experiments.store`).
Attacks receive only Observations built by :func:`gradleak.federation.server_view` (each client's update) or,
under secure aggregation, :func:`gradleak.federation.simulation.secure_observation` (the aggregate the
engine's secure round returns); ground truth meets the reconstructions only in the setup's ``score``
(:mod:`gradleak.experiments.setup`, one per data modality).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import functools
import hashlib
import importlib.metadata
import json
import logging
import platform
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

import gradleak
from gradleak.attacks import create_attack, model_modifying
from gradleak.audit import attack_update, audit_generators
from gradleak.audit.preflight import Preflight, PreflightError, enforce, run_checks
from gradleak.data import partition
from gradleak.data.base import ImageDataset
from gradleak.defenses.base import composed_claims
from gradleak.defenses.in_loop import build_defenses
from gradleak.device import DeviceError, usable_device
from gradleak.experiments.config import ConfigError, ExperimentConfig
from gradleak.experiments.figures import matched_figure, save_reconstruction_grid
from gradleak.experiments.measurement import git_info
from gradleak.experiments.resources import ResourceError, check_resources
from gradleak.experiments.setup import build_setup, concat
from gradleak.experiments.store import Checkpoint, ResultStore, RunRow, normalise
from gradleak.federation import FederatedSimulation, derive_seed, server_view
from gradleak.federation.engines import EngineRunner
from gradleak.federation.server import update_kind
from gradleak.federation.simulation import Engine, RoundResult, secure_observation
from gradleak.plugins import loaded_sources as plugin_sources
from gradleak.progress import enabled as bars_on
from gradleak.registry import ENGINES
from gradleak.tasks import Dataset
from gradleak.tasks.client import ClientResult
from gradleak.types import (
    ClientCustomizingAttack,
    ModelModifyingAttack,
    Observation,
)
from gradleak.update_io import tensors_from_bytes, tensors_to_bytes

log = logging.getLogger(__name__)


@dataclass
class RunOutcome:
    """What a finished run produced (also in the store)."""

    run_id: str
    config: ExperimentConfig
    records: list[dict[str, Any]]
    figures: list[Path] = field(default_factory=list)
    out_dir: Path | None = None  # where this run's files went
    resumed: bool = False  # continued an unfinished run of the same config

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == kind]


@functools.cache
def _package_digest() -> str:
    """The installed gradleak package's files (relative path and bytes, ``__pycache__`` left out) and every
    installed distribution's name and version, plus the Python version."""
    root = Path(gradleak.__file__).parent
    h = hashlib.sha256(platform.python_version().encode())
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts:
            continue
        h.update(f"{rel.as_posix()}\0".encode())
        h.update(path.read_bytes())
    dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    h.update("\n".join(dists).encode())
    return h.hexdigest()


def code_digest() -> str:
    """A digest of the code a run executes: the package and the installed libraries
    (:func:`_package_digest`) and the source of every plugin loaded so far. A commit that changes no code
    (docs, results, tests, benchmark configs, which the run's config covers) keeps it."""
    h = hashlib.sha256(_package_digest().encode())
    for path in plugin_sources():
        h.update(f"{path}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


def environment() -> dict[str, Any]:
    """Where a run happened: git commit, the code's digest, machine, library versions."""
    commit = git_info()["commit"]  # the package's checkout, not the working directory's repository
    return {
        "gradleak": gradleak.__version__,
        "git_commit": commit or "unknown",
        "code": code_digest(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _truth_for(obs: Observation, results: list[ClientResult]) -> Dataset:
    """The data behind an observation: the client's, or under secure aggregation the union of the data of
    ``results`` (the clients in the aggregate; a real protocol's results carry no update)."""
    if not obs.aggregated:
        cid = obs.update.metadata.get("client_id")
        received = [r for r in results if r.update is not None and r.truth is not None]
        return next(r.truth for r in received if r.update.metadata.get("client_id") == cid)  # type: ignore
    return concat([r.truth for r in results if r.truth is not None])


def served_models(attack: ModelModifyingAttack, broadcast: nn.Module, count: int) -> list[nn.Module]:
    """The model each of ``count`` audited clients is sent: its own variant for a client-customising
    attack (LOKI), else the one modified model."""
    if isinstance(attack, ClientCustomizingAttack):
        return [attack.customize(broadcast, slot) for slot in range(count)]
    return [broadcast] * count


def collect_malicious(
    sim: FederatedSimulation,
    attack: ModelModifyingAttack,
    broadcast: nn.Module,
    ids: list[int],
    cfg: ExperimentConfig,
) -> list[ClientResult]:
    """Audited clients train the server's model; a client-customising attack sends each its own variant."""
    a = cfg.audit
    if not isinstance(attack, ClientCustomizingAttack):
        return sim.collect(ids, a.training, broadcast=broadcast, max_samples=a.max_samples, pick=a.pick)
    return [
        r
        for slot, cid in enumerate(ids)
        for r in sim.collect(
            [cid],
            a.training,
            broadcast=attack.customize(broadcast, slot),
            max_samples=a.max_samples,
            pick=a.pick,
        )
    ]


def with_views(obs: Observation, views: list[list[ClientResult]]) -> Observation:
    """``obs`` with its client's updates of the repeated broadcasts (``audit.views``) as its views; a
    repeat whose update did not reach the server (a defense failed closed) is left out."""
    cid = obs.update.metadata.get("client_id")
    found = [r.update for repeat in views for r in repeat if r.client_id == cid and r.update is not None]
    return dataclasses.replace(obs, views=tuple(found))


def _views_claims(obs: Observation) -> dict[str, Any]:
    """What a record of an honest-server attack adds under ``audit.views > 1``: how many views the server
    had of this client (fewer than asked when a repeat failed closed), and the formal privacy of all of
    them together (``epsilon_views`` / ``delta_views``, where a defense states one; where a stated claim
    cannot be composed, none, and ``epsilon_views_error`` says why)."""
    record: dict[str, Any] = {"views": 1 + len(obs.views)}
    try:
        composed = composed_claims([u.metadata for u in (obs.update, *obs.views)])
    except ValueError as exc:
        log.warning("audit: the views' privacy claims cannot be composed: %s", exc)
        return {**record, "epsilon_views_error": str(exc)}
    return {**record, **{f"{k}_views": v for k, v in composed.items()}}


def any_model_modifying(cfg: ExperimentConfig) -> bool:
    return any(model_modifying(s.name, s.options) for s in cfg.audit.attacks)


def fingerprint(cfg: ExperimentConfig, env: Mapping[str, Any]) -> str:
    """A digest of the whole config and the code (:func:`code_digest`): the same command on the same code
    resumes the same run, across commits that change no code (a long benchmark survives a docs commit);
    after a code or library change it starts a new one rather than mixing two versions."""
    key = {"config": cfg.to_dict(), "code": env.get("code")}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


# Rounds are committed with the model checkpoint once the work since the last commit is at least this many
# times the last checkpoint's writing time (every round for a small model; about once a minute for a
# 135M-parameter language model, whose checkpoint with the server's AdamW state is 1.6 GB), so that
# checkpoints cost at most about 10 % of the run; a kill loses the uncommitted rounds, which a resume redoes.
CHECKPOINT_OVERHEAD = 10.0


class _Recorder:
    """A run's records: kept in memory, and committed per finished unit when there is a store."""

    def __init__(self, store: ResultStore | None, run_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self.done: set[str] = store.units(run_id) if store is not None else set()
        self.stored: list[dict[str, Any]] = store.records(run_id) if store is not None and self.done else []
        self.new: list[dict[str, Any]] = []

    def commit(
        self,
        unit: str,
        records: list[dict[str, Any]],
        checkpoint: Checkpoint | None = None,
        also: tuple[str, ...] = (),
    ) -> None:
        """Commit ``unit`` (and the units it completes, ``also``) with its records."""
        if self.store is not None:
            self.store.commit_unit(self.run_id, unit, records, checkpoint=checkpoint, also=also)
        self.done.update((unit, *also))
        self.new += [normalise(r) for r in records]  # as a resumed run reads them back from the store

    def all(self) -> list[dict[str, Any]]:
        return self.stored + self.new


def _round_record(rr: RoundResult) -> dict[str, Any]:
    errors = {str(k): v for k, v in rr.errors.items()}  # JSON keys are strings
    return {"kind": "round", "round": rr.round, "clients": rr.client_ids, "accuracy": rr.accuracy,
            "seconds": rr.seconds, "dropped": rr.dropped, "errors": errors, **rr.metrics}  # fmt: skip


ROUND_KEYS = ("kind", "round", "clients", "accuracy", "seconds", "dropped", "errors")


def _round_result(record: Mapping[str, Any]) -> RoundResult:
    errors = {int(k): str(v) for k, v in record.get("errors", {}).items()}
    metrics = {k: float(v) for k, v in record.items() if k not in ROUND_KEYS}
    return RoundResult(record["round"], list(record["clients"]), [], None, record["accuracy"],
                       float(record["seconds"]), list(record["dropped"]), errors, metrics)  # fmt: skip


def _resume(sim: FederatedSimulation, store: ResultStore, rec: _Recorder) -> None:
    """Put the simulation where the killed run stopped: after its last committed round."""
    ckpt = store.checkpoint(rec.run_id)
    if ckpt is None:
        return
    history = [_round_result(r) for r in rec.stored if r["kind"] == "round"]
    sim.restore(tensors_from_bytes(ckpt.tensors), ckpt.state, history)
    log.info("resumed run %s after %d rounds", rec.run_id, len(history))


def run_experiment(
    cfg: ExperimentConfig,
    *,
    store: ResultStore | None = None,
    out_dir: str | Path | None = None,
    progress: bool | None = None,
    resume: bool = True,
    per_run_folder: bool = False,
) -> RunOutcome:
    """Run ``cfg`` end to end.

    Everything that can be checked without training is checked first: the store file, the data files,
    the public data's shape. With a ``store``, each finished unit (an FL round with the model checkpoint,
    an attacked update, the summary) is committed as it finishes and the run is marked complete at the
    end; with ``resume``, the same config after a crash or ``kill -9`` continues the unfinished run and
    gives the records an uninterrupted run gives. Figures go to ``out_dir`` (``out_dir/RUN_ID`` with
    ``per_run_folder``, as the CLI does, so that concurrent runs never share a file), written atomically
    under names fixed by the unit. ``progress``: bars for the rounds, clients, attacks and their iterations
    (None: as :mod:`gradleak.progress` is switched; the ``gradleak`` command turns it on).
    """
    if store is not None:
        store.check()
    progress = bars_on() if progress is None else progress
    run = _Run(cfg, store, progress)
    run_id = f"{cfg.experiment.name}-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    resumed = False
    if store is not None:
        env = environment()
        row = RunRow(run_id, cfg.experiment.name, run.started, "", cfg.to_dict(), env,
                     "running", fingerprint(cfg, env))  # fmt: skip
        run_id, resumed = store.begin_run(row, resume=resume)
    folder = None if out_dir is None else (Path(out_dir) / run_id if per_run_folder else Path(out_dir))
    try:  # the engine (in this process, or Flower's simulation on Ray) runs the clients of every round
        records = run.engine.run(
            run.sim.clients, run.sim.defenses, functools.partial(run.execute, run_id, resumed, folder),
            progress=progress, data_root=cfg.experiment.data_root,
        )  # fmt: skip
    except BaseException:
        if store is not None:  # the finished units stay; the same command resumes from them
            store.release(run_id)
        raise
    figures = [folder / r["figure"] for r in records if folder is not None and r.get("figure")]
    return RunOutcome(run_id, cfg, records, figures, folder, resumed)


def preflight(cfg: ExperimentConfig, model: nn.Module, train: Dataset) -> list[str]:
    """The pre-flight checks (:mod:`gradleak.audit.preflight`) of ``cfg``'s audit on its built model and
    a sample of its training data: errors raise :class:`ConfigError`, warnings are logged and returned."""
    if cfg.audit.clients == 0:
        return []
    a = cfg.audit
    images = train.images[:256] if isinstance(train, ImageDataset) else None
    context = Preflight(a.attacks, model, update_kind(a.training), a.training_public, images, a.training)
    try:
        return enforce(run_checks(context), "audit")
    except PreflightError as exc:
        raise ConfigError(str(exc)) from None


def build_simulation(cfg: ExperimentConfig) -> FederatedSimulation:
    """``cfg``'s federation, built and checked as :func:`run_experiment` builds it (data, partition, the
    initial model, the defenses, the task), before any round: for measurements on the engine's clients
    outside a run (e.g. what a client's Aegis cache is worth as training data)."""
    return _Run(cfg, None, progress=False).sim


def audited_updates(cfg: ExperimentConfig) -> list[tuple[Observation, Dataset]]:
    """What an honest server observes in ``cfg``'s audited round (after its FL rounds, nothing stored), each
    observation with the data behind it: what every non-malicious attack of the config is given. For
    measurements of an attack's internals (its per-iteration cost, the geometry of the client's path) on the
    engine's clients and recipe."""
    run = _Run(cfg, None, progress=False)

    def work(engine: Engine) -> list[tuple[Observation, Dataset]]:
        run.sim.engine = engine
        for r in range(cfg.fl.rounds):
            run.sim.run_round(r)
        ids = run.sim.sample()[: cfg.audit.clients]
        observations, results, _ = run._observe(None, ids, cfg.fl.rounds, {})
        return [(obs, _truth_for(obs, results)) for obs in observations]

    return run.engine.run(run.sim.clients, run.sim.defenses, work, data_root=cfg.experiment.data_root)


class _Run:
    """One run's inputs, built and checked before any work: data, public images, federation."""

    def __init__(self, cfg: ExperimentConfig, store: ResultStore | None, progress: bool) -> None:
        self.cfg, self.store, self.progress = cfg, store, progress
        self.started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.t0 = time.perf_counter()
        seed = cfg.experiment.seed
        try:  # before the data loads: a run meant for a GPU never starts on the CPU
            self.device = usable_device(cfg.experiment.device, "experiment.device")
        except DeviceError as exc:
            raise ConfigError(str(exc)) from None
        self.setup = build_setup(cfg)  # data, model, task and scoring of the data set's modality
        self.train, self.test = self.setup.train, self.setup.test
        preflight(cfg, self.setup.model, self.train)  # the audit's pre-flight checks: errors raise here
        try:  # before the partition and any round: a run that cannot fit here is refused now
            check_resources(cfg, self.setup.model, len(self.train))
        except ResourceError as exc:
            raise ConfigError(str(exc)) from None
        public = self.setup.public
        self.public = public.images if public is not None and any_model_modifying(cfg) else None
        try:  # data-dependent feasibility (enough samples per class and client): known only with the data
            parts = partition(
                cfg.data.partition, self.train, cfg.data.num_clients, derive_seed(seed, 0x9A27),
                **cfg.data.partition_options,
            )  # fmt: skip
        except ValueError as exc:
            raise ConfigError(
                f"data.partition = {cfg.data.partition!r} cannot split the {len(self.train)} training "
                f"samples over data.num_clients = {cfg.data.num_clients}: {exc}"
            ) from None
        clients = [self.train.subset(p) for p in parts]

        # a fresh list of defenses per client task; a partial of a library function, importable by name
        # where an engine runs the clients in other processes (Ray actors)
        defenses = functools.partial(build_defenses, [(s.name, dict(s.options)) for s in cfg.defenses])
        model = self.setup.model.to(self.device)  # computes there; the data rests on the CPU
        self.sim = FederatedSimulation(model, clients, cfg.fl, seed=seed, test=self.test,
                                       defenses=defenses, task=self.setup.task)  # fmt: skip
        self.engine: EngineRunner = ENGINES.create(cfg.engine.name, **cfg.engine.options)

    def execute(
        self, run_id: str, resumed: bool, folder: Path | None, engine: Engine
    ) -> list[dict[str, Any]]:
        """The run's work on ``engine``, unit by unit: FL rounds, the audit, the summary; all its records."""
        cfg, sim, store = self.cfg, self.sim, self.store
        sim.engine = engine
        rec = _Recorder(store, run_id)
        if resumed and store is not None:
            _resume(sim, store, rec)
        pending: list[tuple[str, dict[str, Any]]] = []  # finished rounds not yet committed
        since, write_cost = time.perf_counter(), 0.0
        for r in tqdm(range(len(sim.history), cfg.fl.rounds), desc="FL rounds", disable=not self.progress):
            pending.append((f"round/{r}", _round_record(sim.run_round(r))))
            now = time.perf_counter()
            if r < cfg.fl.rounds - 1 and now - since < CHECKPOINT_OVERHEAD * write_cost:
                continue  # the checkpoint would cost more than 1 / CHECKPOINT_OVERHEAD of the work
            ckpt = None
            if store is not None:
                tensors, state = sim.state()
                ckpt = Checkpoint(f"round/{r}", tensors_to_bytes(tensors), state)
            units = tuple(u for u, _ in pending)
            rec.commit(units[0], [record for _, record in pending], ckpt, also=units[1:])
            since, write_cost, pending = time.perf_counter(), time.perf_counter() - now, []
        fl_seconds = sum(r.seconds for r in sim.history)  # every round's, resumed or not
        last = sim.history[-1] if sim.history else None  # the metrics of the broadcast audited
        evaluated = last is not None and last.accuracy is not None
        metrics = {"accuracy": last.accuracy, **last.metrics} if evaluated else sim.evaluate()  # type: ignore[union-attr]
        if cfg.audit.clients > 0:
            self.audit(rec, folder)
        finals = {
            f"final_{k}": v for k, v in metrics.items()
        }  # final_accuracy, a causal LM's final_perplexity
        summary = {"kind": "summary", **finals, "fl_seconds": fl_seconds, "task": self.setup.task.name,
                   "total_seconds": time.perf_counter() - self.t0, "num_clients": len(sim.clients),
                   "train_size": len(self.train), "test_size": len(self.test)}  # fmt: skip
        if store is not None:
            store.finish_run(run_id, dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), [summary])
        rec.new.append(summary)
        return rec.all()

    def _observe(
        self, attack: object | None, ids: list[int], salt: int, honest: dict[str, Any]
    ) -> tuple[list[Observation], list[ClientResult], list[ClientResult]]:
        """What the server observes for ``attack`` in the audited round, the results behind it (for
        scoring): each client's update, or under secure aggregation one aggregate of those that made it,
        and the audited clients whose update never reached the server (withheld, or rejected).
        A model-modifying attack first builds the model the server broadcasts (seeded by ``salt``)."""
        cfg, sim, audit = self.cfg, self.sim, self.cfg.audit
        broadcast: nn.Module = sim.model
        secrets: Mapping[str, object] = {}
        if isinstance(attack, ModelModifyingAttack):  # the server broadcasts its own model this round
            gen = torch.Generator().manual_seed(derive_seed(cfg.experiment.seed, 0xBAD, salt))
            # built and trained on the CPU: the linear-layer attacks make their tensors there
            broadcast, secrets = attack.prepare(copy.deepcopy(sim.model).cpu(), self.public, generator=gen)
        recipe = audit.training if audit.training_public else None
        shape, classes = self.setup.input_shape, self.setup.num_classes
        if not cfg.fl.secure_aggregation:
            if isinstance(attack, ModelModifyingAttack):
                results = collect_malicious(sim, attack, broadcast, ids, cfg)
            else:
                if "updates" not in honest:
                    honest["updates"], *honest["views"] = [
                        sim.collect(
                            ids, audit.training, max_samples=audit.max_samples, pick=audit.pick, view=v
                        )  # fmt: skip
                        for v in range(audit.views)
                    ]
                results = honest["updates"]
            observations = server_view(
                broadcast, results, input_shape=shape, num_classes=classes, secure_aggregation=False,
                training=recipe, grant_labels=audit.grant_labels, grant_lengths=audit.grant_lengths,
                secrets=secrets,
            )  # fmt: skip
            if not isinstance(attack, ModelModifyingAttack) and honest["views"]:
                observations = [with_views(obs, honest["views"]) for obs in observations]
            return observations, results, [r for r in results if r.update is None]
        if isinstance(attack, ModelModifyingAttack):
            models = served_models(attack, broadcast, len(ids))
            secure = sim.collect_secure(
                ids, audit.training, models=models, max_samples=audit.max_samples, pick=audit.pick
            )
        else:
            if "secure" not in honest:
                honest["secure"] = sim.collect_secure(
                    ids, audit.training, max_samples=audit.max_samples, pick=audit.pick
                )
            secure = honest["secure"]
        results = [r for r in secure.results if r.client_id in secure.contributors]
        # under secure aggregation a contributor's own update is never seen (the Flower engine's results
        # carry none): what did not reach the server is who is not among the contributors
        if secure.aggregate is None:  # the sum was rejected: no client's update reached the server
            return [], results, list(secure.results)
        missing = [r for r in secure.results if r.client_id not in secure.contributors]
        w0 = copy.deepcopy(broadcast).eval()
        obs = secure_observation(w0, secure.aggregate, len(secure.contributors), input_shape=shape,
                                 num_classes=classes, training=recipe, secrets=secrets)  # fmt: skip
        return [obs], results, missing

    def audit(self, rec: _Recorder, folder: Path | None) -> None:
        """The audited round: every attack on the updates of the same sampled clients, a unit per update."""
        cfg, sim = self.cfg, self.sim
        seed, audit = cfg.experiment.seed, cfg.audit
        ids = sim.sample()[: audit.clients]
        honest: dict[str, Any] = {}  # the honest clients' training, shared by every honest-server attack
        salt = cfg.fl.rounds  # records before this attack's (rounds, earlier attacks): seeds its prepare
        for i, spec in enumerate(tqdm(audit.attacks, desc="attacks", disable=not self.progress)):
            if f"attack/{i}" in rec.done:
                salt += sum(1 for r in rec.stored if r["kind"] == "attack" and r.get("cell") == i)
                log.info("attack %d (%s) already stored: skipped", i, spec.name)
                continue
            attack = create_attack(spec.name, **spec.options)
            observations, results, missing = self._observe(attack, ids, salt, honest)
            honest_views = audit.views > 1 and not isinstance(attack, ModelModifyingAttack)
            # an audited client whose update never reached the server (a defense failed closed, or the
            # secure aggregate was rejected): nothing to attack, the reason kept beside the cell's records
            withheld = [{"kind": "client_error", "attack": spec.name, "cell": i, "client_id": r.client_id,
                         "error": r.error or "no update"} for r in missing]  # fmt: skip
            for w in withheld:
                log.warning("audit: client %s sent no update (%s)", w["client_id"], w["error"])
            for k, obs in enumerate(observations):
                unit = f"attack/{i}/{k}"
                if unit in rec.done:
                    log.info("unit %s already stored: skipped", unit)
                    continue
                truth = _truth_for(obs, results)
                gen, floor_gen = audit_generators(seed, i, k)
                scorer = self.setup.scorer
                outcome = attack_update(attack, spec, obs, generator=gen, truth=truth, scorer=scorer,
                                        floor_generator=floor_gen)  # fmt: skip
                record = {**outcome.record, "cell": i, "client_id": obs.update.metadata.get("client_id"),
                          **(_views_claims(obs) if honest_views else {})}  # fmt: skip
                reconstruction = outcome.reconstruction
                if (folder is not None and reconstruction is not None and reconstruction.images is not None
                        and "matching" in record and isinstance(truth, ImageDataset)):  # fmt: skip
                    orig, recon, title, caps = matched_figure(
                        spec.name, obs, reconstruction.images, truth.images, record
                    )
                    name = f"reconstructions_{i}_{k}.png"
                    save_reconstruction_grid(orig, recon, folder / name, title=title, captions=caps)
                    record["figure"] = name
                last = k == len(observations) - 1  # the cell is done with its last attacked update
                rec.commit(unit, [record, *(withheld if last else ())], also=(f"attack/{i}",) if last else ())
            salt += len(observations)
            if f"attack/{i}" not in rec.done:  # no update reached the server: nothing to attack
                rec.commit(f"attack/{i}", withheld)
