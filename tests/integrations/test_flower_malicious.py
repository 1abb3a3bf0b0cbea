"""The malicious-server option of AuditStrategy, around Flower's FedAvg and Flower's round loop, over a grid
that runs gradleak's real ClientApp (``apps.client_app``) in this process: the first sampled node gets
Robbing the Fed's modified model, its reply is attacked with the attack's secrets and gives what the
in-process runner gives on the same model, seed and data; the other nodes are audited honestly; the
planted reply never reaches the aggregate; a ClientApp that loads weights into its own architecture
refuses the modified model, and the audit records that node's error."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, Context, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from flowergrid import AppGrid  # noqa: E402
from flowergrid import server_identity as flower_server_identity  # noqa: E402
from gradleak.attacks import create_attack  # noqa: E402
from gradleak.audit import (
    audit_generators,  # noqa: E402
    score_reconstruction,  # noqa: E402
)
from gradleak.defenses.guard import GuardConfig  # noqa: E402
from gradleak.experiments.store import ResultStore  # noqa: E402
from gradleak.federation import train_client  # noqa: E402
from gradleak.federation.simulation import derive_seed  # noqa: E402
from gradleak.integrations.flower import AuditStrategy  # noqa: E402
from gradleak.integrations.flower.apps import client_app  # noqa: E402
from gradleak.models import build_model  # noqa: E402
from gradleak.types import LocalTraining, Observation  # noqa: E402
from synthetic import synthetic_dataset  # noqa: E402

SHAPE, CLASSES, SEED = (1, 12, 12), 3, 4
NODES = (101, 102, 103)  # Flower node ids; partition-id k = index
CLIENTS = [synthetic_dataset(n=4, shape=SHAPE, classes=CLASSES, seed=20 + k) for k in range(3)]
TRAINING = LocalTraining("fedavg", epochs=1, batch_size=4, lr=0.05)  # one SGD step: RtF's ratio is exact
RTF = ("robbing_the_fed", {"num_bins": 32})
PUBLIC = torch.rand((64, *SHAPE), generator=torch.Generator().manual_seed(9))
build = functools.partial(build_model, "sme_cnn", SHAPE, CLASSES, seed=0)


@pytest.fixture(autouse=True)
def server_identity():
    with flower_server_identity(1):
        yield


def audit(tmp_path, apps):
    store = ResultStore(tmp_path / "audit.sqlite")
    strategy = AuditStrategy(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3), model=build(),
        attacks=[("ig", {"max_iterations": 3})], input_shape=SHAPE, num_classes=CLASSES, store=store,
        training=TRAINING, seed=SEED, truth=lambda k: CLIENTS[k], malicious=RTF, malicious_nodes=1,
        public_images=PUBLIC,
    )  # fmt: skip
    result = strategy.start(
        AppGrid(apps, NODES), ArrayRecord(torch_state_dict=build().state_dict()), num_rounds=1
    )
    return strategy, store, result


def local(k: int, model: torch.nn.Module):
    return train_client(
        k, model, CLIENTS[k], TRAINING, [], torch.Generator().manual_seed(derive_seed(SEED, 0, k))
    )


def test_the_planted_node_is_attacked_with_the_secrets_and_left_out_of_the_aggregate(tmp_path):
    app = client_app(CLIENTS, build, TRAINING, seed=SEED, accept_architecture=True)
    strategy, store, result = audit(tmp_path, dict.fromkeys(NODES, app))
    (run,) = store.runs()
    attacks = store.records(run.run_id, "attack")
    planted = [a for a in attacks if a["malicious"]]
    honest = [a for a in attacks if not a["malicious"]]
    assert [a["attack"] for a in planted] == ["robbing_the_fed"] and [a["attack"] for a in honest] == [
        "ig",
        "ig",
    ]
    k = planted[0]["partition_id"]
    assert sorted([k] + [a["partition_id"] for a in honest]) == [0, 1, 2]
    # the in-process runner's path: the attack's model from the round's weights, the client trains it
    rtf = create_attack(RTF[0], **RTF[1])
    broadcast, secrets = rtf.prepare(build().eval(), PUBLIC, generator=torch.Generator().manual_seed(
        derive_seed(SEED, 0xBAD, 1)))  # fmt: skip
    update = local(k, copy.deepcopy(broadcast)).update
    obs = Observation(broadcast.eval(), update, SHAPE, CLASSES, TRAINING, secrets=secrets)
    gen, _ = audit_generators(SEED, 0, planted[0]["audit_index"])
    want = score_reconstruction(rtf.reconstruct(obs, generator=gen), CLIENTS[k])
    # the server sees (w0 + u) - w0: u up to float32 rounding, a fraction of a dB at RtF's 60+ dB
    assert planted[0]["psnr"] == pytest.approx(want["psnr"], abs=0.5)
    assert planted[0]["matching"] == want["matching"]
    assert max(want["psnr"]) > 40  # a bin holding one image gives it back exactly (Fowl et al.)
    # FedAvg averaged only the two honest nodes' weights (4 samples each: the plain mean)
    w0 = build().state_dict()
    expected = {n: torch.zeros_like(t) for n, t in w0.items()}
    for j in (a["partition_id"] for a in honest):
        u = local(j, build()).update
        for n in expected:
            expected[n] += (w0[n] + u.tensors[n]) / 2
    got = result.arrays.to_torch_state_dict()
    for n, t in expected.items():
        torch.testing.assert_close(got[n], t, atol=1e-6, rtol=0, msg=n)
    assert run.config["malicious"] == ["robbing_the_fed", {"num_bins": 32}]


def test_a_client_app_refuses_the_servers_architecture_unless_it_opted_in(tmp_path):
    app = client_app(CLIENTS, build, TRAINING, seed=SEED)  # accept_architecture defaults to False
    strategy, store, result = audit(tmp_path, dict.fromkeys(NODES, app))
    (run,) = store.runs()
    errors = store.records(run.run_id, "client_error")
    assert len(errors) == 1 and "ArchitectureRefused" in errors[0]["error"]
    assert "accept_architecture=True" in errors[0]["error"]
    assert [a["attack"] for a in store.records(run.run_id, "attack")] == ["ig", "ig"]


def test_a_client_app_with_its_own_architecture_refuses_the_modified_model_and_the_audit_records_it(tmp_path):
    honest_app = client_app(CLIENTS, build, TRAINING, seed=SEED)
    apps = {node: _strict_but_training(honest_app) for node in NODES}
    strategy, store, result = audit(tmp_path, apps)
    (run,) = store.runs()
    errors = store.records(run.run_id, "client_error")
    assert len(errors) == 1 and "Unexpected key(s) in state_dict" in errors[0]["error"], errors
    attacks = store.records(run.run_id, "attack")
    assert [a["attack"] for a in attacks] == ["ig", "ig"]  # the two honest nodes, audited as usual
    assert errors[0]["node_id"] not in {a["node_id"] for a in attacks}


def _strict_but_training(inner: ClientApp) -> ClientApp:
    """Loads the server's weights strictly into its own architecture first, then trains as ``inner``."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        build().load_state_dict(msg.content["arrays"].to_torch_state_dict())  # raises on the imprint layer
        plain = Message(
            RecordDict({k: r for k, r in msg.content.items() if k != "gradleak.architecture"}),
            dst_node_id=msg.metadata.dst_node_id, message_type=msg.metadata.message_type,
        )  # fmt: skip
        return Message(inner(plain, ctx).content, reply_to=msg)

    return app


