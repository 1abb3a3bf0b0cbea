"""Adversarial reply fuzzing of the audit wrappers around Flower's own FedAvg.

Seeded random hostile replies (broken or forged arrays, dtypes, shapes, key sets, sample counts, metrics,
undecodable bytes, duplicates, replies from nodes never asked, error replies) are mixed into the honest
ones of several rounds driven by Flower's own round loop (:meth:`AuditStrategy.start`) and, for the legacy
API, round after round through :class:`LegacyAuditStrategy`. Each reply carries the fuzzer's own label,
decided when it was made: *malformed* (must be rejected and recorded with its node and reason) or
*well-formed* (honest, or hostile within the rules: large but finite weights, extra metric keys; must be
aggregated). The check does not trust the wrapper's bookkeeping: every round's aggregate is compared with
a FedAvg computed here from the well-formed replies alone (so a rejected reply's values in the aggregate,
or a valid one dropped, show as a difference), and the run must not raise.

:func:`fuzz_message_api` and :func:`fuzz_legacy_api` return a :class:`FuzzReport`; ``benchmarks/
reply_fuzzing.py`` runs them at 1,000+ replies and writes the counts.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common import (
    Code,
    FitRes,
    Parameters,
    Scalar,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from torch import nn
from torch.nn import functional as F

from gradleak.integrations.flower.audit import AuditStrategy
from gradleak.integrations.flower.legacy import LegacyAuditStrategy
from gradleak.validation import DEFAULT_MAX_LOCAL_STEPS

Tensors = dict[str, torch.Tensor]


class FuzzNet(nn.Module):
    """The fuzzing target: a small CNN with BatchNorm (float and int64 buffers, as users' models have)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)
        self.fc = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


def fresh_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return FuzzNet()


@dataclass
class FuzzReport:
    """What a fuzzing run found: replies made (by label and mutation), aborts, aggregate mismatches,
    malformed replies not recorded as rejected, well-formed ones rejected."""

    api: str
    seed: int
    rounds: int
    replies: int = 0
    malformed: int = 0
    well_formed: int = 0
    mutations: Counter[str] = field(default_factory=Counter)
    aborts: list[str] = field(default_factory=list)
    mismatched_rounds: list[int] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)  # malformed replies without a rejection record
    wrongly_rejected: list[str] = field(default_factory=list)
    max_abs_diff: float = 0.0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.aborts or self.mismatched_rounds or self.unrecorded or self.wrongly_rejected)

    def as_dict(self) -> dict[str, Any]:
        return {"api": self.api, "seed": self.seed, "rounds": self.rounds, "replies": self.replies,
                "malformed": self.malformed, "well_formed": self.well_formed,
                "mutations": dict(sorted(self.mutations.items())), "aborts": self.aborts,
                "mismatched_rounds": self.mismatched_rounds, "unrecorded": self.unrecorded[:20],
                "wrongly_rejected": self.wrongly_rejected[:20], "max_abs_diff": self.max_abs_diff,
                "seconds": self.seconds, "ok": self.ok}  # fmt: skip


# -- mutations ------------------------------------------------------------------------------------------
# Each takes (rng, honest weights, the model's state) and returns (weights or None, num-examples, metrics,
# whether the reply stays well-formed). The honest reply: w_0 + a small step, 4 samples, no metric.

Mutation = Callable[[random.Random, Tensors, Tensors], tuple[Any, Any, dict[str, Any], bool]]


def _floats(state: Mapping[str, torch.Tensor]) -> list[str]:
    return [k for k, v in state.items() if v.is_floating_point()]


def _ints(state: Mapping[str, torch.Tensor]) -> list[str]:
    return [k for k, v in state.items() if not v.is_floating_point()]


def _copy(w: Tensors) -> Tensors:
    return {k: v.clone() for k, v in w.items()}


