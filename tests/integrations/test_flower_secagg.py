"""Flower's SecAgg+ workflow on Flower's simulation engine (Ray started by the test, bounded timeouts):
gradleak's ClientApp with ``secaggplus_mod`` and a ``DefenseMod`` beside it, the ServerApp's
``SecAggPlusWorkflow`` over ``LegacyAuditStrategy``. The wrapper sees only the unmasked aggregate: one
attacked observation of all clients, no per-node record; that aggregate is the weighted mean of the
in-process clients' defended updates within SecAgg+'s quantisation step, and the record is the attack's
result on exactly that aggregate."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import Context  # noqa: E402
from flwr.client.mod import secaggplus_mod  # noqa: E402
from flwr.common import ndarrays_to_parameters  # noqa: E402
from flwr.server import LegacyContext, ServerConfig  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow  # noqa: E402
from flwr.server.workflow.constant import MAIN_PARAMS_RECORD  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from gradleak.attacks import create_attack  # noqa: E402
from gradleak.audit import audit_generators  # noqa: E402
from gradleak.experiments.store import ResultStore  # noqa: E402
from gradleak.federation import train_client  # noqa: E402
from gradleak.federation.server import weighted_mean  # noqa: E402
from gradleak.federation.simulation import derive_seed  # noqa: E402
from gradleak.integrations.flower import DefenseMod, LegacyAuditStrategy  # noqa: E402
from gradleak.integrations.flower.apps import client_app  # noqa: E402
from gradleak.models import build_model  # noqa: E402
from gradleak.registry import DEFENSES  # noqa: E402
from gradleak.types import LocalTraining, Observation, Update  # noqa: E402
from synthetic import synthetic_dataset  # noqa: E402

SHAPE, CLASSES, SEED, NODES, SAMPLES = (1, 12, 12), 3, 5, 4, 4
TRAINING = LocalTraining("fedavg", epochs=1, batch_size=2, lr=0.05, optimizer="sgd")
PRUNE = ("pruning", {"ratio": 0.5})
IG = ("ig", {"max_iterations": 3})
CLIP, QUANT = 8.0, 4194304  # SecAgg+'s clipping_range and quantization_range (Flower's defaults)
STEP = 2 * CLIP / QUANT  # one quantisation step of a client's (weight x dq_ratio); dq_ratio = 1 here


def new_model() -> torch.nn.Module:
    return build_model("sme_cnn", SHAPE, CLASSES, seed=0)


@pytest.mark.timeout(300)
def test_secaggplus_runs_and_the_wrapper_attacks_only_the_aggregate(tmp_path):
    data = [synthetic_dataset(n=SAMPLES, shape=SHAPE, classes=CLASSES, seed=k) for k in range(NODES)]
    store = ResultStore(tmp_path / "secagg.sqlite")
    w0 = new_model().state_dict()
    inner = FedAvg(
        fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=NODES, min_available_clients=NODES,
        initial_parameters=ndarrays_to_parameters([t.numpy() for t in w0.values()]),
    )  # fmt: skip
    strategy = LegacyAuditStrategy(inner, model=new_model(), attacks=[IG], input_shape=SHAPE,
                                   num_classes=CLASSES, store=store, seed=SEED)  # fmt: skip
    final: dict[str, torch.Tensor] = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=1), strategy=strategy)
        # max_weight = each client's sample count: its weight ratio is exactly 1 (no ratio rounding)
        secagg = SecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2, max_weight=SAMPLES,
                                    clipping_range=CLIP, quantization_range=QUANT, timeout=60)  # fmt: skip
        strategy.run(DefaultWorkflow(fit_workflow=secagg), grid, legacy)
        arrays = legacy.state.array_records[MAIN_PARAMS_RECORD].to_torch_state_dict()  # "0", "1", ...
        final.update(zip(w0, arrays.values(), strict=True))  # legacy order = state_dict order

    architecture = functools.partial(build_model, "sme_cnn", SHAPE, CLASSES, seed=0)
    app = client_app(data, architecture, TRAINING, seed=SEED, mods=[secaggplus_mod, DefenseMod([PRUNE])])
    np.random.seed(0)  # SecAgg+'s stochastic quantisation draws from numpy's global generator
    run_simulation(
        server_app=server, client_app=app, num_supernodes=NODES,
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}},
    )  # fmt: skip

    (run,) = store.runs()
    assert run.status == "complete" and run.config["api"] == "legacy"
    assert not store.records(run.run_id, "rejected") and not store.records(run.run_id, "client_error")
    (record,) = store.records(run.run_id, "attack")  # one observation: the aggregate, never a node's update
    assert record["node_id"] is None and record["aggregated"] and record["num_clients"] == NODES
    assert record["num_samples"] == NODES * SAMPLES

    # in process: each client's update (Flower round 1 = round 0), pruned as the mod prunes it
    updates = []
    for k in range(NODES):
        gen = torch.Generator().manual_seed(derive_seed(SEED, 0, k))
        result = train_client(k, new_model(), data[k], TRAINING, [DEFENSES.create(PRUNE[0], **PRUNE[1])], gen)
        assert result.update is not None
        updates.append(result.update)
    mean = weighted_mean(updates)
    seeds = [derive_seed(SEED, 0, k) for k in range(NODES)]
    unpruned = [
        train_client(k, new_model(), data[k], TRAINING, [], torch.Generator().manual_seed(seeds[k]))
        for k in range(NODES)
    ]
    plain = weighted_mean([r.update for r in unpruned if r.update is not None])
    names = list(mean.tensors)
    got = {n: final[n].double() - w0[n].double() for n in names}
    # SecAgg+ unmasks sum_k q_k / 4 with q_k a stochastic rounding of w_k (error < one step each)
    error = max(float((got[n] - mean.tensors[n].double()).abs().max()) for n in names)
    assert error <= STEP, f"SecAgg+ aggregate off the in-process weighted mean by {error:.3g} > {STEP:.3g}"
    off = max(float((got[n] - plain.tensors[n].double()).abs().max()) for n in names)
    assert off > 100 * STEP, "the DefenseMod beside secaggplus_mod did not prune the masked update"

    # the attacked observation is exactly that unmasked aggregate (cast to the model's float32, as sent)
    seen = Update({n: final[n].float() - w0[n] for n in names}, NODES * SAMPLES, "delta", {})
    obs = Observation(new_model().eval(), seen, SHAPE, CLASSES, aggregated=True, num_clients=NODES)
    gen, _ = audit_generators(SEED, 0, record["audit_index"])  # the audit's seed rule (gradleak.audit)
    rec = create_attack(IG[0], **IG[1]).reconstruct(obs, generator=gen)
    assert record["matching_loss"] == pytest.approx(rec.stats["matching_loss"], rel=1e-6)
