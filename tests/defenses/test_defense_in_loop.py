"""The in-loop API: a user's own PyTorch loop with ``defend`` sends exactly what a hand-driven defense chain
gives (every hook at its place), fails closed for good, and builds the optimizer after ``setup``."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from gradleak.defenses.aegis.cache import SyntheticCache
from gradleak.defenses.aegis.defense import aegis_for_client
from gradleak.defenses.base import Defense, DefenseChain, DefenseFailure, SetupContext
from gradleak.defenses.in_loop import build_defenses, defend
from gradleak.models import build_model
from gradleak.registry import DEFENSES
from synthetic import synthetic_dataset

SHAPE = (1, 12, 12)
DATA = synthetic_dataset(n=24, shape=SHAPE, classes=3, seed=2)


def fresh(name: str) -> Defense:
    if name == "aegis":
        cache = synthetic_dataset(n=8, shape=SHAPE, classes=3, seed=7)
        return aegis_for_client(SyntheticCache(cache.images, cache.labels), cache={"size": 8}, micro_batch=8)
    options = {
        "soteria": {"probes": 2},
        "batch_noise": {"batch_size": 8, "sigma": 0.5},
        "compression": {"ratio": 0.2},
    }
    defense: Defense = DEFENSES.create(name, **options.get(name, {}))
    return defense


def reference_delta(name: str, seed: int) -> dict[str, torch.Tensor]:
    """The slow obvious way: the chain's hooks called by hand around a plain Adam loop."""
    model = build_model("aegis_cnn", SHAPE, 3, seed=0)
    gen = torch.Generator().manual_seed(seed)
    chain = DefenseChain([fresh(name)])
    chain.setup(model, SetupContext(gen, DATA))
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    step = 0
    for _ in range(2):
        for idx in torch.randperm(len(DATA), generator=gen).split(8):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(DATA.images[idx]), DATA.labels[idx]).backward()
            chain.on_gradients(model, step)
            opt.step()
            step += 1
        chain.on_epoch_end(model, opt)
    from gradleak.types import Update

    delta = {n: p.detach() - w0[n] for n, p in model.named_parameters()}
    return dict(chain.on_update(Update(delta, len(DATA))).tensors)


@pytest.mark.parametrize("name", sorted(e.name for e in DEFENSES if e.modality != "text"))
def test_a_users_own_loop_sends_what_the_hand_driven_chain_sends(name):
    model = build_model("aegis_cnn", SHAPE, 3, seed=0)
    gen = torch.Generator().manual_seed(11)
    loop = defend(model, lambda ps: torch.optim.Adam(ps, lr=0.01), [fresh(name)], generator=gen, data=DATA)
    for _ in range(2):  # the user's loop: their batching, their loss, their optimizer calls
        for idx in torch.randperm(len(DATA), generator=gen).split(8):
            loop.optimizer.zero_grad()
            loss = torch.nn.CrossEntropyLoss()(model(DATA.images[idx]), DATA.labels[idx])
            loss.backward()
            loop.optimizer.step()
        loop.end_epoch()
    update = loop.update(num_samples=len(DATA))
    expected = reference_delta(name, 11)
    assert update.kind == "delta" and update.metadata["local_steps"] == 6
    for n, t in expected.items():
        assert torch.equal(update.tensors[n], t), n  # the same hooks at the same places, bit for bit
    assert any(bool(t.abs().sum() > 0) for t in update.tensors.values())


def test_fedsgd_gradient_through_the_loop_equals_the_hand_driven_chain():
    model = build_model("aegis_cnn", SHAPE, 3, seed=0)
    loop = defend(model, None, [("pruning", {"ratio": 0.5})], copy_model=True)
    F.cross_entropy(loop.model(DATA.images[:4]), DATA.labels[:4]).backward()
    got = loop.gradient(num_samples=4)
    chain = DefenseChain(build_defenses([("pruning", {"ratio": 0.5})]))
    model.zero_grad()
    F.cross_entropy(model(DATA.images[:4]), DATA.labels[:4]).backward()
    chain.on_gradients(model, 0)
    from gradleak.types import Update

    want = chain.on_update(Update({n: p.grad.clone() for n, p in model.named_parameters()}, 4, "gradient"))
    assert got.kind == "gradient" and all(torch.equal(got.tensors[n], want.tensors[n]) for n in want.tensors)
    assert loop.model is not model  # copy_model: the caller's model is not trained
    assert (
        sum(int((t == 0).sum()) for t in got.tensors.values())
        >= sum(t.numel() for t in got.tensors.values()) // 2
    )