def m_nonfinite(rng: random.Random, w: Tensors, s: Tensors) -> tuple[Any, Any, dict[str, Any], bool]:
    w = _copy(w)
    k = rng.choice(_floats(s))
    w[k].view(-1)[rng.randrange(w[k].numel())] = rng.choice([math.nan, math.inf, -math.inf])
    return w, 4, {}, False


def m_dtype(rng: random.Random, w: Tensors, s: Tensors) -> tuple[Any, Any, dict[str, Any], bool]:
    w = _copy(w)
    k = rng.choice(list(s))
    w[k] = w[k].to(rng.choice([torch.float64, torch.float16, torch.int32, torch.int64]))
    return w, 4, {}, w[k].dtype == s[k].dtype


def m_shape(rng: random.Random, w: Tensors, s: Tensors) -> tuple[Any, Any, dict[str, Any], bool]:
    w = _copy(w)
    k = rng.choice(list(s))
    extra = rng.randint(1, 1000)
    w[k] = torch.zeros(w[k].numel() + extra, dtype=w[k].dtype)
    return w, 4, {}, False


def m_missing(rng: random.Random, w: Tensors, s: Tensors) -> tuple[Any, Any, dict[str, Any], bool]:
    w = _copy(w)
    del w[rng.choice(list(s))]
    return w, 4, {}, False


def m_extra(rng: random.Random, w: Tensors, s: Tensors) -> tuple[Any, Any, dict[str, Any], bool]:
    w = _copy(w)
    w[rng.choice(["backdoor", "fc.weight2", "bn.extra", ""])] = torch.zeros(rng.randint(1, 5))
    return w, 4, {}, False


def m_int_range(rng: random.Random, w: Tensors, s: Tensors) -> tuple[Any, Any, dict[str, Any], bool]:
    w = _copy(w)
    k = rng.choice(_ints(s))
    w[k] = w[k] + rng.choice([-2, -(10**9), DEFAULT_MAX_LOCAL_STEPS + 1, 10**12])  # honest is sent + 1
    return w, 4, {}, False


def m_large(rng: random.Random, w: Tensors, s: Tensors) -> tuple[Any, Any, dict[str, Any], bool]:
    """Well-formed but large: accepted (clip_norm, not the checks, bounds these); a variance only grows."""
    w = _copy(w)
    for k in _floats(s):
        step = rng.choice([1e3, -1e3, 50.0])
        w[k] = w[k] + (abs(step) if k.endswith("running_var") else step)
    return w, 4, {}, True


def m_negative_variance(rng: random.Random, w: Tensors, s: Tensors) -> tuple[Any, Any, dict[str, Any], bool]:
    """A BatchNorm running variance below zero: no batch has one (refused)."""
    w = _copy(w)
    k = rng.choice([k for k in _floats(s) if k.endswith("running_var")])
    w[k] = w[k] - (w[k].abs().max() + rng.choice([1e-3, 1.0, 1e6]))
    return w, 4, {}, False


def m_count(rng: random.Random, w: Tensors, s: Tensors) -> tuple[Any, Any, dict[str, Any], bool]:
    n = rng.choice([0, -1, -7, -8, 3.9, 10**18, 10**6 + 1, math.inf, -math.inf, math.nan, [4], None, 2.0**70])
    return w, n, {}, False


def m_count_ok(rng: random.Random, w: Tensors, s: Tensors) -> tuple[Any, Any, dict[str, Any], bool]:
    """A whole float count within the bound: accepted as that int."""
    return w, float(rng.randint(1, 10)), {}, True


def m_metrics(rng: random.Random, w: Tensors, s: Tensors) -> tuple[Any, Any, dict[str, Any], bool]:
    """Extra or allowed metric keys: extra keys are dropped and recorded, the reply aggregates; a
    non-finite allowed metric makes it malformed."""
    bad = rng.random() < 0.5
    value = rng.choice([math.nan, math.inf]) if bad else rng.random()
    key = "train_loss" if bad else rng.choice(["backdoor", "partition-id", "train_loss", "x" * 60])
    return w, 4, {key: value}, not bad


