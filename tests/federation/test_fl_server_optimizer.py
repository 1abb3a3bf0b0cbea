"""FedOpt server optimisers (``fl.server_optimizer``): the server's AdamW / Adam step on the aggregate equals
a hand-written AdamW / Adam on the pseudo-gradient, and a run resumed from a checkpoint steps as an
uninterrupted one (the optimiser's moments travel with the model)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from gradleak.federation import FederatedSimulation, FLConfig
from gradleak.models import build_model
from gradleak.types import LocalTraining
from synthetic import synthetic_dataset


def _adam_reference(w: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float, decoupled: bool):
    """Adam / AdamW written out (Kingma & Ba, Alg. 1; Loshchilov & Hutter for the decoupled decay)."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        if decoupled:
            w = w * (1 - lr * wd)
        else:
            g = g + wd * w
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    return w


@pytest.mark.parametrize(("optimizer", "protocol"), [("adamw", "fedsgd"), ("adam", "fedavg")])
def test_the_server_optimizer_steps_on_the_pseudo_gradient(optimizer, protocol):
    clients = [synthetic_dataset(n=12, shape=(1, 12, 12), seed=i) for i in range(3)]
    model = build_model("lenet", (1, 12, 12), 3, seed=0)
    training = LocalTraining(protocol=protocol, epochs=1, batch_size=4, lr=0.05)
    cfg = FLConfig(rounds=3, fraction=1.0, training=training, server_optimizer=optimizer, server_lr=0.01,
                   server_weight_decay=0.1)  # fmt: skip
    init = copy.deepcopy(model)
    sim = FederatedSimulation(model, clients, cfg, seed=4)
    pseudo: list[dict[str, torch.Tensor]] = []  # the aggregates the server received, as pseudo-gradients
    sign = -1.0 if protocol == "fedavg" else 1.0  # FedAvg sends w_T - w_0: its pseudo-gradient is -delta
    for r in range(cfg.rounds):
        rr = sim.run_round(r)
        assert rr.aggregate is not None and rr.aggregate.kind == (
            "delta" if protocol == "fedavg" else "gradient"
        )
        pseudo.append({n: sign * t for n, t in rr.aggregate.tensors.items()})
    for name, w0 in init.named_parameters():
        want = _adam_reference(
            w0.detach().clone(), [g[name] for g in pseudo], 0.01, 0.1, optimizer == "adamw"
        )
        got = dict(sim.model.named_parameters())[name].detach()
        assert torch.allclose(got, want, atol=1e-7, rtol=1e-5), (name, float((got - want).abs().max()))


def test_a_resumed_run_steps_as_an_uninterrupted_one():
    clients = [synthetic_dataset(n=10, shape=(1, 12, 12), seed=i) for i in range(4)]
    cfg = FLConfig(rounds=4, fraction=0.5, training=LocalTraining(protocol="fedsgd", batch_size=5),
                   server_optimizer="adamw", server_lr=0.01)  # fmt: skip
    whole = FederatedSimulation(build_model("lenet", (1, 12, 12), 3, seed=1), clients, cfg, seed=2)
    whole.run()
    first = FederatedSimulation(build_model("lenet", (1, 12, 12), 3, seed=1), clients, cfg, seed=2)
    first.run(2)
    tensors, state = first.state()
    assert any(k.startswith("server_opt/") for k in tensors)  # the moments are in the checkpoint
    resumed = FederatedSimulation(build_model("lenet", (1, 12, 12), 3, seed=1), clients, cfg, seed=2)
    resumed.restore(tensors, state, first.history)
    resumed.run(2)
    for (n, a), (_, b) in zip(whole.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    without = FederatedSimulation(build_model("lenet", (1, 12, 12), 3, seed=1), clients, cfg, seed=2)
    model_only = {k: v for k, v in tensors.items() if not k.startswith("server_opt/")}
    without.model.load_state_dict(model_only)  # the moments lost: a different run (what the test guards)
    without._rng.bit_generator.state = state["sampler"]  # type: ignore[assignment]
    without.run(2)
    assert not torch.equal(next(whole.model.parameters()), next(without.model.parameters()))
    assert F.mse_loss(next(whole.model.parameters()), next(without.model.parameters())) > 0


def test_an_unknown_server_optimizer_is_refused_by_name():
    with pytest.raises(ValueError, match="server_optimizer must be one of \\['sgd', 'adam', 'adamw'\\]"):
        FLConfig(server_optimizer="lion")


def test_a_step_on_an_aggregate_that_misses_a_trainable_parameter_is_refused():
    from gradleak.federation.server import ServerOptimizer, apply_update
    from gradleak.types import Update

    model = build_model("lenet", (1, 12, 12), 3, seed=0)
    partial = Update({n: torch.zeros_like(p) for n, p in list(model.named_parameters())[1:]}, 1)
    with pytest.raises(ValueError, match="lacks .* of the model's trainable parameters"):
        apply_update(model, partial)
    with pytest.raises(ValueError, match="lacks .* of the model's trainable parameters"):
        ServerOptimizer("adam", model, 1e-3).step(partial)
