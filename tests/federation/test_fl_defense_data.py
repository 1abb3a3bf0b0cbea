"""Data-aware defenses in the simulation: each client's own share reaches its defenses' ``setup``, also when
an audit trains on the first ``max_samples`` of it; the engine interface is unchanged."""

from __future__ import annotations

import pytest
from torch import nn

from gradleak.data.base import ImageDataset
from gradleak.defenses.base import Defense, SetupContext
from gradleak.federation import FederatedSimulation, FLConfig
from gradleak.models import build_model
from gradleak.types import LocalTraining
from synthetic import synthetic_dataset

SEEN: list[tuple[int, int]] = []


class RecordData(Defense):
    name = "record-data"

    def setup(self, model: nn.Module, context: SetupContext) -> None:
        data = context.data
        assert isinstance(data, ImageDataset)
        SEEN.append((len(data), int(data.images.sum() * 1000)))


def test_each_client_share_reaches_data_aware_defenses() -> None:
    clients = [synthetic_dataset(n=10 + 2 * i, shape=(1, 12, 12), seed=i) for i in range(4)]
    model = build_model("lenet", (1, 12, 12), 3, seed=0)
    sim = FederatedSimulation(
        model, clients, FLConfig(rounds=1, fraction=1.0, training=LocalTraining(epochs=1, batch_size=4)),
        seed=0, defenses=lambda: [RecordData()],
    )  # fmt: skip
    SEEN.clear()
    sim.run()
    fingerprint = {(len(c), int(c.images.sum() * 1000)) for c in clients}
    assert set(SEEN) == fingerprint and len(SEEN) == 4
    SEEN.clear()
    results = sim.collect([1, 3], LocalTraining(epochs=1, batch_size=3), max_samples=3)
    assert [r.update.num_samples for r in results] == [3, 3]  # type: ignore[union-attr]
    assert SEEN == [(len(clients[i]), int(clients[i].images.sum() * 1000)) for i in (1, 3)]  # whole share


def test_an_audit_subset_is_the_first_samples_or_a_seeded_random_subset() -> None:
    """``pick="first"`` trains on a client's first ``max_samples``; ``pick="random"`` on a random subset in
    index order, the same for every collection of that round and client, another for another client, and
    drawn from the whole share (a class-ordered share's first samples are its first classes)."""
    clients = [synthetic_dataset(n=40, shape=(1, 12, 12), seed=i) for i in range(3)]
    model = build_model("lenet", (1, 12, 12), 3, seed=0)
    sim = FederatedSimulation(model, clients, FLConfig(rounds=0, fraction=1.0), seed=0)
    training = LocalTraining(protocol="fedsgd", batch_size=5)

    def kept(cid: int, pick: str) -> list[int]:
        (task,) = sim.audit_tasks(0, [cid], training, 5, pick)
        rows = {bytes(x.numpy()): i for i, x in enumerate(clients[cid].images)}
        return [rows[bytes(x.numpy())] for x in task.data.images]

    assert kept(1, "first") == [0, 1, 2, 3, 4]
    rand = kept(1, "random")
    assert rand == sorted(rand) and len(set(rand)) == 5 and rand != [0, 1, 2, 3, 4]
    assert kept(1, "random") == rand  # every attack of the audit sees the same subset
    assert kept(2, "random") != rand
    drawn = {i for cid in range(3) for r in range(20) for i in _kept_at(sim, r, cid, training)}
    assert max(drawn) >= 30  # drawn from the whole share of 40, not its first samples
    results = sim.collect([0, 1], training, max_samples=5, pick="random")
    assert [r.update.num_samples for r in results] == [5, 5]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="pick must be one of"):
        sim.audit_tasks(0, [0], training, 5, "last")


def _kept_at(sim: FederatedSimulation, r: int, cid: int, training: LocalTraining) -> list[int]:
    (task,) = sim.audit_tasks(r, [cid], training, 5, "random")
    rows = {bytes(x.numpy()): i for i, x in enumerate(sim.clients[cid].images)}
    return [rows[bytes(x.numpy())] for x in task.data.images]