MUTATIONS: dict[str, Mutation] = {
    "nonfinite": m_nonfinite, "dtype": m_dtype, "shape": m_shape, "missing_key": m_missing,
    "extra_key": m_extra, "int_buffer_range": m_int_range, "large_but_finite": m_large,
    "negative_variance": m_negative_variance, "count": m_count, "count_whole_float": m_count_ok,
    "metrics": m_metrics,
}  # fmt: skip
RECORD_MUTATIONS = ("no_arrays", "two_arrays", "no_metrics", "two_metrics", "undecodable", "error_reply")
EXTRA_MUTATIONS = ("duplicate", "stranger")


def _metric_record(n: Any, metrics: Mapping[str, Any]) -> MetricRecord | None:
    values = dict(metrics)
    if n is not None:
        values["num-examples"] = n
    try:
        return MetricRecord(values)  # Flower's own constructor refuses some types: then no record at all
    except (TypeError, ValueError):
        return None


@dataclass
class _Made:
    content: RecordDict | Error
    node: int
    label: str
    well_formed: bool
    weights: Tensors | None = None
    count: int = 0


class FuzzGrid(Grid):
    """Flower's Grid answering every train message itself: honest replies with probability ``1 -
    hostile``, else a seeded mutation; plus duplicate replies and replies from nodes never asked."""

    def __init__(self, nodes: list[int], seed: int, hostile: float, step: float = 0.01) -> None:
        self.nodes, self.rng, self.hostile, self.step = nodes, random.Random(seed), hostile, step
        self.state = fresh_model().state_dict()
        self.made: dict[int, list[_Made]] = {}  # by round

    @property
    def run(self) -> Any:
        raise NotImplementedError

    def set_run(self, run: Any) -> None:
        raise NotImplementedError

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:  # fmt: skip
        return Message(
            content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl
        )

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError

    def honest(self, sent: Tensors) -> Tensors:
        return {k: (sent[k].to(v.dtype) + self.step) if v.is_floating_point() else sent[k].to(v.dtype) + 1
                for k, v in self.state.items()}  # fmt: skip

    def make(self, msg: Message, rnd: int) -> _Made:
        node = int(msg.metadata.dst_node_id)
        sent = msg.content.array_records["arrays"].to_torch_state_dict()
        w = self.honest(sent)
        if self.rng.random() >= self.hostile:
            return _Made(self.reply_content(w, 4, {}), node, "honest", True, w, 4)
        names = list(MUTATIONS) + list(RECORD_MUTATIONS)
        label = self.rng.choice(names)
        if label in MUTATIONS:
            weights, n, metrics, ok = MUTATIONS[label](self.rng, w, self.state)
            record = _metric_record(n, metrics)
            if record is None:
                return _Made(
                    RecordDict({"arrays": ArrayRecord(torch_state_dict=weights)}), node, label, False
                )
            content = RecordDict({"arrays": ArrayRecord(torch_state_dict=weights), "metrics": record})
            count = int(n) if ok else 0
            return _Made(content, node, label, ok, weights if ok else None, count)
        return _Made(self.broken_record(label, w), node, label, False)

    def reply_content(self, w: Tensors, n: int, metrics: Mapping[str, Any]) -> RecordDict:
        record = _metric_record(n, metrics)
        assert record is not None
        return RecordDict({"arrays": ArrayRecord(torch_state_dict=w), "metrics": record})

    def broken_record(self, label: str, w: Tensors) -> RecordDict | Error:
        metrics = MetricRecord({"num-examples": 4})
        arrays = ArrayRecord(torch_state_dict=w)
        if label == "no_arrays":
            return RecordDict({"metrics": metrics})
        if label == "two_arrays":
            return RecordDict({"arrays": arrays, "more": ArrayRecord(torch_state_dict=w), "metrics": metrics})
        if label == "no_metrics":
            return RecordDict({"arrays": arrays, "config": ConfigRecord({"num-examples": 4})})
        if label == "two_metrics":
            return RecordDict(
                {"arrays": arrays, "metrics": metrics, "more": MetricRecord({"num-examples": 4})}
            )
        if label == "undecodable":
            k = self.rng.choice(list(w))
            raw = {n: Array(t.numpy()) for n, t in w.items()}
            raw[k] = Array(dtype="float32", shape=(3, 3), stype="numpy.ndarray", data=b"\x93NUMPY garbage")
            return RecordDict({"arrays": ArrayRecord(raw), "metrics": metrics})
        return Error(code=7, reason="fuzz: the ClientApp raised")

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        messages = list(messages)
        train = [m for m in messages if "arrays" in m.content.array_records]
        if not train:
            return []
        rnd = int(train[0].content.config_records["config"]["server-round"])  # type: ignore[arg-type]
        made, replies = [], []
        for msg in train:
            item = self.make(msg, rnd)
            made.append(item)
            replies.append(Message(item.content, reply_to=msg))
        for _ in range(self.rng.randint(0, 2)):  # a second reply from a node, or one from a stranger
            msg = self.rng.choice(train)
            w = self.honest(msg.content.array_records["arrays"].to_torch_state_dict())
            item = _Made(self.reply_content(w, 4, {}), int(msg.metadata.dst_node_id), "duplicate", True, w, 4)
            reply = Message(item.content, reply_to=msg)
            if self.rng.random() < 0.5:
                item.label, item.well_formed, item.weights = "stranger", False, None
                item.node = max(self.nodes) + 1 + self.rng.randrange(100)
                reply.metadata.__dict__["_src_node_id"] = item.node  # a forged sender
            made.append(item)
            replies.append(reply)
        order = list(range(len(replies)))
        self.rng.shuffle(order)
        self.made[rnd] = judged([made[i] for i in order])
        return [replies[i] for i in order]


