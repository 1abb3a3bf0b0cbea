"""Federated learning simulation: clients, server aggregation, secure-aggregation view, engines."""

from gradleak.fl.client import ClientResult, train_client
from gradleak.fl.server import apply_update, evaluate, sample_clients, screen, secure_sum, weighted_mean
from gradleak.fl.simulation import (
    ClientTask,
    Engine,
    FederatedSimulation,
    FLConfig,
    InProcessEngine,
    RoundResult,
    derive_seed,
    server_view,
)

__all__ = [
    "ClientResult", "ClientTask", "Engine", "FLConfig", "FederatedSimulation", "InProcessEngine",
    "RoundResult", "apply_update", "derive_seed", "evaluate", "sample_clients", "screen", "secure_sum",
    "server_view", "train_client", "weighted_mean",
]  # fmt: skip
