"""The ServerApp: Flower's FedAvg, wrapped in gradleak's AuditStrategy.

In the audited rounds every node's update ``w_T - w_0`` is validated and attacked as an honest-but-curious
server could (the recipe is public here), and each attacked update is written to gradleak's results store
with Flower's round and node ids: ``gradleak results STORE`` shows them. A real server has no ground
truth, so the records hold the attack's own statistics; the in-process engine scores the same attacks.
"""

from __future__ import annotations

import logging
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from gradleak.experiments.store import ResultStore
from gradleak.integrations.flower import AuditStrategy
from gradleak_flower.task import CLASSES, SHAPE, component, model, training

app = ServerApp()
log = logging.getLogger("gradleak_flower")


@app.main()
def main(grid: Grid, context: Context) -> None:
    run = context.run_config
    store = Path(str(run["store"])).expanduser()
    if not store.is_absolute():
        from flwr.supercore.utils import get_flwr_home

        store = get_flwr_home() / store
    strategy = AuditStrategy(
        FedAvg(fraction_train=float(run["fraction-train"]), fraction_evaluate=0.0),
        model=model(),
        attacks=[component(run, "attack")],
        input_shape=SHAPE,
        num_classes=CLASSES,
        store=ResultStore(store),
        training=training(run),  # the public recipe (threat model: known to the server)
        rounds=[int(r) for r in str(run["audit-rounds"]).split(",") if r.strip()],
        seed=int(run["seed"]),
        name="flower-example",
    )
    strategy.start(
        grid, ArrayRecord(torch_state_dict=model().state_dict()), num_rounds=int(run["num-server-rounds"]),
        train_config=ConfigRecord({"lr": float(run["lr"])}), timeout=600.0,
    )  # fmt: skip
    log.warning("gradleak's audit is in %s; show it with: gradleak results %s", store, store)