def judged(made: list[_Made]) -> list[_Made]:
    """In arrival order, a node's first reply that is not an error reply is judged on its content; any
    later one from the same node is a duplicate (malformed), whatever it holds."""
    first: set[int] = set()
    for m in made:
        if m.label == "error_reply":
            continue
        if m.node in first:
            m.label, m.well_formed, m.weights = "duplicate", False, None
        first.add(m.node)
    return made


Reference = tuple[Tensors, dict[str, float]]


def _reference(made: list[_Made], state: Tensors) -> Reference | None:
    """FedAvg of the well-formed replies (at most one a node, :func:`judged`), in float64, and per array
    the largest magnitude that went into it (float32 sums of +-1e3 entries round at ~1e-4)."""
    kept = [m for m in made if m.well_formed and m.weights is not None]
    if not kept:
        return None
    total = sum(m.count for m in kept)
    out: Tensors = {}
    scale: dict[str, float] = {}
    for k in state:
        acc = torch.zeros(state[k].shape, dtype=torch.float64)
        scale[k] = 1.0
        for m in kept:
            assert m.weights is not None
            acc += m.weights[k].double() * m.count
            peak = float(m.weights[k].double().abs().max()) if m.weights[k].numel() else 0.0
            scale[k] = max(scale[k], peak)
        out[k] = acc / total
    return out, scale


def _compare(report: FuzzReport, rnd: int, got: Tensors | None, reference: Reference | None) -> None:
    """The aggregate equals the reference to float32 rounding: relative 1e-5 of the largest entry that
    went into each array (a rejected reply's values, or a dropped valid one, move it by far more)."""
    if got is None or reference is None:
        if (got is None) != (reference is None):
            report.mismatched_rounds.append(rnd)
        return
    want, scale = reference
    diff = max(float((got[k].double() - want[k]).abs().max()) / scale[k] for k in want)
    report.max_abs_diff = max(report.max_abs_diff, diff)
    if diff > 1e-5:
        report.mismatched_rounds.append(rnd)


