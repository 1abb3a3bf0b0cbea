"""A BatchNorm model through 3 rounds of Flower's SecAgg+ (Ray started by the test, bounded timeouts):
gradleak's ``client_app`` leaves integer buffers out of the masked vector (SecAgg+ clips every entry to
its ``clipping_range`` of 8, which a step counter passes within a few steps: before, every BatchNorm
client withheld its reply in round 1), ``LegacyAuditStrategy`` restores the counter it sent, and every
client's masked update reaches every round's aggregate: every parameter and the running statistics move
each round, no reply is withheld or rejected."""

from __future__ import annotations

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import Context  # noqa: E402
from flwr.client.mod import secaggplus_mod  # noqa: E402
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.server import LegacyContext, ServerConfig  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from gradleak.experiments.store import ResultStore  # noqa: E402
from gradleak.integrations.flower import LegacyAuditStrategy  # noqa: E402
from gradleak.integrations.flower.apps import client_app  # noqa: E402
from gradleak.integrations.flower.fuzzing import fresh_model  # noqa: E402  (a BatchNorm CNN, by name)
from gradleak.types import LocalTraining  # noqa: E402
from synthetic import synthetic_dataset  # noqa: E402

SHAPE, CLASSES, NODES, SAMPLES, ROUNDS = (1, 6, 6), 3, 4, 4, 3
TRAINING = LocalTraining("fedavg", epochs=3, batch_size=1, lr=0.05, optimizer="sgd")  # 12 steps > 8 a round


class Watched(FedAvg):
    """Flower's legacy FedAvg, keeping every round's aggregate and how many results it got."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rounds: list[tuple[int, list[np.ndarray]]] = []

    def aggregate_fit(self, server_round, results, failures):
        out = super().aggregate_fit(server_round, results, failures)
        self.rounds.append((len(results), parameters_to_ndarrays(out[0])))
        return out


@pytest.mark.timeout(300)
def test_batchnorm_clients_reach_every_secaggplus_round(tmp_path):
    data = [synthetic_dataset(n=SAMPLES, shape=SHAPE, classes=CLASSES, seed=k) for k in range(NODES)]
    w0 = fresh_model().state_dict()
    inner = Watched(
        fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=NODES, min_available_clients=NODES,
        initial_parameters=ndarrays_to_parameters([t.numpy() for t in w0.values()]),
    )  # fmt: skip
    store = ResultStore(tmp_path / "bn.sqlite")
    strategy = LegacyAuditStrategy(
        inner, model=fresh_model(), attacks=[], input_shape=SHAPE, num_classes=CLASSES, store=store
    )
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=ROUNDS), strategy=strategy)
        secagg = SecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2, max_weight=SAMPLES, timeout=60)
        strategy.run(DefaultWorkflow(fit_workflow=secagg), grid, legacy)

    np.random.seed(0)  # SecAgg+'s stochastic quantisation draws from numpy's global generator
    app = client_app(data, fresh_model, TRAINING, mods=[secaggplus_mod])
    backend = {"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}}
    run_simulation(server_app=server, client_app=app, num_supernodes=NODES, backend_config=backend)

    (run,) = store.runs()
    assert run.status == "complete"
    for kind in ("rejected", "client_error", "no_aggregate", "aggregate_error"):
        assert not store.records(run.run_id, kind), kind
    assert [n for n, _ in inner.rounds] == [NODES] * ROUNDS  # every client in every round's aggregate
    names = list(w0)
    previous = {k: v.double() for k, v in w0.items()}
    for _, arrays in inner.rounds:
        state = dict(zip(names, (torch.from_numpy(a) for a in arrays), strict=True))
        for k in ("conv.weight", "bn.weight", "bn.bias", "fc.weight", "fc.bias"):
            assert not torch.equal(state[k].double(), previous[k]), k  # moved this round
        # client_app sends its statistics as trained (a FedAvg reply's semantics, as in process): they move;
        # the integer counter stays out of the masked vector and the server keeps the one it sent
        assert not torch.equal(state["bn.running_var"].double(), previous["bn.running_var"])
        assert float(state["bn.num_batches_tracked"]) == 0.0
        previous = {k: v.double() for k, v in state.items()}
