"""Federated learning simulation: clients, server aggregation, secure-aggregation view, engines."""

from gradleak.federation.server import apply_update, sample_clients, screen, secure_sum, weighted_mean
from gradleak.federation.simulation import (
    ClientTask,
    Engine,
    FederatedSimulation,
    FLConfig,
    InProcessEngine,
    RoundResult,
    derive_seed,
    server_view,
)
from gradleak.tasks.client import ClientResult, train_client

__all__ = [
    "ClientResult", "ClientTask", "Engine", "FLConfig", "FederatedSimulation", "InProcessEngine",
    "RoundResult", "apply_update", "derive_seed", "sample_clients", "screen", "secure_sum",
    "server_view", "train_client", "weighted_mean",
]  # fmt: skip
