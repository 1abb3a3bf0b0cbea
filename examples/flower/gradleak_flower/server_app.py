"""The ServerApp: Flower's FedAvg over the nodes for a few rounds, the global model tested on the server's
own held-out data after each."""

from __future__ import annotations

import logging

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from gradleak import AuditStrategy, LocalTraining
from gradleak_flower.task import Net, load_centralized_dataset, load_data
from gradleak_flower.task import test as test_fn

app = ServerApp()
log = logging.getLogger("gradleak_flower")


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """The global model's loss and accuracy on the server's held-out test set."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    loss, accuracy = test_fn(model, load_centralized_dataset(), torch.device("cpu"))
    return MetricRecord({"loss": loss, "accuracy": accuracy})


@app.main()
def main(grid: Grid, context: Context) -> None:
    run = context.run_config
    lr, batch_size, epochs = float(run["lr"]), int(run["batch-size"]), int(run["local-epochs"])
    fractions = float(run["fraction-train"]), float(run["fraction-evaluate"])
    strategy = FedAvg(fraction_train=fractions[0], fraction_evaluate=fractions[1])
    strategy = AuditStrategy(  # gradleak: each update received, attacked as this server could (README.md)
        strategy, model=Net(), input_shape=(3, 32, 32), num_classes=10, public=load_centralized_dataset(),
        attacks=[("auto", {"budget": run["audit-budget"]})], store="audit.sqlite", figures="audit-figures",
        training=LocalTraining("fedavg", epochs=epochs, batch_size=batch_size, lr=lr, momentum=0.9),
        truth=lambda k: load_data(k, len(list(grid.get_node_ids())), batch_size, run["dataset-size"])[0])
    result = strategy.start(
        grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=int(run["num-server-rounds"]),
        train_config=ConfigRecord({"lr": lr}), evaluate_fn=global_evaluate,
    )
    log.warning("server-side evaluation by round: %s", dict(result.evaluate_metrics_serverapp))
