"""``engine = "flower"`` with ``secagg.enabled``: the rounds and the audit run Flower's SecAgg+ protocol
(Ray started by the test, 12 virtual SuperNodes, 4 per round, finite timeouts) and the server gets only the
unmasked aggregate. The reference is the in-process engine under ``fl.secure_aggregation`` on the same
seed: the same clients contribute (a client that raises is a dropout the protocol recovers from), and the
aggregate, the global model after the round and the audit's sums (honest server; Robbing the Fed's
modified model) equal the in-process ones within SecAgg+'s quantisation: one step ``2 c / levels`` per
client in a sum, one step in a weighted mean."""

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
from gradleak.federation import FederatedSimulation, FLConfig, InProcessEngine, sample_clients  # noqa: E402
from gradleak.federation.simulation import SecureRound, derive_seed  # noqa: E402
from gradleak.integrations.flower.config import FlowerEngineConfig, SecAggPlusConfig  # noqa: E402
from gradleak.integrations.flower.engine import FlowerRunner  # noqa: E402
from gradleak.models import build_model  # noqa: E402
from gradleak.types import LocalTraining  # noqa: E402
from synthetic import synthetic_dataset  # noqa: E402

SHAPE, CLASSES, SEED, N = (1, 12, 12), 3, 13, 12
# FedSGD rounds on shards of 6 to 10 images: every client reports its batch of 4 as its weight, so the
# engine's max_weight must be 4 (not the largest shard) for the weighted mean to be exact to one step
ROUND = LocalTraining("fedsgd", batch_size=4, lr=0.05)
FL = FLConfig(rounds=1, fraction=1 / 3, secure_aggregation=True, training=ROUND)
FEDSGD = LocalTraining("fedsgd", batch_size=3)
SECAGG = SecAggPlusConfig(enabled=True)
STEP = 2 * SECAGG.clipping_range / SECAGG.quantization_range  # 3.8e-6
FLOAT = 1e-6  # float32 rounding of the in-process sums (as in test_flower_engine)


def federation() -> tuple[list[ImageDataset], list[int], list[int]]:
    """12 clients of 6 to 10 images; the sampler's first draw is the audit's, its second round 0's. The
    second client of each draw raises inside its ClientApp."""
    clients = [synthetic_dataset(n=6 + k % 5, shape=SHAPE, classes=CLASSES, seed=k) for k in range(N)]
    rng = np.random.default_rng(derive_seed(SEED, 0xC11E))
    audited, sampled = sample_clients(N, FL.fraction, rng), sample_clients(N, FL.fraction, rng)
    for k in {audited[1], sampled[1]}:
        broken = clients[k]
        clients[k] = ImageDataset(broken.name, broken.images, broken.labels + 10, CLASSES)
    return clients, audited, sampled


def simulate(engine_runner, clients, public) -> dict[str, object]:
    """The audit on the initial model (an honest server's sum; Robbing the Fed's), then round 0: the
    audit must not see the round's SecAgg+ rounding, which RtF's imprint layer amplifies."""
    model = build_model("sme_cnn", SHAPE, CLASSES, seed=0)
    # update noise, seeded by the task's generator on either engine (pruning's magnitude ties at its
    # threshold break differently under Ray's thread count and would flip a few entries)
    defenses = functools.partial(build_defenses, [("update_noise", {"clip": 1.0, "sigma": 0.01})])
    sim = FederatedSimulation(model, clients, FL, seed=SEED, defenses=defenses)

    def work(engine):
        sim.engine = engine
        ids = sim.sample()
        honest = sim.collect_secure(ids, FEDSGD, max_samples=3)
        rtf = create_attack("robbing_the_fed", num_bins=8)
        gen = torch.Generator().manual_seed(7)
        broadcast, _ = rtf.prepare(copy.deepcopy(sim.model), public, generator=gen)
        malicious = sim.collect_secure(ids, FEDSGD, models=[broadcast] * len(ids))
        rr = sim.run_round(0)
        state = {k: v.clone() for k, v in sim.model.state_dict().items()}
        return {"round": rr, "honest": honest, "malicious": malicious, "state": state}

    return engine_runner.run(clients, defenses, work)


class _InProcess:
    def run(self, clients, defenses, work, progress=False):
        return work(InProcessEngine())


def assert_same_aggregate(got: SecureRound, want: SecureRound, atol: float) -> None:
    assert got.contributors == want.contributors
    assert got.aggregate is not None and want.aggregate is not None
    assert got.aggregate.num_samples == want.aggregate.num_samples
    assert got.aggregate.kind == want.aggregate.kind
    assert set(got.aggregate.tensors) == set(want.aggregate.tensors)
    for name, t in want.aggregate.tensors.items():
        torch.testing.assert_close(got.aggregate.tensors[name], t, atol=atol, rtol=0, msg=name)
    for g, w in zip(got.results, want.results, strict=True):  # the simulation's scoring: same data
        assert g.client_id == w.client_id and (g.truth is None) == (w.truth is None)
        if w.truth is not None:
            assert torch.equal(g.truth.images, w.truth.images) and g.sample_index == w.sample_index
        assert g.update is None  # the protocol shows the server no client's update


@pytest.mark.timeout(400)
def test_secaggplus_on_the_flower_engine_gives_the_in_process_secure_aggregates():
    clients, audited, sampled = federation()
    public = torch.rand((16, *SHAPE), generator=torch.Generator().manual_seed(3))
    want = simulate(_InProcess(), clients, public)
    config = FlowerEngineConfig(timeout=120, startup_timeout=120, secagg=SECAGG)
    got = simulate(FlowerRunner(config), clients, public)
    expected = [c for c in audited if c != audited[1]]  # the raising client drops out of the protocol
    for key in ("honest", "malicious"):
        assert got[key].contributors == want[key].contributors == expected
        assert "out of bounds" in got[key].results[1].error, got[key].results[1].error
        # a sum of 3 clients: within one quantisation step per client
        assert_same_aggregate(got[key], want[key], atol=len(expected) * STEP + FLOAT)
    assert any("imprint" in n for n in got["malicious"].aggregate.tensors), "RtF's layer reached the nodes"
    rr_got, rr_want = got["round"], want["round"]
    assert rr_got.client_ids == rr_want.client_ids == sampled
    assert rr_got.dropped == rr_want.dropped == [sampled[1]]
    assert "out of bounds" in rr_got.errors[sampled[1]], rr_got.errors
    assert rr_got.aggregate is not None and rr_got.aggregate.metadata["secure_aggregation"] == "secagg+"
    # every client reports 4 samples, so each weighs exactly 1 and the weighted mean is off by < one step
    for name, t in rr_want.aggregate.tensors.items():
        torch.testing.assert_close(rr_got.aggregate.tensors[name], t, atol=STEP + FLOAT, rtol=0, msg=name)
    for name, t in want["state"].items():
        torch.testing.assert_close(got["state"][name], t, atol=STEP + FLOAT, rtol=0, msg=name)
