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

Legacy ``Parameters`` are an ordered list of arrays without names: they are named by ``model.state_dict()``
in order (the NumPyClient convention ``[v.numpy() for v in model.state_dict().values()]``) and checked
against those shapes; SecAgg+'s float64 aggregate is cast to the model's dtype. The workflow drives the
rounds, so :meth:`LegacyAuditStrategy.run` runs it as one audit run (completed when it returns, released
if it raises). The malicious-server option is :class:`~gradleak.integrations.flower.AuditStrategy`'s.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy
from torch import nn

from gradleak.data.base import ImageDataset
from gradleak.experiments.store import ResultStore
from gradleak.integrations.flower.apps import PARTITION_ID, named_arrays
from gradleak.integrations.flower.auditing import AttackSpec, Auditing
from gradleak.types import LocalTraining, Update
from gradleak.validation import InvalidUpdateError, check_tensors, check_update, reference_of

log = logging.getLogger(__name__)

Failure = tuple[ClientProxy, FitRes] | BaseException


class LegacyAuditStrategy(Auditing, Strategy):
    """Wrap a legacy Flower ``strategy``; audit what its ``aggregate_fit`` receives (module docstring)."""

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
        seed: int = 0,
        name: str = "flower",
        truth: Callable[[int], ImageDataset | None] | None = None,
    ) -> None:
        Auditing.__init__(
            self, model=model, attacks=attacks, input_shape=input_shape, num_classes=num_classes, store=store,
            training=training, rounds=rounds, secure_aggregation=False, seed=seed, name=name, truth=truth,
        )  # fmt: skip
        self.strategy = strategy
        self._broadcast: dict[int, dict[str, torch.Tensor]] = {}

    def run_config(self) -> dict[str, Any]:
        return {**Auditing.run_config(self), "strategy": type(self.strategy).__name__, "api": "legacy"}

    def run(self, workflow: Callable[[Any, Any], None], grid: Any, context: Any) -> None:
        """``workflow(grid, context)`` (e.g. ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))``) as
        one audit run: completed when it returns, released (nothing lost) if it raises."""
        self.run_id, self.records = None, []
        try:
            workflow(grid, context)
        except BaseException:
            self.release()
            raise
        self.close()

    # -- the wrapped strategy -------------------------------------------------------------------------

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return self.strategy.initialize_parameters(client_manager)

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        self._broadcast[server_round] = named_arrays(self.model, parameters, f"round {server_round}'s model")
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
        for j, failure in enumerate(failures):
            node = None if isinstance(failure, BaseException) else int(failure[0].node_id)
            reason = repr(failure) if isinstance(failure, BaseException) else str(failure[1].status.message)
            failed = {"kind": "client_error", "round": server_round, "node_id": node, "error": reason}
            self.commit(f"round/{server_round}/error/{j}", failed)
        w0 = self._broadcast.pop(server_round)
        secure = len(results) > 1 and all(r.parameters is results[0][1].parameters for _, r in results)
        if secure:  # SecAgg+: every FitRes holds the one unmasked aggregate
            return self._aggregate_secure(server_round, results, failures, w0)
        kept, good = [], []
        for j, (proxy, res) in enumerate(results):
            node = int(proxy.node_id)
            part = res.metrics.get(PARTITION_ID)
            meta = {"client_id": node, "round": server_round,
                    "partition_id": int(part) if isinstance(part, int) else None}  # fmt: skip
            try:
                source = f"node {node}, round {server_round}"
                update = self._update(w0, res.parameters, res.num_examples, meta, source)
            except (InvalidUpdateError, ValueError, TypeError) as exc:
                log.warning("audit: rejected %s", exc)
                rejected = {"kind": "rejected", "round": server_round, "node_id": node, "error": str(exc)}
                self.commit(f"round/{server_round}/reply/{j}/rejected", rejected)
                continue
            kept.append((proxy, res))
            good.append((j, node, update))
        if self.audits(server_round):
            self.audit(server_round, good, self._model_at(w0), self.attacks, {}, "")
        return self.strategy.aggregate_fit(server_round, kept, failures)

    def _aggregate_secure(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[Failure],
        w0: dict[str, torch.Tensor],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        count, samples = len(results), sum(int(r.num_examples) for _, r in results)
        meta = {"round": server_round, "secure_aggregation": True, "aggregate": "weighted mean"}
        source = f"round {server_round}'s SecAgg+ aggregate of {count} clients"
        try:
            update = self._update(w0, results[0][1].parameters, samples, meta, source)
        except (InvalidUpdateError, ValueError, TypeError) as exc:
            log.error("audit: %s; the round's model is left unchanged", exc)
            rejected = {"kind": "rejected", "round": server_round, "node_id": None, "error": str(exc),
                        "num_clients": count}  # fmt: skip
            self.commit(f"round/{server_round}/sum/rejected", rejected)
            return None, {}
        if self.audits(server_round):
            self.attack(server_round, "sum", None, update, count, self._model_at(w0), self.attacks, {})
        return self.strategy.aggregate_fit(server_round, results, failures)

    def _update(
        self,
        w0: dict[str, torch.Tensor],
        parameters: Parameters,
        samples: int,
        meta: dict[str, Any],
        source: str,
    ) -> Update:
        """The model parameters' ``w_T - w_0`` of a reply's (or the aggregate's) arrays, validated."""
        wt = named_arrays(self.model, parameters, source)
        check_tensors({k: v for k, v in wt.items() if v.is_floating_point()},
                      {k: v for k, v in w0.items() if v.is_floating_point()}, source=source)  # fmt: skip
        params = reference_of(self.model)
        update = Update({n: wt[n] - w0[n] for n in params}, max(int(samples), 1), "delta", meta)
        check_update(update, params, source=source)
        return update

    def _model_at(self, weights: dict[str, torch.Tensor]) -> nn.Module:
        model = copy.deepcopy(self.model)
        model.load_state_dict(weights, strict=True)
        return model.eval()

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