def test_a_guarded_client_app_refuses_a_model_that_keeps_its_architecture(tmp_path):
    """Robbing the Fed's bins written into the node's own first linear layer pass any architecture check;
    the guard refuses them on their weights, the node trains nothing and the audit records why."""
    app = client_app(CLIENTS, build, TRAINING, seed=SEED, guard=GuardConfig())
    store = ResultStore(tmp_path / "audit.sqlite")
    strategy = AuditStrategy(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3), model=build(),
        attacks=[("ig", {"max_iterations": 3})], input_shape=SHAPE, num_classes=CLASSES, store=store,
        training=TRAINING, seed=SEED, truth=lambda k: CLIENTS[k], malicious=("rtf_in_place", {}),
        malicious_nodes=1, public_images=PUBLIC,
    )  # fmt: skip
    weights = ArrayRecord(torch_state_dict=build().state_dict())
    strategy.start(AppGrid(dict.fromkeys(NODES, app), NODES), weights, num_rounds=1)
    (run,) = store.runs()
    errors = store.records(run.run_id, "client_error")
    assert len(errors) == 1 and "MaliciousModelError" in errors[0]["error"], errors
    assert "parallel" in errors[0]["error"]
    assert [a["attack"] for a in store.records(run.run_id, "attack")] == ["ig", "ig"]  # the honest two
