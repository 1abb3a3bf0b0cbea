"""``engine = "flower"``: gradleak's rounds and audits with the clients on Flower's simulation engine (Ray,
started by the test, 100 virtual SuperNodes, 10 per round, finite timeouts, one core per client on 2).

The reference is the in-process engine on the same seed: every client's update must match it within
float32 rounding (Ray's workers run torch with their own thread count, which may reorder sums; measured
difference 0), failures must be the same clients with the same cause, and a whole experiment's records
(the round, an honest-server attack, a malicious-server attack that changes the architecture) the same."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from gradleak.attacks import create_attack  # noqa: E402
from gradleak.data.base import ImageDataset  # noqa: E402
from gradleak.defenses.in_loop import build_defenses  # noqa: E402
from gradleak.experiments import load_config, run_experiment  # noqa: E402
from gradleak.federation import FederatedSimulation, FLConfig, InProcessEngine, sample_clients  # noqa: E402
from gradleak.federation.simulation import derive_seed  # noqa: E402
from gradleak.integrations.flower.config import FlowerEngineConfig  # noqa: E402
from gradleak.integrations.flower.engine import FlowerRunner  # noqa: E402
from gradleak.models import build_model  # noqa: E402
from gradleak.types import LocalTraining  # noqa: E402
from synthetic import synthetic_dataset  # noqa: E402

SHAPE, CLASSES, SEED, N = (1, 12, 12), 3, 11, 100
FL = FLConfig(rounds=1, fraction=0.1, training=LocalTraining("fedavg", epochs=1, batch_size=4, lr=0.05))
FEDSGD = LocalTraining("fedsgd", batch_size=3)
ATOL = 1e-6  # float32 rounding of sums over a few hundred terms; the updates are O(1e-2)


def federation() -> tuple[list[ImageDataset], list[int]]:
    """100 clients of 8 synthetic images; the third client sampled in round 0 has labels outside the
    model's classes, so its training raises inside its ClientApp."""
    clients = [synthetic_dataset(n=8, shape=SHAPE, classes=CLASSES, seed=k) for k in range(N)]
    sampled = sample_clients(N, FL.fraction, np.random.default_rng(derive_seed(SEED, 0xC11E)))
    broken = clients[sampled[2]]
    clients[sampled[2]] = ImageDataset(broken.name, broken.images, broken.labels + 10, CLASSES)
    return clients, sampled


def audit_round(sim: FederatedSimulation, public: torch.Tensor) -> dict[str, object]:
    """Round 0 (FedAvg, update noise), then FedSGD updates of 3 samples per client (an audit's
    max_samples), then the same clients on Robbing the Fed's modified model (another architecture)."""
    rr = sim.run_round(0)
    ids = sim.sample()[:2]
    honest = sim.collect(ids, FEDSGD, max_samples=3)
    rtf = create_attack("robbing_the_fed", num_bins=8)
    gen = torch.Generator().manual_seed(7)
    broadcast, _ = rtf.prepare(copy.deepcopy(sim.model), public, generator=gen)
    malicious = sim.collect(ids, FEDSGD, broadcast=broadcast)
    state = {k: v.clone() for k, v in sim.model.state_dict().items()}
    return {"round": rr, "honest": honest, "malicious": malicious, "state": state}


def simulate(engine_runner, clients, public) -> dict[str, object]:
    model = build_model("sme_cnn", SHAPE, CLASSES, seed=0)
    defenses = functools.partial(build_defenses, [("update_noise", {"clip": 1.0, "sigma": 0.01})])
    sim = FederatedSimulation(model, clients, FL, seed=SEED, defenses=defenses)

    def work(engine):
        sim.engine = engine
        return audit_round(sim, public)

    return engine_runner.run(clients, defenses, work)


class _InProcess:
    def run(self, clients, defenses, work, progress=False):
        return work(InProcessEngine())


def assert_same_results(got, want) -> None:
    assert [r.client_id for r in got] == [r.client_id for r in want]
    for g, w in zip(got, want, strict=True):
        assert (g.update is None) == (w.update is None), (g.client_id, g.error, w.error)
        if w.update is None:
            assert g.error is not None and w.error is not None
            assert w.error.split(":")[-1].strip() in g.error  # the same cause, through Flower's error reply
            continue
        assert g.update.kind == w.update.kind and g.update.num_samples == w.update.num_samples
        assert g.sample_index == w.sample_index
        assert torch.equal(g.truth.images, w.truth.images) and torch.equal(g.truth.labels, w.truth.labels)
        assert set(g.update.tensors) == set(w.update.tensors)
        for name, t in w.update.tensors.items():
            torch.testing.assert_close(g.update.tensors[name], t, atol=ATOL, rtol=0, msg=name)
        assert set(g.update.buffers) == set(w.update.buffers)  # BatchNorm statistics travel too
        for name, t in w.update.buffers.items():
            torch.testing.assert_close(g.update.buffers[name], t, atol=ATOL, rtol=0, msg=name)