def _check_records(report: FuzzReport, made: list[_Made], records: list[dict[str, Any]], rnd: int) -> None:
    """Every malformed reply has a rejection (or client error) record with its node and a reason, and no
    well-formed one does."""
    rejected: Counter[int] = Counter(
        int(r["node_id"]) for r in records
        if r["kind"] in ("rejected", "client_error") and r.get("error") and r.get("node_id") is not None
    )  # fmt: skip
    wanted = Counter(m.node for m in made if not m.well_formed)
    for node, count in wanted.items():
        if rejected[node] < count:
            report.unrecorded.append(f"round {rnd}, node {node}: {count - rejected[node]} not recorded")
    for node, count in rejected.items():
        if count > wanted[node]:
            report.wrongly_rejected.append(f"round {rnd}, node {node}")


@contextlib.contextmanager
def _server_identity() -> Iterator[None]:
    """What Flower's ServerApp process sets before a strategy builds messages (restored after)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)  # noqa: SLF001
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved  # noqa: SLF001


def fuzz_message_api(seed: int, rounds: int, nodes: int = 8, hostile: float = 0.5) -> FuzzReport:
    """``rounds`` rounds of :class:`AuditStrategy` around Flower's FedAvg (Flower's own round loop)."""
    report = FuzzReport("message", seed, rounds)
    grid = FuzzGrid(list(range(101, 101 + nodes)), seed, hostile)
    outcomes: dict[int, Tensors | None] = {}

    class Recorded(FedAvg):
        def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> Any:
            out = super().aggregate_train(server_round, replies)
            outcomes[server_round] = None if out[0] is None else out[0].to_torch_state_dict()
            return out

    inner = Recorded(fraction_evaluate=0.0, min_available_nodes=nodes, min_train_nodes=nodes)
    strategy = AuditStrategy(inner, model=fresh_model(), attacks=[], input_shape=(1, 6, 6), num_classes=3)
    state = fresh_model().state_dict()
    start = time.perf_counter()
    saved = random.getstate()
    random.seed(seed)  # FedAvg samples nodes with Python's global generator
    try:
        with _server_identity():
            strategy.start(grid, ArrayRecord(torch_state_dict=state), num_rounds=rounds)
    except Exception as exc:  # noqa: BLE001 - what the fuzzer is looking for
        report.aborts.append(f"{type(exc).__name__}: {exc}"[:300])
    finally:
        random.setstate(saved)
    report.seconds = time.perf_counter() - start
    for rnd, made in sorted(grid.made.items()):
        _tally(report, made)
        _compare(report, rnd, outcomes.get(rnd), _reference(made, state))
        _check_records(report, made, [r for r in strategy.records if r.get("round") == rnd], rnd)
    return report


def _tally(report: FuzzReport, made: list[_Made]) -> None:
    for m in made:
        report.replies += 1
        report.mutations[m.label] += 1
        if m.well_formed:
            report.well_formed += 1
        else:
            report.malformed += 1


class _Proxy(ClientProxy):
    def __init__(self, node_id: int) -> None:
        super().__init__(str(node_id))
        self.node_id = node_id

    def _unused(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    get_properties = get_parameters = fit = evaluate = reconnect = _unused


LEGACY_LABELS = (*MUTATIONS, "no_arrays", "undecodable", "error_reply")


def _legacy_reply(grid: FuzzGrid, sent: Tensors, node: int) -> tuple[FitRes | None, _Made]:
    """A FitRes for the legacy wrapper (ordered arrays, an int64 count, scalar metrics): honest, or one of
    the same mutations; None for a client that raised (a failure, not a result)."""
    w = grid.honest(sent)
    ok_status = Status(Code.OK, "")
    if grid.rng.random() >= grid.hostile:
        return FitRes(ok_status, _parameters(w), 4, {}), _Made(RecordDict(), node, "honest", True, w, 4)
    label = grid.rng.choice(LEGACY_LABELS)
    item = _Made(RecordDict(), node, label, False)
    if label == "error_reply":
        return None, item
    if label == "no_arrays":
        return FitRes(ok_status, Parameters([], "numpy.ndarray"), 4, {}), item
    if label == "undecodable":
        return FitRes(ok_status, Parameters([b"\x93NUMPY garbage"] * len(w), "numpy.ndarray"), 4, {}), item
    weights, n, metrics, ok = MUTATIONS[label](grid.rng, w, grid.state)
    if isinstance(n, float) and math.isfinite(n) and n.is_integer() and abs(n) < 2**62:
        n = int(n)  # a whole claim travels as the int a FitRes holds
    if isinstance(n, bool) or not isinstance(n, int) or not -(2**62) < n < 2**62:
        n, ok = -1, False  # not an int64: the nearest a legacy client can send is a negative count
    scalars: dict[str, Scalar] = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
    if ok:
        item.well_formed, item.weights, item.count = True, weights, n
    return FitRes(ok_status, _parameters(weights), n, scalars), item


def _parameters(w: Tensors) -> Parameters:
    return ndarrays_to_parameters([t.numpy() for t in w.values()])


def fuzz_legacy_api(seed: int, rounds: int, nodes: int = 8, hostile: float = 0.5) -> FuzzReport:
    """``rounds`` rounds of :class:`LegacyAuditStrategy` around Flower's legacy FedAvg."""
    report = FuzzReport("legacy", seed, rounds)
    grid = FuzzGrid(list(range(201, 201 + nodes)), seed, hostile)
    inner = LegacyFedAvg(min_available_clients=nodes, min_fit_clients=nodes)
    strategy = LegacyAuditStrategy(
        inner, model=fresh_model(), attacks=[], input_shape=(1, 6, 6), num_classes=3
    )
    manager = SimpleClientManager()
    proxies = {n: _Proxy(n) for n in grid.nodes}
    for p in proxies.values():
        manager.register(p)
    state = fresh_model().state_dict()
    params = ndarrays_to_parameters([t.numpy() for t in state.values()])
    start = time.perf_counter()
    saved = random.getstate()
    random.seed(seed)  # the legacy FedAvg samples clients with Python's global generator
    for rnd in range(1, rounds + 1):
        try:
            fitins = strategy.configure_fit(rnd, params, manager)
            arrays = (torch.from_numpy(a.copy()) for a in parameters_to_ndarrays(params))
            sent = dict(zip(state, arrays, strict=True))
            results: list[tuple[ClientProxy, FitRes]] = []
            failures: list[BaseException | tuple[ClientProxy, FitRes]] = []
            made: list[_Made] = []
            for proxy, _ in fitins:
                for _copy_no in range(2 if grid.rng.random() < 0.2 else 1):  # sometimes the same client twice
                    res, item = _legacy_reply(grid, sent, int(proxy.node_id))
                    made.append(item)
                    if res is None:
                        failures.append(RuntimeError("fuzz: the ClientApp raised"))
                    else:
                        results.append((proxy, res))
            made = judged(made)
            new, _ = strategy.aggregate_fit(rnd, results, failures)
        except Exception as exc:  # noqa: BLE001 - what the fuzzer is looking for
            report.aborts.append(f"round {rnd}: {type(exc).__name__}: {exc}"[:300])
            continue
        _tally(report, made)
        got = None
        if new is not None:
            arrays = (torch.from_numpy(np.array(a)) for a in parameters_to_ndarrays(new))
            got = dict(zip(state, arrays, strict=True))
            params = new
        _compare(report, rnd, got, _reference(made, state))
        recs = [r for r in strategy.records if r.get("round") == rnd]
        # a legacy failure carries no node: the workflow lists it among the round's failures, recorded
        recs += [{"kind": "client_error", "node_id": m.node, "error": "failure"} for m in made
                 if m.label == "error_reply"]  # fmt: skip
        _check_records(report, made, recs, rnd)
    random.setstate(saved)
    report.seconds = time.perf_counter() - start
    return report
