"""Auditing a Flower server: a strategy wrapper that hands what the server receives to gradleak's attacks.

``AuditStrategy(FedAvg(...), model=..., attacks=["ig"], store=ResultStore(...))`` behaves as the wrapped
strategy (sampling, aggregation, evaluation are its own) and, in the rounds it audits, turns every train
reply into a named update ``w_T - w_0`` of the model's parameters (the arrays the strategy sent that round
are ``w_0``), validates it like every other update (a bad one is recorded as rejected, never attacked) and
runs each attack on the :class:`~gradleak.types.Observation` an honest-but-curious server has: the model at
``w_0``, that update, and the public recipe if given. Each attacked update is one unit in gradleak's results
store, with Flower's round and node ids, committed as it finishes; the run is completed when ``start``
returns. Under secure aggregation (``secure_aggregation=True``, e.g. beside Flower's SecAgg+) the server
sees only the sum, so the wrapper attacks the aggregate of the round's replies as one observation.

The malicious-server option (``malicious=("robbing_the_fed", {...})``, ``public_images=``): in each audited
round the wrapper lets the attack build its modified model from the round's weights and the server's
public images, and sends it to the first ``malicious_nodes`` of the nodes the strategy sampled (each its
own variant for a client-customising attack such as LOKI): the arrays of the modified model and, in a
``gradleak.architecture`` record, the module itself (the threat model where the server ships the model).
Their replies are attacked with that attack only, against the modified model and its secrets, and never
reach the wrapped strategy's aggregate (they were trained from other weights). A ClientApp that builds
its own architecture and loads weights strictly cannot run such a model: its error reply is recorded as
``client_error``, which is the audit's answer for that deployment.

A real server has no ground truth: records carry the attack's statistics and the reconstruction's size.
``truth`` (for simulations and tests: the client's data by its ``partition-id`` when the reply's metrics
carry one, as :func:`gradleak.integrations.flower.apps.client_app` sends, else by node id) adds the same
scores the in-process runner computes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from torch import nn

from gradleak.attacks import create_attack
from gradleak.data.base import ImageDataset
from gradleak.experiments.store import ResultStore
from gradleak.fl.simulation import derive_seed
from gradleak.integrations.flower.apps import ARCHITECTURE, PARTITION_ID, module_bytes
from gradleak.integrations.flower.auditing import AttackSpec, Auditing, attack_spec, weights_update
from gradleak.integrations.flower.mods import NUM_EXAMPLES, reply_metric
from gradleak.types import ClientCustomizingAttack, LocalTraining, ModelModifyingAttack, Update
from gradleak.validation import InvalidUpdateError, reference_of

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
        attacks: Sequence[AttackSpec],
        input_shape: tuple[int, ...],
        num_classes: int,
        store: ResultStore | None = None,
        training: LocalTraining | None = None,
        rounds: Iterable[int] | None = None,
        secure_aggregation: bool = False,
        seed: int = 0,
        name: str = "flower",
        truth: Callable[[int], ImageDataset | None] | None = None,
        malicious: AttackSpec | None = None,
        malicious_nodes: int | None = None,
        public_images: torch.Tensor | None = None,
    ) -> None:
        Auditing.__init__(
            self, model=model, attacks=attacks, input_shape=input_shape, num_classes=num_classes, store=store,
            training=training, rounds=rounds, secure_aggregation=secure_aggregation, seed=seed, name=name,
            truth=truth,
        )  # fmt: skip
        self.strategy = strategy
        self.malicious = None if malicious is None else attack_spec(malicious)
        if self.malicious is not None:
            if not isinstance(create_attack(self.malicious[0], **self.malicious[1]), ModelModifyingAttack):
                raise ValueError(
                    f"malicious={self.malicious[0]!r} does not modify the model; pass it in attacks= instead"
                )
            if (
                public_images is None
                or len(public_images) < 2
                or tuple(public_images.shape[1:]) != tuple(input_shape)
            ):
                raise ValueError(
                    f"malicious={self.malicious[0]!r} needs public_images: >= 2 server-side images of shape "
                    f"{tuple(input_shape)} (never client data)"
                )
        if malicious_nodes is not None and malicious_nodes < 1:
            raise ValueError(
                f"malicious_nodes must be >= 1 (None: every sampled node), got {malicious_nodes}"
            )
        self.malicious_nodes, self.public_images = malicious_nodes, public_images
        self._planted: dict[int, _Planted] = {}
        self._broadcast: dict[int, dict[str, torch.Tensor]] = {}

    # -- the wrapped strategy -------------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._broadcast[server_round] = {k: v.clone() for k, v in arrays.to_torch_state_dict().items()}
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if self.malicious is not None and self.audits(server_round):
            messages = self._plant(server_round, messages)
        return messages

    def _plant(self, server_round: int, messages: list[Message]) -> list[Message]:
        """Send the malicious attack's model to the first ``malicious_nodes`` sampled nodes."""
        assert self.malicious is not None
        name, options = self.malicious
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
            content[ARCHITECTURE] = ConfigRecord({"module": module_bytes(sent_model)})
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
        """Every reply is validated (a bad one is recorded and left out of the aggregate, in every round);
        in audited rounds the valid ones are attacked; then the wrapped strategy aggregates them."""
        replies = list(replies)
        if server_round not in self._broadcast:
            raise RuntimeError(
                f"AuditStrategy: no arrays were sent through configure_train for round {server_round}; "
                "drive the wrapper itself (its start or configure_train), not the wrapped strategy"
            )
        checked = self.updates(server_round, replies)
        self.begin()
        errors = [r for r in replies if r.has_error()]  # a ClientApp that raised, a node that was lost
        for j, reply in enumerate(errors):
            node = int(reply.metadata.src_node_id)
            failed = {"kind": "client_error", "round": server_round, "node_id": node,
                      "code": int(reply.error.code), "error": str(reply.error.reason)}  # fmt: skip
            self.commit(f"round/{server_round}/error/{j}", failed)
        for j, (node, bad) in enumerate(checked):
            if isinstance(bad, str):
                log.warning("audit: rejected %s", bad)
                rejected = {"kind": "rejected", "round": server_round, "node_id": node, "error": bad}
                self.commit(f"round/{server_round}/reply/{j}/rejected", rejected)
        round_plant = self._planted.pop(server_round, None)
        planted = {} if round_plant is None else round_plant.sent
        valid = [(j, n, u) for j, (n, u) in enumerate(checked) if isinstance(u, Update)]
        if self.audits(server_round):
            honest = [v for v in valid if v[1] not in planted]
            self.audit(server_round, honest, self.broadcast_model(server_round), self.attacks, {}, "")
            if round_plant is not None and self.malicious is not None:
                model, secrets = round_plant.model, round_plant.secrets
                self.audit(server_round, [v for v in valid if v[1] in planted], model, [self.malicious],
                            secrets, "malicious/")  # fmt: skip
        self._broadcast.pop(server_round, None)
        answered = [r for r in replies if not r.has_error()]
        kept = [r for r in replies if r.has_error()] + [
            answered[j]
            for j, node, _ in valid
            if node not in planted  # by reply, not node id
        ]  # the planted nodes trained other weights: never in the aggregate
        return self.strategy.aggregate_train(server_round, kept)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any) -> Result:
        """The wrapped strategy's rounds, as one audit run: completed when they are done, released (left
        unfinished, nothing lost) if they fail."""
        self.run_id, self.records = None, []  # a second start is a new run
        try:
            result = Strategy.start(self, grid, initial_arrays, *args, **kwargs)
        except BaseException:
            self.release()
            raise
        self.close()
        return result

    def run_config(self) -> dict[str, Any]:
        return {**Auditing.run_config(self), "strategy": type(self.strategy).__name__,
                "malicious": None if self.malicious is None else [self.malicious[0], self.malicious[1]],
                "malicious_nodes": self.malicious_nodes}  # fmt: skip

    def updates(self, server_round: int, replies: Sequence[Message]) -> list[tuple[int, Update | str]]:
        """``(node id, update or the reason it was rejected)`` per train reply without error. Every array
        of a reply is checked against what was sent (names, shapes, dtypes, finite values: a NaN BatchNorm
        buffer would be aggregated too); the update is the model's parameters' ``w_T - w_0``."""
        planted = self._planted.get(server_round)
        out: list[tuple[int, Update | str]] = []
        for reply in replies:
            if reply.has_error():
                continue
            node = int(reply.metadata.src_node_id)
            source = f"node {node}, round {server_round}"
            if planted is not None and node in planted.sent:  # the malicious model's weights, parameters
                w0, params = planted.sent[node], reference_of(planted.model)
            else:
                w0, params = self._broadcast[server_round], reference_of(self.model)
            try:
                if len(reply.content.array_records) != 1:
                    raise InvalidUpdateError(f"{source}: expected one ArrayRecord in the reply")
                wt = next(iter(reply.content.array_records.values())).to_torch_state_dict()
                meta = {"client_id": node, "round": server_round,
                        "partition_id": reply_metric(reply, PARTITION_ID)}  # fmt: skip
                update = weights_update(w0, wt, params, reply_metric(reply, NUM_EXAMPLES) or 1, meta, source)
            except (InvalidUpdateError, ValueError, TypeError, KeyError) as exc:
                out.append((node, str(exc)))
                continue
            out.append((node, update))
        return out

    def broadcast_model(self, server_round: int) -> nn.Module:
        """The model at the weights the strategy sent in ``server_round``."""
        return self.model_at(self._broadcast[server_round])
