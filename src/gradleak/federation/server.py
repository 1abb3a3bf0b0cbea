"""Server side: client sampling, sample-weighted FedAvg aggregation, the secure-aggregation view.

FedAvg aggregation (McMahan et al. 2017, Alg. 1): w_{t+1} = w_t + eta_s * sum_k (n_k / n) delta_k for
deltas, and w_{t+1} = w_t - eta_s * sum_k (n_k / n) g_k for FedSGD gradients.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from gradleak.registry import SERVER_OPTIMIZERS
from gradleak.tasks.client import ClientResult
from gradleak.types import LocalTraining, Update, UpdateKind
from gradleak.validation import InvalidUpdateError, check_update, trainable_of

log = logging.getLogger(__name__)


def clients_per_round(num_clients: int, fraction: float) -> int:
    """How many clients a round samples: ``max(1, round(fraction * num_clients))``."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"client fraction must be in (0, 1], got {fraction}")
    return max(1, int(round(fraction * num_clients)))


def sample_clients(num_clients: int, fraction: float, rng: np.random.Generator) -> list[int]:
    """:func:`clients_per_round` distinct clients, uniformly without replacement, sorted."""
    k = clients_per_round(num_clients, fraction)
    return sorted(int(i) for i in rng.choice(num_clients, size=k, replace=False))


def screen(
    results: Sequence[ClientResult], model: nn.Module, *, round_idx: int, kind: UpdateKind
) -> list[ClientResult]:
    """The server's check of every received update against the broadcast ``model``
    (:func:`gradleak.validation.check_update`), the round's update ``kind`` and a positive sample count:
    an invalid one is dropped (``update=None``, the reason in ``error``) and the others go on to
    aggregation or the audit. Results keep their order."""
    out = []
    for r in results:
        if r.update is not None:
            source = f"client {r.client_id}, round {round_idx}"
            try:
                check_update(r.update, model, source=source)  # parameters and buffers against the model
                if r.update.kind != kind:
                    raise InvalidUpdateError(
                        f"{source}: a {r.update.kind!r} update in a round of {kind!r} updates"
                    )
                if r.update.num_samples < 1:
                    raise InvalidUpdateError(f"{source}: reports {r.update.num_samples} samples")
            except InvalidUpdateError as exc:
                log.warning("rejected: %s", exc)
                r = dataclasses.replace(r, update=None, truth=None, error=f"rejected by the server: {exc}")
        out.append(r)
    return out


def update_kind(training: LocalTraining) -> UpdateKind:
    """What a client of this recipe sends: FedSGD a gradient, FedAvg a delta."""
    return "gradient" if training.protocol == "fedsgd" else "delta"


def _check_same_kind(updates: Sequence[Update]) -> None:
    if not updates:
        raise ValueError("cannot aggregate an empty list of updates")
    kinds = {u.kind for u in updates}
    if len(kinds) != 1:
        raise ValueError(f"cannot aggregate updates of mixed kinds {sorted(kinds)}")
    names = set(updates[0].tensors)
    for u in updates[1:]:
        if set(u.tensors) != names:
            raise ValueError("updates carry different parameter names")


