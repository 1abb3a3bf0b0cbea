"""What both Flower audit wrappers share: the audit run in gradleak's results store and the attacks on the
updates (or the one aggregate) a Flower server received.

:class:`~gradleak.integrations.flower.AuditStrategy` wraps a strategy of Flower's Message API;
:class:`~gradleak.integrations.flower.LegacyAuditStrategy` wraps a strategy of Flower's legacy API, the
one Flower's SecAgg+ workflow drives. They differ in how replies reach them, not in what an audit records:
each attacked update is one unit in the store (round, node id, the attack's statistics, the scores when
``truth`` knows the client's data), committed as it finishes; the run is completed by ``close``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as dt
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from gradleak.attacks import create_attack
from gradleak.audit import ImageScorer, Scorer, attack_update, audit_generators
from gradleak.audit.choice import resolve_attacks
from gradleak.audit.pipeline import null_generator
from gradleak.audit.preflight import Preflight, enforce, run_checks
from gradleak.data.base import ImageDataset
from gradleak.experiments.figures import matched_figure, save_reconstruction_grid
from gradleak.experiments.runner import environment
from gradleak.experiments.store import ResultStore, RunRow
from gradleak.federation.server import secure_sum
from gradleak.integrations.flower.replies import CheckedReply, ReplyPolicy
from gradleak.spec import ComponentSpec, as_spec
from gradleak.types import LocalTraining, Observation, Update
from gradleak.validation import error_text, trainable_of

log = logging.getLogger(__name__)
T = TypeVar("T")
progress_log = logging.getLogger("gradleak.audit.progress")  # one line per attacked update


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads bounded to ``n`` for the audit's own work, restored after it. Beside
    Flower and Ray on a small machine, torch's default (one thread per core) oversubscribed the cores: IG
    on 8 images took 84-140 s inside a ServerApp against 1.2-2.2 s with one thread."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def show_progress() -> None:
    """Print the audit's progress lines (INFO) even where nothing configured logging, as Flower does for
    its own: a ServerApp otherwise runs its audit silent for minutes."""
    if not progress_log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("gradleak audit: %(message)s"))
        progress_log.addHandler(handler)
        progress_log.setLevel(logging.INFO)
        progress_log.propagate = False


def under_flower_home(path: str | Path) -> Path:
    """``path``, a relative one under Flower's home (``$FLWR_HOME``, default ``~/.flwr``): a ServerApp runs
    in whatever directory its SuperLink was started from, so a bare relative path would land there."""
    from flwr.supercore.utils import get_flwr_home

    given = Path(path).expanduser()
    return given if given.is_absolute() else get_flwr_home() / given


def image_data(name: str, data: ImageDataset | DataLoader[Any], num_classes: int) -> ImageDataset:
    """``data`` as an :class:`ImageDataset`: as it is, or the samples of the app's own loader."""
    if isinstance(data, DataLoader):
        return ImageDataset.from_batches(name, data, num_classes)
    return data


AttackSpec = str | tuple[str, Mapping[str, Any]] | ComponentSpec
# the data of the node whose update is scored (simulations and tests): a data set, or the app's own loader
Truth = Callable[[int], ImageDataset | DataLoader[Any] | None]


