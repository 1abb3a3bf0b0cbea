"""What a Flower server may take from a client's reply: the one check both audit wrappers apply.

A reply is a party's word, not a fact. Before any of it reaches an attack or the wrapped strategy's
aggregate, :func:`check_reply` checks it against what the server knows:

- **arrays** by :func:`gradleak.validation.check_weights` (the audited model's names, shapes and dtypes,
  whatever dtype the strategy turned the sent arrays into; finite floats; integer buffers such as BatchNorm's
  ``num_batches_tracked`` within ``[sent, sent + max_local_steps]``);
- **the aggregation weight** (``num-examples``): a positive whole number of at most
  :attr:`ReplyPolicy.max_examples`. FedAvg weights a reply by ``n_i / sum_j n_j``: an unchecked claim lets
  one client take the whole aggregate (1e18), reverse it (a negative count) or stop it (``inf``, or a
  negative count that cancels the honest total);
- **metrics**: only the weight key and the keys the operator lists (:attr:`ReplyPolicy.metrics`) are
  forwarded, each a finite number (or a list of them); every other key is dropped and recorded (an extra
  key alone made Flower's FedAvg raise ``InconsistentMessageReplies`` for the whole round).

A reply that fails any check is rejected with the reason (recorded by the wrapper with its node id), never
raised. A well-formed but large update is not malformed; :attr:`ReplyPolicy.clip_norm` bounds it (each
accepted reply's floating arrays are moved to ``w_0 + min(1, c / ||w_T - w_0||) (w_T - w_0)`` before the
wrapped strategy aggregates them), so that no client moves a FedAvg aggregate by more than
``c * n_i / sum_j n_j``; attacks still see the update as sent.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from gradleak.types import Update
from gradleak.validation import DEFAULT_MAX_LOCAL_STEPS, InvalidUpdateError, check_update, check_weights

NUM_EXAMPLES = "num-examples"  # the MetricRecord key Flower's strategies weight by
DEFAULT_MAX_EXAMPLES = 1_000_000
TRAIN_METRICS = ("train_loss",)  # Flower's quickstart apps' train metric
EVALUATE_METRICS = ("eval_loss", "eval_acc")  # and their evaluation metrics

MetricValue = int | float | list[int] | list[float]


@dataclass(frozen=True)
class ReplyPolicy:
    """The operator's bounds on what a reply may claim (module docstring).

    ``max_examples``: the largest aggregation weight a reply may state (default 1,000,000 samples: set it to
    the largest client share of your federation). ``max_local_steps``: how far a reply's integer buffers may
    move from what was sent. ``train_metrics`` / ``evaluate_metrics``: the metric keys forwarded besides the
    weight key (defaults: Flower's quickstart keys). ``clip_norm``: clip each accepted train reply's update
    to this L2 norm before aggregation (``None``: no clipping).
    """

    max_examples: int = DEFAULT_MAX_EXAMPLES
    max_local_steps: int = DEFAULT_MAX_LOCAL_STEPS
    train_metrics: tuple[str, ...] = TRAIN_METRICS
    evaluate_metrics: tuple[str, ...] = EVALUATE_METRICS
    clip_norm: float | None = None

    def __post_init__(self) -> None:
        for key in ("max_examples", "max_local_steps"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if key == "max_examples" else 0):
                raise ValueError(f"ReplyPolicy.{key} must be a positive int, got {v!r}")
        for key in ("train_metrics", "evaluate_metrics"):
            v = getattr(self, key)
            if isinstance(v, str) or not all(isinstance(k, str) and k for k in v):
                raise ValueError(f"ReplyPolicy.{key} must be a sequence of metric names, got {v!r}")
            object.__setattr__(self, key, tuple(v))
        c = self.clip_norm
        if c is not None and not (
            isinstance(c, int | float) and not isinstance(c, bool) and 0 < c < math.inf
        ):
            raise ValueError(f"ReplyPolicy.clip_norm must be a positive finite number or None, got {c!r}")


def sample_count(value: object, bound: int, source: str) -> int:
    """A reply's aggregation weight as an int in ``[1, bound]`` (an int, or a float with a whole value)."""
    n = whole_number(value)
    if n is None or not 1 <= n <= bound:
        raise InvalidUpdateError(
            f"{source}: {NUM_EXAMPLES} must be a whole number in [1, {bound}] (the operator's max_examples), "
            f"got {value!r}"[:300]
        )
    return n


def _finite_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def metric_values(
    metrics: Mapping[str, object], allowed: tuple[str, ...], source: str
) -> tuple[dict[str, MetricValue], list[str]]:
    """The ``allowed`` metrics (finite numbers or lists of them; else the reply is invalid) and the
    names of the keys dropped."""
    kept: dict[str, MetricValue] = {}
    for key in allowed:
        if key not in metrics:
            continue
        v = metrics[key]
        ok = _finite_number(v) or (isinstance(v, list) and all(_finite_number(x) for x in v))
        if not ok:
            raise InvalidUpdateError(f"{source}: metric {key!r} must be a finite number, got {v!r}"[:300])
        kept[key] = v  # type: ignore[assignment]
    dropped = sorted(str(k)[:80] for k in metrics if k not in allowed and k != NUM_EXAMPLES)
    return kept, dropped


def whole_number(value: object) -> int | None:
    """An int a reply reports in the clear (``partition-id``), or None when it is not a whole number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


@dataclass
class CheckedReply:
    """A reply that passed :func:`check_reply`: what may be forwarded and what may be attacked."""

    node: int
    weights: dict[str, torch.Tensor]  # forwarded to the wrapped strategy (clipped with clip_norm)
    update: Update  # the model's parameters' w_T - w_0 as sent (what attacks read)
    num_examples: int
    metrics: dict[str, MetricValue]
    dropped: list[str] = field(default_factory=list)
    norm: float = 0.0  # ||w_T - w_0|| of the floating arrays, as sent
    clipped: bool = False
    reset: list[str] = field(default_factory=list)  # frozen arrays the reply moved, set back to w_0


def check_reply(
    *,
    node: int,
    arrays: object,
    num_examples: object,
    metrics: Mapping[str, object],
    sent: Mapping[str, torch.Tensor],
    model_state: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    policy: ReplyPolicy,
    allowed: tuple[str, ...],
    metadata: Mapping[str, Any],
    source: str,
    frozen: Collection[str] = (),
) -> CheckedReply:
    """Check one reply (module docstring); raise :class:`InvalidUpdateError` naming what is wrong.

    ``sent``: the arrays this node was sent (any dtype); ``model_state``: the audited model's state (names,
    shapes, dtypes); ``params``: its parameters (the update attacks read); ``allowed``: the metric keys
    forwarded besides the weight; ``frozen``: the names of the parameters that do not train (a LoRA
    adapter's base, fixed by the wrapper when it was built). No client moves a frozen parameter: every
    array that shares its storage (a tied alias such as GPT-2's ``lm_head.weight``) is set back to what
    was sent, in the update and in what is forwarded, and listed in ``reset`` (a client's noise mod moves
    every array, so this is no reason to reject the reply).
    """
    n = sample_count(num_examples, policy.max_examples, source)
    kept, dropped = metric_values(metrics, allowed, source)
    wt = check_weights(arrays, model_state, sent, max_steps=policy.max_local_steps, source=source)
    w0 = {k: sent[k].detach().to(model_state[k].dtype) for k in model_state}  # integer arrays: truncated
    still = {params[k].data_ptr() for k in frozen if k in params}
    reset = sorted(
        k for k, v in model_state.items() if v.data_ptr() in still and not torch.equal(wt[k], w0[k])
    )
    wt = {**wt, **{k: w0[k].clone() for k in reset}}
    floats = [k for k, v in model_state.items() if v.is_floating_point()]
    delta = {k: wt[k] - w0[k] for k in floats}
    norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in delta.values()))
    tied = {p.data_ptr() for p in params.values()}  # a tied weight (GPT-2's lm_head) is no buffer
    buffers = {k: wt[k] for k, v in model_state.items() if k not in params and v.data_ptr() not in tied}
    update = Update({k: delta[k] for k in params}, n, "delta", dict(metadata), buffers)
    check_update(update, params, source=source)
    forwarded, clipped = wt, False
    if policy.clip_norm is not None and norm > policy.clip_norm:
        scale = policy.clip_norm / norm
        forwarded = {k: (w0[k] + scale * delta[k]) if k in delta else wt[k] for k in wt}
        clipped = True
    return CheckedReply(node, forwarded, update, n, kept, dropped, norm, clipped, reset)


def common_metrics(checked: list[CheckedReply]) -> tuple[set[str], dict[int, list[str]]]:
    """The forwarded metric keys every accepted reply carries (Flower's strategies require the same keys
    in every reply) and, per node, the allowed keys dropped because another reply lacks them."""
    if not checked:
        return set(), {}
    common = set.intersection(*(set(c.metrics) for c in checked))
    return common, {c.node: sorted(set(c.metrics) - common) for c in checked if set(c.metrics) - common}
