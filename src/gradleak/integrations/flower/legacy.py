"""Auditing a Flower server that runs the legacy strategy API, as Flower's SecAgg+ workflow does.

In flwr 1.42 secure aggregation exists only as a legacy workflow: ``DefaultWorkflow(fit_workflow=
SecAggPlusWorkflow(...))`` over a ``LegacyContext`` whose strategy is a ``flwr.server.strategy`` one,
with ``secaggplus_mod`` on the ClientApp. :class:`LegacyAuditStrategy` wraps such a strategy and hands what
its ``aggregate_fit`` receives to gradleak's attacks, as :class:`~gradleak.integrations.flower.AuditStrategy`
does for the Message API:

- without secure aggregation every ``FitRes`` carries its client's weights ``w_T``: each one is an update
  ``w_T - w_0`` (``w_0``: the parameters ``configure_fit`` was given), validated and attacked on its own;
  a bad one is recorded as rejected and left out of the wrapped strategy's aggregate.
- under SecAgg+ the workflow unmasks only the weighted mean of the clients' weights, ``sum_i n_i w_i /
  sum_i n_i`` (quantised: ``clipping_range`` and ``quantization_range`` of the workflow set its precision),
  and hands every client's ``FitRes`` that same ``Parameters`` object. The wrapper sees exactly that: one
  aggregate update ``sum_i n_i (w_i - w_0) / sum_i n_i`` of ``len(results)`` clients, attacked once (what
  an honest-but-curious server under SecAgg+ can attack). If it is invalid (non-finite), it is recorded
  and the round's model is left unchanged (fail closed) instead of being aggregated.

A legacy federation exchanges the model's whole ``state_dict`` (an adapters-only app fails closed: its
array count does not match); :class:`~gradleak.integrations.flower.AuditStrategy` also audits one that sends
only the trainable parameters (LoRA adapters).

Legacy ``Parameters`` are an ordered list of arrays without names: they are named by ``model.state_dict()``
in order (the NumPyClient convention ``[v.numpy() for v in model.state_dict().values()]``) and checked
against those shapes; SecAgg+'s float64 aggregate is cast to the model's dtype. The workflow drives the
rounds, so :meth:`LegacyAuditStrategy.run` runs it as one audit run (completed when it returns, released
if it raises). The malicious-server option is :class:`~gradleak.integrations.flower.AuditStrategy`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from flwr.common import (
    Code,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    Status,
    ndarrays_to_parameters,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy
from torch import nn
from torch.utils.data import DataLoader

from gradleak.audit import Scorer
from gradleak.data.base import ImageDataset
from gradleak.experiments.store import ResultStore
from gradleak.integrations.flower.apps import PARTITION_ID, masked_names, named_arrays
from gradleak.integrations.flower.auditing import AttackSpec, Auditing, Truth
from gradleak.integrations.flower.replies import (
    CheckedReply,
    ReplyPolicy,
    check_reply,
    common_metrics,
    sample_count,
    whole_number,
)
from gradleak.types import LocalTraining, Update
from gradleak.validation import InvalidUpdateError, check_update, check_weights, error_text, reference_of

log = logging.getLogger(__name__)

Failure = tuple[ClientProxy, FitRes] | BaseException


def _partition(res: FitRes) -> int | None:
    return whole_number(res.metrics.get(PARTITION_ID)) if isinstance(res.metrics, dict) else None


def legacy_parameters(weights: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> Parameters:
    """Checked weights as legacy ``Parameters`` in ``state`` order, integer arrays as float64: Flower's
    legacy FedAvg aggregates in place into the first reply's arrays, which truncates an int64 counter's
    weighted share to 0 (BatchNorm's ``num_batches_tracked`` was reset every round); the next round's
    arrays are cast back to the model's dtypes when they are checked."""
    arrays = [weights[k].detach() for k in state]
    return ndarrays_to_parameters([(t if t.is_floating_point() else t.double()).numpy() for t in arrays])


class LegacyAuditStrategy(Auditing, Strategy):
    """Wrap a legacy Flower ``strategy``; audit what its ``aggregate_fit`` receives (module docstring)."""

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
        seed: int = 0,
        name: str = "flower",
        truth: Truth | None = None,
        policy: ReplyPolicy | None = None,
        scorer: Scorer | None = None,
        threads: int | None = 1,
        partitions: Mapping[int, int] | None = None,
        figures: str | Path | None = None,
        public: ImageDataset | DataLoader[Any] | None = None,
    ) -> None:
        Auditing.__init__(
            self, model=model, attacks=attacks, input_shape=input_shape, num_classes=num_classes, store=store,
            training=training, rounds=rounds, secure_aggregation=False, seed=seed, name=name, truth=truth,
            policy=policy, scorer=scorer,
            threads=threads, partitions=partitions, figures=figures, public=public,
        )  # fmt: skip
        self.check_before_round_1(self.attacks, None)
        self.strategy = strategy
        self._broadcast: dict[int, dict[str, torch.Tensor]] = {}

    def run_config(self) -> dict[str, Any]:
        secure = "per round: SecAgg+ when every FitRes holds the one aggregate"
        return {**Auditing.run_config(self), "strategy": type(self.strategy).__name__, "api": "legacy",
                "secure_aggregation": secure}  # fmt: skip

    def run(self, workflow: Callable[[Any, Any], None], grid: Any, context: Any) -> None:
        """``workflow(grid, context)`` (e.g. ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))``) as
        one audit run: completed when it returns, released (nothing lost) if it raises."""
        self.run_id, self.records, self.attacked = None, [], 0
        try:
            workflow(grid, context)
        except BaseException:
            self.release()
            raise
        self._record_halted()
        self.close()

    def _record_halted(self) -> None:
        """Rounds whose parameters went out but that never reached ``aggregate_fit``: SecAgg+ halts before
        unmasking when fewer clients than its threshold answer a stage (the model is left unchanged)."""
        for server_round in sorted(self._broadcast):
            self.begin()
            error = "the round never reached aggregate_fit (SecAgg+ halted before unmasking?)"
            halted = {"kind": "no_aggregate", "round": server_round, "error": error}
            self.commit(f"round/{server_round}/no_aggregate", halted)
            log.error("audit: round %d: %s", server_round, halted["error"])
        self._broadcast.clear()

    # -- the wrapped strategy -------------------------------------------------------------------------

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return self.strategy.initialize_parameters(client_manager)

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        self._record_halted()  # an earlier round that is still open was never aggregated
        reference = self.model.state_dict()
        self._broadcast[server_round] = named_arrays(reference, parameters, f"round {server_round}'s model")
        return self.strategy.configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: list[Failure]
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        if server_round not in self._broadcast:
            raise RuntimeError(
                f"LegacyAuditStrategy: no parameters went through configure_fit for round {server_round}; "
                "give the wrapper itself to the LegacyContext, not the wrapped strategy"
            )
        self.begin()
        reasons: dict[tuple[int | None, str], None] = {}  # SecAgg+ lists each dropout twice: once here
        for failure in failures:
            node = None if isinstance(failure, BaseException) else int(failure[0].node_id)
            reasons[(node, repr(failure) if node is None else str(failure[1].status.message))] = None  # type: ignore[index]
        for j, (node, reason) in enumerate(reasons):
            failed = {
                "kind": "client_error",
                "round": server_round,
                "node_id": node,
                "error": error_text(reason),
            }
            self.commit(f"round/{server_round}/error/{j}", failed)
        w0 = self._broadcast.pop(server_round)
        # flwr 1.42's SecAggPlusWorkflow hands every FitRes the same Parameters object, the aggregate
        secure = len(results) > 1 and all(r.parameters is results[0][1].parameters for _, r in results)
        if secure:
            return self._aggregate_secure(server_round, results, failures, w0)
        kept, good = [], []
        state, params = self.model.state_dict(), reference_of(self.model)
        checked: list[tuple[ClientProxy, FitRes, CheckedReply]] = []
        seen: set[int] = set()
        for j, (proxy, res) in enumerate(results):
            node = int(proxy.node_id)
            source = f"node {node}, round {server_round}"
            try:
                if node in seen:
                    raise InvalidUpdateError(f"{source}: a second reply from the same node")
                seen.add(node)
                metrics = dict(res.metrics) if isinstance(res.metrics, dict) else {}
                meta = {"client_id": node, "round": server_round,
                        "partition_id": whole_number(metrics.get(PARTITION_ID))}  # fmt: skip
                wt = named_arrays(state, res.parameters, source, cast=False)
                c = check_reply(
                    node=node, arrays=wt, num_examples=res.num_examples, metrics=metrics, sent=w0,
                    model_state=state, params=params, policy=self.policy, allowed=self.policy.train_metrics,
                    metadata=meta, source=source, frozen=self.frozen,
                )  # fmt: skip
            except (InvalidUpdateError, ValueError, TypeError, KeyError, OverflowError) as exc:
                self.reject(f"round/{server_round}/reply/{j}/rejected", server_round, node, exc)
                continue
            checked.append((proxy, res, c))
            good.append((j, node, c.update))
        common, partial = common_metrics([c for _, _, c in checked])
        for j, (proxy, _, c) in enumerate(checked):
            dropped = set(c.dropped) | set(partial.get(c.node, []))
            self.note_sanitised(
                f"round/{server_round}/reply/{j}/sanitised", server_round, "train", c, dropped
            )
            arrays = legacy_parameters(c.weights, state)
            scalars: dict[str, Scalar] = {
                k: v for k in sorted(common) if isinstance(v := c.metrics[k], int | float)
            }
            kept.append((proxy, FitRes(Status(Code.OK, ""), arrays, c.num_examples, scalars)))
        if self.audits(server_round):
            self.audit(server_round, good, self.model_at(w0), self.attacks, {}, "")
        return self.aggregate_inner(server_round, kept, failures)

    def aggregate_inner(
        self, server_round: int, kept: list[tuple[ClientProxy, FitRes]], failures: list[Failure]
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """The wrapped strategy's ``aggregate_fit`` of what was checked; a failure leaves the model as is."""
        no_change: tuple[Parameters | None, dict[str, Scalar]] = (None, {})
        aggregate = lambda: self.strategy.aggregate_fit(server_round, kept, failures)  # noqa: E731
        return self.inner(server_round, "train", aggregate, no_change)

    def _aggregate_secure(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[Failure],
        w0: dict[str, torch.Tensor],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """The one unmasked aggregate: attacked once, scored (with ``truth``) against the union of the
        clients' data by the ``partition-id`` each FitRes still reports in the clear."""
        count = len(results)
        meta = {"round": server_round, "secure_aggregation": True}
        source = f"round {server_round}'s SecAgg+ aggregate of {count} clients"
        state = self.model.state_dict()
        counts: list[int] = []
        for proxy, res in results:  # the weights are inside the masked sum: a bad claim cannot be removed
            try:
                counts.append(sample_count(res.num_examples, self.policy.max_examples, source))
            except InvalidUpdateError as exc:
                counts.append(1)
                note = {"kind": "unverifiable", "round": server_round, "node_id": int(proxy.node_id),
                        "error": f"{exc} (under SecAgg+ it is already inside the aggregate)"}  # fmt: skip
                self.commit(f"round/{server_round}/reply/{len(counts) - 1}/unverifiable", note)
        try:
            parameters = results[0][1].parameters
            masked = masked_names(state)
            names = masked if len(parameters.tensors) == len(masked) else list(state)
            agg = named_arrays({n: state[n] for n in names}, parameters, source)  # float64 -> model dtypes
            full = {n: agg[n] if n in agg else w0[n].clone() for n in state}  # integer buffers: as sent
            check_weights(full, state, w0, max_steps=self.policy.max_local_steps, source=source)
            params = reference_of(self.model)
            update = Update({n: full[n] - w0[n] for n in params}, sum(counts), "delta", meta)
            check_update(update, params, source=source)
        except (InvalidUpdateError, ValueError, TypeError) as exc:  # the round's model is left unchanged
            self.reject(f"round/{server_round}/sum/rejected", server_round, None, exc, num_clients=count)
            return None, {}
        if self.audits(server_round):
            truth = None
            if self.truth is not None:
                keys = [self.truth_key(int(proxy.node_id), _partition(r)) for proxy, r in results]
                parts = [self.truth_lookup(p)[0] for p in keys]
                known = [d for d in parts if d is not None]
                truth = ImageDataset.concat(known) if known and len(known) == count else None
            self.attack(server_round, "sum", None, update, count, self.model_at(w0), self.attacks, {},
                        aggregate="weighted mean", truth=truth)  # fmt: skip
        whole = legacy_parameters(full, state)
        kept = [(proxy, FitRes(Status(Code.OK, ""), whole, n, {}))
                for (proxy, _), n in zip(results, counts, strict=True)]  # fmt: skip
        return self.aggregate_inner(server_round, kept, failures)

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        return self.strategy.configure_evaluate(server_round, parameters, client_manager)

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        return self.strategy.aggregate_evaluate(server_round, results, failures)

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        return self.strategy.evaluate(server_round, parameters)