@pytest.mark.timeout(400)
def test_the_flower_engine_gives_the_in_process_updates_failures_and_model():
    clients, sampled = federation()
    public = torch.rand((16, *SHAPE), generator=torch.Generator().manual_seed(3))
    want = simulate(_InProcess(), clients, public)
    got = simulate(FlowerRunner(FlowerEngineConfig(timeout=120, startup_timeout=120)), clients, public)
    rr_got, rr_want = got["round"], want["round"]
    assert rr_got.client_ids == rr_want.client_ids == sampled
    assert rr_got.dropped == rr_want.dropped == [sampled[2]]  # the raising client, and only it
    assert "out of bounds" in rr_got.errors[sampled[2]]  # cross_entropy's IndexError, as Flower reported it
    assert_same_results(rr_got.results, rr_want.results)
    for name, t in want["state"].items():  # the aggregate applied to the global model
        torch.testing.assert_close(got["state"][name], t, atol=ATOL, rtol=0, msg=name)
    assert_same_results(got["honest"], want["honest"])
    assert all(r.update is not None and len(r.sample_index) == 3 for r in got["honest"])
    assert_same_results(got["malicious"], want["malicious"])
    assert any("imprint" in n for n in got["malicious"][0].update.tensors), "RtF's layer reached the node"


TINY = [
    "data.train_limit=2000", "data.test_limit=200", "data.num_clients=100", "fl.rounds=1", "fl.fraction=0.1",
    "fl.training.epochs=1", "audit.clients=2", "audit.training.batch_size=2",
]  # fmt: skip
RECORD_KEYS = ("kind", "clients", "dropped", "accuracy", "client_id", "batch_size", "matching",
               "label_accuracy")  # fmt: skip


@pytest.mark.timeout(400)
def test_an_experiment_on_the_flower_engine_records_what_the_in_process_engine_records():
    from gradleak.cli.demo import demo_config_path

    attacks = [
        "audit.attacks=[{name = 'ig', max_iterations = 5}, {name = 'robbing_the_fed', num_bins = 64}]",
        "audit.public_limit=100",
    ]
    cfg = load_config(demo_config_path(), TINY + attacks)
    on_flower = load_config(
        demo_config_path(), TINY + attacks + ['engine.name="flower"', "engine.options.timeout=120"]
    )
    want, got = run_experiment(cfg), run_experiment(on_flower)
    assert [r["kind"] for r in got.records] == [r["kind"] for r in want.records] == [
        "round", "attack", "attack", "attack", "attack", "summary"
    ]  # fmt: skip
    for g, w in zip(got.records, want.records, strict=True):
        assert {k: g.get(k) for k in RECORD_KEYS} == {k: w.get(k) for k in RECORD_KEYS}
        for key in ("psnr", "ssim"):
            if key in w:
                assert g[key] == pytest.approx(w[key], abs=1e-3), key
    assert [r["attack"] for r in got.of_kind("attack")] == ["ig", "ig", "robbing_the_fed", "robbing_the_fed"]


@pytest.mark.timeout(400)
def test_a_lora_text_experiment_on_the_flower_engine_records_what_the_in_process_engine_records():
    """GPT-2 arch with LoRA on Rotten Tomatoes, 20 nodes, 4 a round: the nodes rebuild the peft model from
    the server's spec (:func:`gradleak.models.build_module`), so a FedAvg round of adapters and an audit
    of adapter updates give the in-process engine's records (the round's clients, the audit's ROUGE and
    exact sequences). 25 s here on an idle machine."""
    from gradleak.cli.demo import demo_config_path

    text = [
        "data.dataset='rotten_tomatoes'", "data.train_split='all'", "data.test_split='all'",
        "data.train_limit=200", "data.test_limit=16", "data.num_clients=20", "fl.rounds=1",
        "fl.fraction=0.2",
        "fl.training.epochs=1", "fl.training.batch_size=2", "model.name='gpt2_tiny'",
        "model.adapter={r = 64, alpha = 64}", "audit.clients=2", "audit.training.batch_size=2",
        "audit.attacks=[{name = 'dager_lora'}]",
    ]  # fmt: skip
    cfg = load_config(demo_config_path(), text)
    on_flower = load_config(demo_config_path(), [*text, 'engine.name="flower"', "engine.options.timeout=120"])
    want, got = run_experiment(cfg), run_experiment(on_flower)
    assert [r["kind"] for r in got.records] == [r["kind"] for r in want.records]
    assert [r["kind"] for r in want.records].count("attack") == 2
    keys = ("kind", "clients", "dropped", "client_id", "batch_size", "rouge1", "rouge2", "exact")
    for g, w in zip(got.records, want.records, strict=True):
        assert {k: g.get(k) for k in keys} == {k: w.get(k) for k in keys}
