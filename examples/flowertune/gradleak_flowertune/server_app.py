"""The ServerApp: Flower's FedAvg over the nodes' adapters, each reply audited by gradleak."""

from __future__ import annotations

import logging

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from gradleak import AuditStrategy, LocalTraining
from gradleak.audit import TextScorer
from gradleak_flowertune.task import adapter_arrays, build, node_data

app = ServerApp()
log = logging.getLogger("gradleak_flowertune")


@app.main()
def main(grid: Grid, context: Context) -> None:
    run = context.run_config
    model, tokenizer = build(run["model"], int(run["lora-r"]), int(run["lora-alpha"]))
    nodes = len(list(grid.get_node_ids()))
    strategy = AuditStrategy(  # gradleak: every reply attacked as this server could (README.md)
        FedAvg(fraction_train=float(run["fraction-train"]), fraction_evaluate=0.0),
        model=model,
        attacks=[run["audit-attack"]],
        input_shape=(int(run["max-tokens"]),),
        num_classes=2,
        store="audit.sqlite",
        scorer=TextScorer(tokenizer),
        training=LocalTraining(
            "fedavg", epochs=int(run["local-epochs"]), batch_size=int(run["batch-size"]), lr=float(run["lr"])
        ),
        truth=lambda k: node_data(k, nodes, int(run["dataset-size"]), tokenizer, int(run["max-tokens"])),
    )
    rounds = int(run["num-server-rounds"])
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(adapter_arrays(model)), num_rounds=rounds,
                            train_config=ConfigRecord({}))  # fmt: skip
    log.warning("training loss by round: %s", dict(result.train_metrics_clientapp))