def _combine(updates: Sequence[Update], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """sum_k weights[k] * u_k, per parameter."""
    out: dict[str, torch.Tensor] = {}
    for name in updates[0].tensors:
        acc = torch.zeros_like(updates[0].tensors[name])
        for u, w in zip(updates, weights, strict=True):
            acc.add_(u.tensors[name], alpha=w)
        out[name] = acc
    return out


def mean_buffers(updates: Sequence[Update], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """The weighted mean of the clients' buffers (FedAvg of BatchNorm's running statistics, as Flower's
    FedAvg averages every array of a reply; integer counters rounded to whole numbers); none unless every
    update carries the same buffers."""
    names = set(updates[0].buffers)
    if not names or any(set(u.buffers) != names for u in updates[1:]):
        return {}
    out = {}
    for name, first in updates[0].buffers.items():
        acc = sum(w * u.buffers[name].to(torch.float64) for u, w in zip(updates, weights, strict=True))
        assert isinstance(acc, torch.Tensor)
        out[name] = acc.to(first.dtype) if first.is_floating_point() else acc.round().to(first.dtype)
    return out


def weighted_mean(updates: Sequence[Update]) -> Update:
    """Sample-weighted mean sum_k (n_k / n) u_k, of the buffers too (:func:`mean_buffers`); the result's
    num_samples is n = sum_k n_k."""
    _check_same_kind(updates)
    total = sum(u.num_samples for u in updates)
    if total <= 0:
        raise ValueError("aggregate weight is zero: every update reports num_samples = 0")
    weights = [u.num_samples / total for u in updates]
    out = _combine(updates, weights)
    return Update(out, total, updates[0].kind, {"num_clients": len(updates)}, mean_buffers(updates, weights))


def secure_sum(updates: Sequence[Update]) -> Update:
    """What a server sees under secure aggregation (Bonawitz et al. 2017): only sum_k u_k, and sum_k n_k.

    The masks cancel exactly in the sum, so simulating the protocol's result is the plain sum; the point of
    this view is that no single client's update is observable.
    """
    _check_same_kind(updates)
    out = _combine(updates, [1.0] * len(updates))
    total = sum(u.num_samples for u in updates)
    return Update(out, total, updates[0].kind, {"num_clients": len(updates)})


def check_trainable(aggregate: Update, model: nn.Module) -> None:
    """An aggregate carries exactly the model's trainable parameters (:func:`~gradleak.validation.
    trainable_of`), else a ValueError naming the difference: a step never skips a parameter silently."""
    expected, got = set(trainable_of(model)), set(aggregate.tensors)
    if got != expected:
        raise ValueError(
            f"the aggregate carries {sorted(got - expected)[:5]} beyond and lacks "
            f"{sorted(expected - got)[:5]} of the model's trainable parameters"
        )


@torch.no_grad()
def apply_update(model: nn.Module, aggregate: Update, server_lr: float = 1.0) -> None:
    """In place: w += eta_s * delta (deltas) or w -= eta_s * g (gradients); the aggregate's buffers (the
    clients' mean running statistics) replace the model's."""
    sign = -aggregate.gradient_sign  # a delta is added, a gradient subtracted
    check_trainable(aggregate, model)
    params = dict(model.named_parameters())
    for name, t in aggregate.tensors.items():
        p = params[name]
        p.add_(t.to(p.device, p.dtype), alpha=sign * server_lr)
    apply_buffers(model, aggregate)


@torch.no_grad()
def apply_buffers(model: nn.Module, aggregate: Update) -> None:
    """In place: the aggregate's buffers (the clients' mean running statistics) replace the model's."""
    buffers = dict(model.named_buffers())
    for name, b in aggregate.buffers.items():
        buffers[name].copy_(b.to(buffers[name].device, buffers[name].dtype))


# the adaptive server optimisers of FedOpt, ``factory(params, lr=..., weight_decay=...)``; "sgd" is
# :func:`apply_update` (no state)
SERVER_OPTIMIZERS.register("adam", torch.optim.Adam, summary="FedAdam (Reddi et al. 2021)")
SERVER_OPTIMIZERS.register(
    "adamw", torch.optim.AdamW, summary="AdamW on the aggregate (paper 002's protocol)"
)


class ServerOptimizer:
    """FedOpt's server step (Reddi et al. 2021, Alg. 1): the aggregate as a pseudo-gradient
    ``g = -delta`` (FedAvg deltas) or ``g`` (FedSGD gradients) fed to a stateful optimiser over the global
    model's parameters, e.g. FedAdam, or AdamW on FedSGD gradients (a client's own fine-tuning optimiser
    run by the server, as paper 002's utility protocol does). The optimiser's state (moments, step count)
    round-trips through :meth:`state_tensors` / :meth:`load` so that a resumed run steps as an
    uninterrupted one."""

    def __init__(self, name: str, model: nn.Module, lr: float, weight_decay: float = 0.0) -> None:
        if name not in SERVER_OPTIMIZERS:
            raise ValueError(f"server optimizer must be one of {SERVER_OPTIMIZERS.names()}, got {name!r}")
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]
        self.optimizer = SERVER_OPTIMIZERS.get(name)(self.params, lr=lr, weight_decay=weight_decay)

    def step(self, aggregate: Update) -> None:
        check_trainable(aggregate, self.model)
        sign = aggregate.gradient_sign
        for name, p in zip(self.names, self.params, strict=True):  # a frozen parameter: no grad, no step
            t = aggregate.tensors.get(name)
            p.grad = None if t is None else sign * t.detach().to(p.device, p.dtype)
        self.optimizer.step()
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """The optimiser's per-parameter state as named tensors (``server_opt/<param>/<key>``) and its
        hyper-parameters (JSON-able)."""
        sd = self.optimizer.state_dict()
        tensors = {
            f"server_opt/{self.names[i]}/{k}": v.detach().cpu().clone()  # at rest on the CPU
            for i, st in sd["state"].items()
            for k, v in st.items()
        }
        groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        return tensors, {"param_groups": groups}

    def load(self, tensors: Mapping[str, torch.Tensor], state: Mapping[str, object]) -> None:
        index = {n: i for i, n in enumerate(self.names)}
        per: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            _, name, field = key.split("/", 2)  # server_opt/<param name>/<state key>
            per.setdefault(index[name], {})[field] = value.clone()
        saved = state["param_groups"]
        assert isinstance(saved, list), saved
        groups = [{**g, "params": list(range(len(self.params)))} for g in saved]
        self.optimizer.load_state_dict({"state": per, "param_groups": groups})