class Auditing:
    """The audit state and the attack loop of a Flower strategy wrapper (module docstring)."""

    def __init__(
        self,
        *,
        model: nn.Module,
        attacks: Sequence[AttackSpec] | Literal["auto"],
        input_shape: tuple[int, ...],
        num_classes: int,
        store: ResultStore | str | Path | None,
        training: LocalTraining | None,
        rounds: Iterable[int] | None,
        secure_aggregation: bool,
        seed: int,
        name: str,
        truth: Truth | None,
        policy: ReplyPolicy | None = None,
        scorer: Scorer | None = None,
        threads: int | None = 1,
        partitions: Mapping[int, int] | None = None,
        figures: str | Path | None = None,
        public: ImageDataset | DataLoader[Any] | None = None,
    ) -> None:
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive int or None (torch's default), got {threads!r}")
        self.threads = threads
        self.figures = None if figures is None else under_flower_home(figures)
        if isinstance(store, str | Path):
            store = ResultStore(under_flower_home(store))
            log.info("audit: results store %s", store.path)
        if self.figures is not None:
            log.info("audit: reconstructions in %s", self.figures)
            if self.figures.exists() and self.figures.stat().st_mode & 0o077:
                log.warning("audit: %s is open to other users; each run's folder in it is 0700", self.figures)
        self.partitions = None if partitions is None else {int(k): int(v) for k, v in partitions.items()}
        show_progress()
        self.model = model
        # the parameters that do not train, fixed now (a server that later freezes its copy changes nothing)
        self.frozen = frozenset(k for k, p in model.named_parameters() if not p.requires_grad)
        self.policy = policy or ReplyPolicy()
        # labelled images the server holds (never a client's): the null floors and the pre-flight range check
        self.public = None if public is None else image_data("public", public, num_classes)
        self.scorer: Scorer = scorer or ImageScorer(self.public)
        # "auto": the attack and budget that fit the stated recipe (gradleak.audit.choice)
        configured = attacks if isinstance(attacks, str) else [as_spec(a) for a in attacks]
        self.attacks, self.choice = resolve_attacks(configured, model, training)
        if self.choice != "configured":
            log.info("audit: attacks='auto' chose %s: %s", [s.name for s in self.attacks], self.choice)
        self.warnings: list[str] = []  # the pre-flight checks' (check_before_round_1)
        self.attacked = 0  # the audit's attacked updates so far (the seed rule of gradleak.audit)
        for spec in self.attacks:  # unknown names and options fail now, not mid-run
            create_attack(spec.name, **spec.options)
        self.input_shape, self.num_classes = tuple(input_shape), num_classes
        self.store, self.training, self.seed, self.name, self.truth = store, training, seed, name, truth
        self.rounds = None if rounds is None else set(rounds)
        self.secure_aggregation = secure_aggregation
        self.records: list[dict[str, Any]] = []
        self.run_id: str | None = None
        if store is not None:
            store.check()

    def check_before_round_1(self, attacks: Sequence[ComponentSpec], images: torch.Tensor | None) -> None:
        """The pre-flight checks (:mod:`gradleak.audit.preflight`) on what the wrapper knows now: its
        attacks read deltas (a server forms ``w_T - w_0`` from any reply), the recipe if stated, sample
        images where the operator gave some. An error raises before the federation starts."""
        known = self.training is not None
        if images is None and self.public is not None:
            images = self.public.images
        context = Preflight(
            attacks, self.model, "delta", recipe_known=known, images=images, recipe=self.training
        )
        self.warnings = enforce(run_checks(context), f"{type(self).__name__}")

    def reject(self, unit: str, server_round: int, node: int | None, exc: Exception, **extra: Any) -> None:
        """Record a reply (or aggregate) that failed its checks: its node and the reason, never raised."""
        reason = error_text(str(exc))
        log.warning("audit: rejected %s", reason)
        self.commit(
            unit, {"kind": "rejected", "round": server_round, "node_id": node, "error": reason, **extra}
        )

    def note_sanitised(
        self, unit: str, server_round: int, stage: str, checked: CheckedReply, dropped: Iterable[str]
    ) -> None:
        """Record what was dropped (metric keys), clipped or set back (frozen arrays a client moved) of an
        accepted reply before it was forwarded."""
        keys = sorted(dropped)
        if keys or checked.clipped or checked.reset:
            note = {"kind": "sanitised", "round": server_round, "node_id": checked.node, "stage": stage,
                    "dropped_metrics": keys, "clipped": checked.clipped, "norm": checked.norm}  # fmt: skip
            if checked.reset:
                note["frozen_reset"] = checked.reset[:20]
            self.commit(unit, note)

    def inner(self, server_round: int, stage: str, call: Callable[[], T], fallback: T) -> T:
        """The wrapped strategy's aggregation; if it raises anyway, the failure is recorded and the round's
        model (or metrics) left unchanged instead of the federation stopping."""
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - fail closed: the round is skipped, the federation goes on
            log.error(
                "audit: round %d: the wrapped strategy's %s aggregation failed: %s", server_round, stage, exc
            )
            failed = {"kind": "aggregate_error", "round": server_round, "stage": stage,
                      "error": error_text(exc)}  # fmt: skip
            self.commit(f"round/{server_round}/{stage}/aggregate_error", failed)
            return fallback

    def truth_key(self, node: int | None, reported: object) -> int | None:
        """Whose data scores an update: the server's own ``partitions`` map when given (a client cannot
        choose), else the partition id the reply reports, else the node id."""
        if self.partitions is not None:
            return None if node is None else self.partitions.get(node)
        return reported if isinstance(reported, int) else node

    def truth_lookup(self, key: int | None) -> tuple[ImageDataset | None, str | None]:
        """``truth(key)``, the app's own loader read into a data set, and why it is missing. The key may
        come from a client (its reported partition id), so a negative one, or a ``truth`` that raises or
        returns unusable data for it, never stops the audit: that update is scored without truth, and the
        reason goes into its record."""
        if self.truth is None or key is None:
            return None, None
        if key < 0:
            return None, f"no truth for the negative key {key}"
        try:
            data = self.truth(key)
            return (None, f"truth({key}) gave nothing") if data is None else (
                image_data(f"partition {key}", data, self.num_classes), None)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the user's loader on a client's claim: recorded, not raised
            reason = f"truth({key}) failed: {type(exc).__name__}: {exc}"[:500]
            log.warning("audit: %s; the update is scored without truth", reason)
            return None, reason

    def run_config(self) -> dict[str, Any]:
        """What the store keeps as the audit run's configuration (wrappers add their own options)."""
        return {"engine": "flower", "attacks": [{"name": s.name, **s.options} for s in self.attacks],
                "secure_aggregation": self.secure_aggregation, "seed": self.seed,
                "attack_choice": self.choice, "warnings": list(self.warnings),
                "policy": dataclasses.asdict(self.policy)}  # fmt: skip

    def audits(self, server_round: int) -> bool:
        return self.rounds is None or server_round in self.rounds

    def begin(self) -> str:
        """The audit run's id; the run is opened in the store by the first record."""
        if self.run_id is None:
            started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
            run_id = f"{self.name}-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
            if self.store is not None:
                run_id, _ = self.store.begin_run(
                    RunRow(run_id, self.name, started, "", self.run_config(), environment(), "running", None),
                    resume=False,
                )
            self.run_id = run_id
        return self.run_id

    def close(self) -> None:
        """Mark the audit run complete (``start`` does it; call it when driving the rounds yourself)."""
        if self.store is not None and self.run_id is not None:
            finished = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
            kinds = [r["kind"] for r in self.records]
            summary = {"kind": "summary", "audited": self.attacked, "attack_records": kinds.count("attack"),
                       "rounds": len({r["round"] for r in self.records if "round" in r}),
                       "rejected": kinds.count("rejected"),
                       "client_errors": kinds.count("client_error")}  # fmt: skip
            self.store.finish_run(self.run_id, finished, [summary])
        self.run_id = None

    def release(self) -> None:
        """Leave the run unfinished (the rounds failed): what was committed stays."""
        if self.store is not None and self.run_id is not None:
            self.store.release(self.run_id)

    def exchanged_names(self, server_round: int, sent: Mapping[str, torch.Tensor]) -> set[str]:
        """The names of the arrays a round exchanges, checked against the audited model: its whole
        ``state_dict``, or only its trainable parameters where some are frozen (a LoRA adapter's base stays
        on the server: :func:`gradleak.validation.trainable_of`); anything else raises, naming the
        difference."""
        full = self.model.state_dict()
        trainable = {k: full[k] for k in trainable_of(self.model)}
        options = (full, trainable) if self.frozen else (full,)  # all trainable: buffers (BatchNorm) travel
        for expected in options:
            if set(sent) == set(expected) and all(sent[k].shape == v.shape for k, v in expected.items()):
                return set(expected)
        nearest = min(options, key=lambda e: len(set(sent) ^ set(e)))
        raise ValueError(
            f"{type(self).__name__}: round {server_round}'s arrays match neither the audited model's "
            f"state_dict nor (with frozen parameters) its trainable parameters (names or shapes; e.g. "
            f"{sorted(set(sent) ^ set(nearest))[:5]}): pass model= the model the strategy trains"
        )

    def model_at(self, weights: Mapping[str, torch.Tensor]) -> nn.Module:
        """The audited model at ``weights`` (in eval mode, as attacks differentiate it): all of its state,
        or its trainable part over the frozen rest it already holds."""
        model = copy.deepcopy(self.model)
        model.load_state_dict({**model.state_dict(), **dict(weights)}, strict=True)
        return model.eval()

    def commit(self, unit: str, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.store is not None and self.run_id is not None:
            self.store.commit_unit(self.run_id, unit, [record])

    def audit(
        self,
        server_round: int,
        good: Sequence[tuple[int, int, Update]],
        w0: nn.Module,
        attacks: Sequence[ComponentSpec],
        secrets: Mapping[str, object],
        prefix: str,
    ) -> None:
        """``good``: (reply index, node id, update) of the valid replies, sent the model ``w0``; under
        ``secure_aggregation`` only their sum is attacked."""
        if not good:
            return
        if self.secure_aggregation:  # only the sum is visible
            self.attack(server_round, f"{prefix}sum", None, secure_sum([u for _, _, u in good]), len(good),
                        w0, attacks, secrets, malicious=bool(prefix), aggregate="sum")  # fmt: skip
            return
        for j, node, update in good:
            self.attack(server_round, f"{prefix}reply/{j}", node, update, 1, w0, attacks, secrets,
                        malicious=bool(prefix))  # fmt: skip

    def save_figure(
        self, name: str, attack: str, who: str, obs: Observation, images: torch.Tensor, truth: object,
        record: dict[str, Any],
    ) -> None:  # fmt: skip
        """The reconstructions for the operator, in ``figures/RUN_ID/`` (0700; the file 0600: they are the
        clients' data): beside the matched originals where ``truth`` scores them, else alone."""
        if self.figures is None or self.run_id is None:
            return
        if not self.figures.exists():
            self.figures.mkdir(parents=True, mode=0o700)  # the root too: it lists the runs
        folder = self.figures / self.run_id
        folder.mkdir(exist_ok=True, mode=0o700)
        if isinstance(truth, ImageDataset) and "matching" in record:
            orig, recon, title, caps = matched_figure(attack, obs, images, truth.images, record)
            save_reconstruction_grid(orig, recon, folder / name, title=title, captions=caps)
        else:
            title = f"{attack} on {who}: what the server rebuilt (no ground truth to compare)"
            save_reconstruction_grid(None, images, folder / name, title=title)
        record["figure"] = name

    def attack(
        self,
        server_round: int,
        where: str,
        node: int | None,
        update: Update,
        count: int,
        w0: nn.Module,
        attacks: Sequence[ComponentSpec],
        secrets: Mapping[str, object],
        *,
        malicious: bool = False,
        aggregate: str | None = None,
        truth: ImageDataset | None = None,
    ) -> None:
        """Run ``attacks`` on one observed update (``count`` clients' aggregate when ``count > 1`` or under
        secure aggregation: ``aggregate`` says which, "sum" or "weighted mean") and commit one record per
        attack through the one audit step (:func:`gradleak.audit.attack_update`: a failing attack is
        recorded, not raised). ``truth`` scores it with the wrapper's scorer (else ``self.truth`` of the
        update's partition or node)."""
        aggregated = count > 1 or self.secure_aggregation
        obs = Observation(w0, update, self.input_shape, self.num_classes, self.training, secrets=secrets,
                          aggregated=aggregated, num_clients=count)  # fmt: skip
        part = update.metadata.get("partition_id")  # the client's own claim, recorded as such
        key = self.truth_key(node, part)
        data, truth_error = (truth, None) if truth is not None else self.truth_lookup(key)
        k, self.attacked = self.attacked, self.attacked + 1  # the audit's k-th attacked update
        who = "the secure aggregate" if node is None else f"node {node}"
        for i, spec in enumerate(attacks):
            gen, floor_gen = audit_generators(self.seed, i, k)
            progress_log.info("round %d, %s: %s ...", server_round, who, spec.name)
            attack = create_attack(spec.name, **spec.options)
            with torch_threads(self.threads):
                null = null_generator(self.seed, i, k) if data is None else None  # no truth: the fit margin
                outcome = attack_update(attack, spec, obs, generator=gen, truth=data, scorer=self.scorer,
                                        floor_generator=floor_gen, null_generator=null)  # fmt: skip
            r = outcome.record
            images = None if outcome.reconstruction is None else outcome.reconstruction.images
            if images is not None:
                self.save_figure(f"reconstructions_{i}_{k}.png", spec.name, who, obs, images, data, r)
            status = "failed" if r["kind"] == "attack_error" else "done"
            seconds = float(r.get("attack_seconds", 0.0))
            progress_log.info("round %d, %s: %s %s in %.1f s", server_round, who, spec.name, status, seconds)
            record = {**outcome.record, "round": server_round, "node_id": node, "aggregate": aggregate,
                      "malicious": malicious, "partition_id": part, "audit_index": k}  # fmt: skip
            if truth_error is not None:
                record["truth_error"] = truth_error
            self.commit(f"round/{server_round}/{where}/attack/{i}", record)
