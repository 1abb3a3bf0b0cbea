"""Data-aware defenses in the simulation: each client's own share reaches its defenses' ``setup``, also when
an audit trains on the first ``max_samples`` of it; the engine interface is unchanged."""

from __future__ import annotations

import torch
from torch import nn

from gradleak.data.base import ImageDataset
from gradleak.defenses.base import Defense
from gradleak.fl import FederatedSimulation, FLConfig
from gradleak.models import build_model
from gradleak.types import LocalTraining

from conftest import synthetic_dataset

SEEN: list[tuple[int, int]] = []


class RecordData(Defense):
    name = "record-data"

    def setup(
        self, model: nn.Module, *, generator: torch.Generator, data: ImageDataset | None = None
    ) -> None:
        assert data is not None
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
