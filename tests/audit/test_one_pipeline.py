"""One audit pipeline (:mod:`gradleak.audit`): the in-process runner and the Flower wrapper attack the same
update into the same record. The runner's audited round (round ``R`` of a run with ``fl.rounds = R``) is
Flower's round ``R + 1``; the update reaches the wrapper as a node's reply ``w_0 + u`` (so the server sees
``(w_0 + u) - w_0``, ``u`` up to float32 rounding). Images (IG on OrganAMNIST, with the null floors from
the same public images) and text (DAGER and the embedding side channel on WikiText-2, with the null-update
floor): the same attack statistics, scores and floors within 1e-5."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from flowergrid import AppGrid  # noqa: E402
from flowergrid import server_identity as flower_server_identity  # noqa: E402
from gradleak.experiments import load_config, run_experiment  # noqa: E402
from gradleak.experiments.runner import audited_updates  # noqa: E402
from gradleak.experiments.setup import build_setup  # noqa: E402
from gradleak.integrations.flower import AuditStrategy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NODE = 7
IMAGE = [
    "data.train_limit=600", "data.test_limit=200", "data.num_clients=10", "fl.rounds=1", "fl.fraction=0.2",
    "audit.clients=1", "audit.max_samples=2",
    "audit.training={protocol = 'fedavg', epochs = 1, batch_size = 2, lr = 0.01}",
    "audit.attacks=[{name = 'ig', max_iterations = 8}]",
]  # fmt: skip
TEXT = [
    "data.train_limit=60", "data.test_limit=20", "data.num_clients=6", "fl.rounds=1", "fl.fraction=0.5",
    "audit.clients=1", "audit.max_samples=2",
    "audit.training={protocol = 'fedavg', epochs = 1, batch_size = 2, lr = 0.01}",
]  # fmt: skip


@pytest.fixture(autouse=True)
def server_identity():
    with flower_server_identity(0):
        yield


def through_the_wrapper(cfg, obs, truth, scorer) -> list[dict]:
    """The observed update sent to an AuditStrategy as node 7's reply in Flower round ``fl.rounds + 1``."""
    model = obs.model
    strategy = AuditStrategy(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1), model=model,
        attacks=list(cfg.audit.attacks), input_shape=obs.input_shape, num_classes=obs.num_classes,
        training=cfg.audit.training, seed=cfg.experiment.seed, truth=lambda k: truth, scorer=scorer,
    )  # fmt: skip
    w0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rnd = cfg.fl.rounds + 1
    (sent,) = strategy.configure_train(
        rnd, ArrayRecord(torch_state_dict=w0), ConfigRecord(), AppGrid({}, (NODE,))
    )
    weights = {k: w0[k] + obs.update.tensors[k] if k in obs.update.tensors else w0[k] for k in w0}
    metrics = MetricRecord({"num-examples": obs.update.num_samples})
    reply = Message(RecordDict({"arrays": ArrayRecord(torch_state_dict=weights), "metrics": metrics}),
                    reply_to=sent)  # fmt: skip
    strategy.aggregate_train(rnd, [reply])
    records = [r for r in strategy.records if r["kind"] == "attack"]
    assert all(r["round"] == rnd and r["node_id"] == NODE for r in records)
    return records


def close(x: object, y: object) -> bool:
    if isinstance(x, float) or isinstance(y, float):
        return math.isclose(float(x), float(y), rel_tol=1e-5, abs_tol=1e-5)  # type: ignore[arg-type]
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(close(u, v) for u, v in zip(x, y, strict=True))
    return x == y


def same(a: dict, b: dict, keys: list[str]) -> None:
    for key in keys:
        assert close(a[key], b[key]), (key, a[key], b[key])


TIMINGS = ("attack_seconds", "seconds", "time_seconds")


def compare(cfg, scorer_of) -> tuple[list[dict], list[dict]]:
    """The runner's records of the audited update and the wrapper's: every key both hold is equal (floats
    within 1e-5), timings aside."""
    records = [r for r in run_experiment(cfg).records if r["kind"] == "attack"]
    ((obs, truth),) = audited_updates(cfg)
    flower = through_the_wrapper(cfg, obs, truth, scorer_of(build_setup(cfg)))
    assert len(records) == len(flower) == len(cfg.audit.attacks)
    for inproc, wrapped in zip(records, flower, strict=True):
        shared = sorted(k for k in inproc if k in wrapped and k not in TIMINGS)
        assert {"attack", "options", "num_samples", "aggregated", "num_clients", "batch_size"} <= set(shared)
        assert len(shared) >= 15, shared
        same(inproc, wrapped, shared)
    return records, flower


def test_an_image_update_gets_the_same_record_in_process_and_through_the_flower_wrapper():
    cfg = load_config(ROOT / "src" / "gradleak" / "experiments" / "demo.toml", IMAGE)
    records, flower = compare(cfg, lambda setup: setup.scorer)
    for r in flower:  # the wrapper now scores beside the floors, as the runner does
        assert {"psnr_mean", "floor_class_mean_psnr_mean", "psnr_mean_beyond_floor", "matching_loss"} <= set(
            r
        )
        assert r["psnr_mean_beyond_floor"] == pytest.approx(records[0]["psnr_mean_beyond_floor"], abs=1e-5)


def test_a_text_update_gets_the_same_record_in_process_and_through_the_flower_wrapper():
    cfg = load_config(ROOT / "examples" / "wikitext2_gpt2_dager.toml", TEXT)
    records, flower = compare(cfg, lambda setup: setup.scorer)
    dager = next(r for r in flower if r["attack"] == "dager")
    assert {"rouge1", "floor_null_rouge1", "rouge1_beyond_floor", "valid"} <= set(dager)
    assert dager["texts"] == next(r for r in records if r["attack"] == "dager")["texts"]
