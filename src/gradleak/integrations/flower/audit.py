"""Auditing a Flower server: a strategy wrapper that hands what the server receives to gradleak's attacks.

``AuditStrategy(FedAvg(...), model=..., attacks=["ig"], store="audit.sqlite")`` behaves as the wrapped
strategy (sampling, aggregation, evaluation are its own) and, in the rounds it audits, turns every train
reply into a named update ``w_T - w_0`` of the model's parameters (the arrays the strategy sent that round
are ``w_0``), validates it like every other update (a bad one is recorded as rejected, never attacked) and
runs each attack on the :class:`~gradleak.types.Observation` an honest-but-curious server has: the model at
``w_0``, that update, and the public recipe if given. Each attacked update is one unit in gradleak's results
store (``store=``: a ``ResultStore``, or a path, a relative one under Flower's home ``$FLWR_HOME``, as
``figures=`` is), with Flower's round and node ids, committed as it finishes; the run is completed when
``start`` returns. Under secure aggregation (``secure_aggregation=True``, e.g. beside Flower's SecAgg+)
the server sees only the sum, so the wrapper attacks the aggregate of the round's replies as one
observation.

The malicious-server option (``malicious=("robbing_the_fed", {...})``, ``public_images=``): in each audited
round the wrapper lets the attack build its modified model from the round's weights and the server's
public images (a text attack, ``peftleak_lora``, needs none: it rewrites the model's own weights), and
sends it to the first ``malicious_nodes`` of the nodes the strategy sampled (each its own variant for a
client-customising attack such as LOKI): the arrays of the modified model and, in a
``gradleak.architecture`` record, its architecture as a spec (the imprint block around the node's own
model; JSON, never a pickle: :mod:`gradleak.models.architecture`), the threat model where the server
ships the model. Their replies are attacked with that attack only, against the modified model and its
secrets, and never reach the wrapped strategy's aggregate (they were trained from other weights). A
ClientApp that did not opt in (``client_app(..., accept_architecture=True)``), or that builds its own
architecture and loads weights strictly, refuses such a model: its error reply is recorded as
``client_error``, which is the audit's answer for that deployment.

What a round exchanges: the model's whole ``state_dict``, or, for a model with frozen parameters (a LoRA
adapter's base: FlowerTune-style apps send only the adapters), exactly its trainable parameters (and a
trained head); the wrapper takes the frozen rest from ``model=`` and refuses any other set of arrays. Text
models are audited the same way, with a text scorer (``scorer=TextScorer(tokenizer)``) and ``truth``
returning the node's :class:`~gradleak.data.text.TokenDataset` (``examples/flowertune``).

A real server has no ground truth: records carry the attack's statistics and the reconstruction's size.
``truth`` (for simulations and tests: the client's data by its ``partition-id`` when the reply's metrics
carry one, as :func:`gradleak.integrations.flower.apps.client_app` sends, else by node id; a data set or
the app's own DataLoader) adds the same scores the in-process runner computes. ``public`` (labelled images
the server holds, never a client's: e.g. its held-out test loader) gives those scores their null floors,
and the pre-flight check its images (the model's input range, before round 1).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from torch import nn
from torch.utils.data import DataLoader

from gradleak.attacks import create_attack
from gradleak.audit import Scorer
from gradleak.data.base import ImageDataset
from gradleak.experiments.store import ResultStore
from gradleak.federation.simulation import derive_seed
from gradleak.integrations.flower.apps import ARCHITECTURE, PARTITION_ID
from gradleak.integrations.flower.auditing import AttackSpec, Auditing, Truth
from gradleak.integrations.flower.replies import (
    NUM_EXAMPLES,
    CheckedReply,
    ReplyPolicy,
    check_reply,
    common_metrics,
    metric_values,
    sample_count,
    whole_number,
)
from gradleak.models.architecture import describe
from gradleak.models.malicious import MaliciousModel
from gradleak.registry import ATTACKS
from gradleak.spec import as_spec
from gradleak.types import ClientCustomizingAttack, LocalTraining, ModelModifyingAttack, Update
from gradleak.validation import InvalidUpdateError, error_text, reference_of

log = logging.getLogger(__name__)


class _Planted:
    """What the malicious server sent in one round: the attack's model (for the observations: before any
    per-client customisation), its secrets, and the weights each planted node received."""

    def __init__(self, model: nn.Module, secrets: Mapping[str, object]) -> None:
        self.model, self.secrets = model, secrets
        self.sent: dict[int, dict[str, torch.Tensor]] = {}


class AuditStrategy(Auditing, Strategy):
    """Wrap ``strategy``; audit its train replies with ``attacks`` (see the module docstring)."""

    def __init__(
        self,
        strategy: Strategy,
        *,
        model: nn.Module,
        attacks: Sequence[AttackSpec] | Literal["auto"],
        input_shape: tuple[int, ...],
        num_classes: int,
        store: ResultStore | str | Path | None = None,
        training: LocalTraining | None = None,
        rounds: Iterable[int] | None = None,
        secure_aggregation: bool = False,
        seed: int = 0,
        name: str = "flower",
        truth: Truth | None = None,
        malicious: AttackSpec | None = None,
        malicious_nodes: int | None = None,
        public_images: torch.Tensor | None = None,
        policy: ReplyPolicy | None = None,
        scorer: Scorer | None = None,
        threads: int | None = 1,
        partitions: Mapping[int, int] | None = None,
        figures: str | Path | None = None,
        public: ImageDataset | DataLoader[Any] | None = None,
    ) -> None:
        Auditing.__init__(
            self, model=model, attacks=attacks, input_shape=input_shape, num_classes=num_classes, store=store,
            training=training, rounds=rounds, secure_aggregation=secure_aggregation, seed=seed, name=name,
            truth=truth, policy=policy, scorer=scorer,
            threads=threads, partitions=partitions, figures=figures, public=public,
        )  # fmt: skip
        self.strategy = strategy
        self.malicious = None if malicious is None else as_spec(malicious)
        if public_images is None and self.public is not None:
            public_images = self.public.images
        if self.malicious is not None:
            if not isinstance(
                create_attack(self.malicious.name, **self.malicious.options), ModelModifyingAttack
            ):
                raise ValueError(
                    f"malicious={self.malicious.name!r} does not modify the model; pass it in attacks= "
                    "instead"
                )
            reads_images = ATTACKS.entry(self.malicious.name).modality != "text"  # text: the model itself
            if reads_images and (
                public_images is None
                or len(public_images) < 2
                or tuple(public_images.shape[1:]) != tuple(input_shape)
            ):
                raise ValueError(
                    f"malicious={self.malicious.name!r} needs public_images: >= 2 server-side images of "
                    f"shape {tuple(input_shape)} (never client data)"
                )
        if malicious_nodes is not None and malicious_nodes < 1:
            raise ValueError(
                f"malicious_nodes must be >= 1 (None: every sampled node), got {malicious_nodes}"
            )
        self.malicious_nodes, self.public_images = malicious_nodes, public_images
        planted = [] if self.malicious is None else [self.malicious]
        self.check_before_round_1([*self.attacks, *planted], public_images)
        self._planted: dict[int, _Planted] = {}
        self._broadcast: dict[int, dict[str, torch.Tensor]] = {}
        self._asked: dict[int, set[int]] = {}  # the nodes each round's train messages went to
        self._asked_eval: dict[int, set[int]] = {}

    # -- the wrapped strategy -------------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        sent = {k: v.clone() for k, v in arrays.to_torch_state_dict().items()}
        exchanged = self.exchanged_names(server_round, sent)
        if self.malicious is not None and exchanged != set(self.model.state_dict()):
            raise ValueError(
                "AuditStrategy: a malicious model is sent whole; this federation exchanges only the "
                "trainable parameters (adapters)"
            )
        self._broadcast[server_round] = sent
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if self.malicious is not None and self.audits(server_round):
            messages = self._plant(server_round, messages)
        self._asked[server_round] = {int(m.metadata.dst_node_id) for m in messages}
        return messages

    def _plant(self, server_round: int, messages: list[Message]) -> list[Message]:
        """Send the malicious attack's model to the first ``malicious_nodes`` sampled nodes."""
        assert self.malicious is not None
        name, options = self.malicious.name, self.malicious.options
        attack = create_attack(name, **options)
        assert isinstance(attack, ModelModifyingAttack)  # checked in __init__
        gen = torch.Generator().manual_seed(derive_seed(self.seed, 0xBAD, server_round))
        broadcast, secrets = attack.prepare(
            self.broadcast_model(server_round), self.public_images, generator=gen
        )
        broadcast.eval()
        count = len(messages) if self.malicious_nodes is None else min(self.malicious_nodes, len(messages))
        planted = _Planted(broadcast, secrets)
        out = []
        for slot, msg in enumerate(messages):
            if slot >= count:
                out.append(msg)
                continue
            sent_model = (
                attack.customize(broadcast, slot)
                if isinstance(attack, ClientCustomizingAttack)
                else broadcast
            )
            sent = {k: v.detach().clone() for k, v in sent_model.state_dict().items()}
            keys = [k for k, r in msg.content.items() if isinstance(r, ArrayRecord)]
            if len(keys) != 1:
                raise ValueError(f"the strategy's train message holds {len(keys)} ArrayRecords; expected one")
            content = RecordDict({k: r for k, r in msg.content.items() if k != keys[0]})
            content[keys[0]] = ArrayRecord(torch_state_dict=sent)
            if isinstance(sent_model, MaliciousModel):  # a block around the node's own model; attacks that
                # keep the node's architecture (attacks/linear/in_place.py) send weights only
                content[ARCHITECTURE] = ConfigRecord({"spec": describe(sent_model, own=True)})
            meta = msg.metadata
            out.append(Message(content, dst_node_id=meta.dst_node_id, message_type=meta.message_type,
                               group_id=meta.group_id, ttl=meta.ttl))  # fmt: skip
            planted.sent[int(meta.dst_node_id)] = sent
        self._planted[server_round] = planted
        log.warning("audit: round %d: %s's model sent to nodes %s", server_round, name, sorted(planted.sent))
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Every reply is checked (:mod:`~gradleak.integrations.flower.replies`: a bad one is recorded with
        its node and reason and left out, in every round, never raised); in audited rounds the valid ones
        are attacked; then the wrapped strategy aggregates exactly what was validated. If it still fails,
        the failure is recorded and the round's model is left unchanged."""
        replies = list(replies)
        if server_round not in self._broadcast:
            raise RuntimeError(
                f"AuditStrategy: no arrays were sent through configure_train for round {server_round}; "
                "drive the wrapper itself (its start or configure_train), not the wrapped strategy"
            )
        self.begin()
        checked = self.check_replies(server_round, replies, train=True)
        round_plant = self._planted.pop(server_round, None)
        planted = {} if round_plant is None else round_plant.sent
        valid = [(j, c.node, c.update) for j, c in checked]
        if self.audits(server_round):
            honest = [v for v in valid if v[1] not in planted]
            self.audit(server_round, honest, self.broadcast_model(server_round), self.attacks, {}, "")
            if round_plant is not None and self.malicious is not None:
                model, secrets = round_plant.model, round_plant.secrets
                self.audit(server_round, [v for v in valid if v[1] in planted], model, [self.malicious],
                           secrets, "malicious/")  # fmt: skip
        self._broadcast.pop(server_round, None)
        self._asked.pop(server_round, None)
        # the planted nodes trained other weights: never in the aggregate
        honest_checked = [(j, c) for j, c in checked if c.node not in planted]
        forwarded = self.forward(server_round, replies, honest_checked, "train")
        errors = [r for r in replies if r.has_error()]
        fallback: tuple[ArrayRecord | None, MetricRecord | None] = (None, None)
        return self.inner(
            server_round,
            "train",
            lambda: self.strategy.aggregate_train(server_round, errors + forwarded),
            fallback,
        )

    def check_replies(
        self, server_round: int, replies: Sequence[Message], *, train: bool
    ) -> list[tuple[int, CheckedReply]]:
        """``(reply index, checked reply)`` of the valid replies; every other one is recorded: an error
        reply (a ClientApp that raised, a node that was lost) as ``client_error``, an invalid one as
        ``rejected`` with its node and reason."""
        stage = "reply" if train else "evaluate"
        asked = self._asked.get(server_round, set()) if train else self._asked_eval.get(server_round, set())
        seen: set[int] = set()
        out: list[tuple[int, CheckedReply]] = []
        for j, reply in enumerate(replies):
            node = int(reply.metadata.src_node_id)
            if reply.has_error():
                reason = error_text(str(reply.error.reason))
                failed = {"kind": "client_error", "round": server_round, "node_id": node, "stage": stage,
                          "code": int(reply.error.code), "error": reason}  # fmt: skip
                self.commit(f"round/{server_round}/{stage}/{j}/error", failed)
                continue
            source = f"node {node}, round {server_round}" + ("" if train else " (evaluate)")
            try:
                if node not in asked:
                    raise InvalidUpdateError(f"{source}: this node was not sent a message this round")
                if node in seen:
                    raise InvalidUpdateError(f"{source}: a second reply from the same node")
                seen.add(node)
                checked = self.check_reply(server_round, node, reply, source, train)
            except (InvalidUpdateError, ValueError, TypeError, KeyError, OverflowError) as exc:
                self.reject(
                    f"round/{server_round}/{stage}/{j}/rejected", server_round, node, exc, stage=stage
                )
                continue
            out.append((j, checked))
        return out

    def check_reply(
        self, server_round: int, node: int, reply: Message, source: str, train: bool
    ) -> CheckedReply:
        """One reply through :func:`~gradleak.integrations.flower.replies.check_reply`."""
        content = reply.content
        if len(content.metric_records) != 1:
            raise InvalidUpdateError(
                f"{source}: expected one MetricRecord, found {len(content.metric_records)}"
            )
        metrics = dict(next(iter(content.metric_records.values())))
        weight_key = getattr(self.strategy, "weighted_by_key", NUM_EXAMPLES)
        raw_n = metrics.get(weight_key)
        meta = {
            "client_id": node,
            "round": server_round,
            "partition_id": whole_number(metrics.get(PARTITION_ID)),
        }
        if not train:  # an evaluation reply carries metrics only
            if len(content.array_records):
                raise InvalidUpdateError(f"{source}: an evaluation reply carries arrays")
            n = sample_count(raw_n, self.policy.max_examples, source)
            kept, dropped = metric_values(metrics, self.policy.evaluate_metrics, source)
            return CheckedReply(node, {}, Update({}, n, "delta", meta), n, kept, dropped)
        if len(content.array_records) != 1:
            raise InvalidUpdateError(
                f"{source}: expected one ArrayRecord, found {len(content.array_records)}"
            )
        planted = self._planted.get(server_round)
        if planted is not None and node in planted.sent:  # the malicious model's weights, sent whole
            sent, model = planted.sent[node], planted.model
            state, params = model.state_dict(), reference_of(model)
        else:  # what this round exchanges: the whole state, or the trainable parameters (exchanged_names)
            sent, model = self._broadcast[server_round], self.model
            state = {k: v for k, v in model.state_dict().items() if k in sent}
            params = {k: v for k, v in reference_of(model).items() if k in sent}
        try:
            arrays: object = next(iter(content.array_records.values())).to_torch_state_dict()
        except Exception as exc:  # noqa: BLE001 - any undecodable array is the reply's fault
            raise InvalidUpdateError(
                f"{source}: arrays that do not decode: {type(exc).__name__}: {exc}"[:500]
            ) from None
        return check_reply(
            node=node, arrays=arrays, num_examples=raw_n, metrics=metrics, sent=sent,
            model_state=state, params=params, policy=self.policy,
            allowed=self.policy.train_metrics, metadata=meta, source=source, frozen=self.frozen,
        )  # fmt: skip

    def forward(
        self,
        server_round: int,
        replies: Sequence[Message],
        checked: Sequence[tuple[int, CheckedReply]],
        stage: str,
    ) -> list[Message]:
        """The accepted replies rewritten to exactly what was validated (the arrays, the checked weight, the
        allowed metrics every reply carries); what was dropped or clipped is recorded per node."""
        weight_key = getattr(self.strategy, "weighted_by_key", NUM_EXAMPLES)
        array_key = getattr(self.strategy, "arrayrecord_key", "arrays")
        common, partial = common_metrics([c for _, c in checked])
        out = []
        for j, c in checked:
            dropped = set(c.dropped) | set(partial.get(c.node, []))
            self.note_sanitised(
                f"round/{server_round}/{stage}/{j}/sanitised", server_round, stage, c, dropped
            )
            metrics = MetricRecord({weight_key: c.num_examples, **{k: c.metrics[k] for k in sorted(common)}})
            content = RecordDict({"metrics": metrics})
            if stage == "train":
                content[array_key] = ArrayRecord(torch_state_dict=c.weights)
            reply = replies[j]
            reply.content = content
            out.append(reply)
        return out

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
        self._asked_eval[server_round] = {int(m.metadata.dst_node_id) for m in messages}
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Evaluation replies pass the same checks of their weight and metrics (bad ones recorded and left
        out); a failing aggregation is recorded, not raised."""
        replies = list(replies)
        self.begin()
        checked = self.check_replies(server_round, replies, train=False)
        self._asked_eval.pop(server_round, None)
        forwarded = self.forward(server_round, replies, checked, "evaluate")
        errors = [r for r in replies if r.has_error()]
        return self.inner(
            server_round,
            "evaluate",
            lambda: self.strategy.aggregate_evaluate(server_round, errors + forwarded),
            None,
        )

    def summary(self) -> None:
        self.strategy.summary()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any) -> Result:
        """The wrapped strategy's rounds, as one audit run: completed when they are done, released (left
        unfinished, nothing lost) if they fail."""
        self.run_id, self.records, self.attacked = None, [], 0  # a second start is a new run
        try:
            result = Strategy.start(self, grid, initial_arrays, *args, **kwargs)
        except BaseException:
            self.release()
            raise
        self.close()
        return result

    def run_config(self) -> dict[str, Any]:
        m = self.malicious
        return {**Auditing.run_config(self), "strategy": type(self.strategy).__name__,
                "malicious": None if m is None else [m.name, dict(m.options)],
                "malicious_nodes": self.malicious_nodes}  # fmt: skip

    def broadcast_model(self, server_round: int) -> nn.Module:
        """The model at the weights the strategy sent in ``server_round``."""
        return self.model_at(self._broadcast[server_round])