class Explodes(Defense):
    name = "explodes"

    def on_gradients(self, model, step):
        if step == 1:
            raise RuntimeError("boom")


def test_a_failure_is_sticky_so_no_update_can_leave_after_it():
    model = build_model("lenet", SHAPE, 3, seed=0)
    loop = defend(model, lambda ps: torch.optim.SGD(ps, lr=0.1), [Explodes()])
    steps_raised = 0
    for i in range(3):
        loop.optimizer.zero_grad()
        F.cross_entropy(model(DATA.images[i * 4 : i * 4 + 4]), DATA.labels[i * 4 : i * 4 + 4]).backward()
        try:
            loop.optimizer.step()
        except DefenseFailure:
            steps_raised += 1  # a careless user carries on
    assert steps_raised == 2  # step 1 failed, and step 2 refused to run
    with pytest.raises(DefenseFailure, match="explodes"):
        loop.update(num_samples=12)
    with pytest.raises(DefenseFailure):
        loop.gradient(num_samples=12)


def test_the_optimizer_is_built_after_setup_over_the_parameters_left_trainable():
    from gradleak.models.text import build_gpt2

    gpt2 = build_gpt2("tiny", "classification", seed=0)
    loop = defend(gpt2.model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), ["aegis_llm"], copy_model=True)
    frozen = {id(p) for n, p in loop.model.named_parameters() if not p.requires_grad}
    assert frozen and any(".attn." in n for n, p in loop.model.named_parameters() if not p.requires_grad)
    in_opt = {id(p) for g in loop.optimizer.param_groups for p in g["params"]}
    assert not frozen & in_opt and len(in_opt) == sum(p.requires_grad for p in loop.model.parameters())


def test_defense_specs_and_their_errors():
    built = build_defenses(["pruning", ("batch_noise", {"sigma": 0.1}), Explodes()])
    assert [d.name for d in built] == ["pruning", "batch_noise", "explodes"]
    with pytest.raises(TypeError, match="a registered name or"):
        build_defenses([42])
    with pytest.raises(KeyError, match="unknown defense"):
        build_defenses(["nope"])


def test_weights_for_a_flower_reply_are_w0_plus_the_defended_update():
    model = build_model("lenet", SHAPE, 3, seed=0)
    w0 = {n: t.clone() for n, t in model.state_dict().items()}
    loop = defend(model, lambda ps: torch.optim.SGD(ps, lr=0.5), [("pruning", {"ratio": 0.9})])
    loop.optimizer.zero_grad()
    F.cross_entropy(model(DATA.images[:8]), DATA.labels[:8]).backward()
    loop.optimizer.step()
    raw = {n: t.clone() for n, t in model.state_dict().items()}
    sent = loop.weights(num_samples=8)
    for n, t in sent.items():
        delta = t - w0[n]
        assert int((delta == 0).sum()) >= int(0.9 * t.numel()) - 1, n  # pruned, unlike the raw weights
    assert any(int(((raw[n] - w0[n]) == 0).sum()) < int(0.9 * raw[n].numel()) for n in raw)


def test_closures_and_fused_optimizers_are_refused():
    model = build_model("lenet", SHAPE, 3, seed=0)
    loop = defend(model, lambda ps: torch.optim.SGD(ps, lr=0.1), [])

    def closure():
        loop.optimizer.zero_grad()
        loss = F.cross_entropy(model(DATA.images[:4]), DATA.labels[:4])
        loss.backward()
        return loss

    with pytest.raises(DefenseFailure, match="closure"):
        loop.optimizer.step(closure)
    with pytest.raises(DefenseFailure):
        loop.update(num_samples=4)  # sticky
    with pytest.raises(ValueError, match="fused"):
        defend(
            build_model("lenet", SHAPE, 3, seed=0), lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True), []
        )
