"""The client's guard (defenses/guard.py): refuses every malicious model gradleak builds, each for the
signature its attack must leave, passes honest models through real FedAvg training, and its statistics
agree with slow references."""

from __future__ import annotations

import copy
import math
from itertools import combinations

import pytest
import torch

from gradleak.attacks import create_attack
from gradleak.defenses.guard import (
    GuardConfig,
    MaliciousModelError,
    ModelGuard,
    guard_model,
    near_parallel,
    relative_change,
)
from gradleak.federation.simulation import FederatedSimulation, FLConfig
from gradleak.models import build_model
from gradleak.types import LocalTraining
from synthetic import synthetic_dataset

SHAPE = (1, 12, 12)
CLASSES = 4


def public():
    return synthetic_dataset(n=200, shape=SHAPE, classes=CLASSES, seed=99).images


def probe():
    return synthetic_dataset(n=64, shape=SHAPE, classes=CLASSES, seed=7).images


def malicious(name, model, **options):
    attack = create_attack(name, **options)
    out, _ = attack.prepare(model, public(), generator=torch.Generator().manual_seed(0))
    return out


@pytest.mark.parametrize(
    ("name", "signature"),
    [
        ("rtf_in_place", "parallel"),  # one direction in every bin row, one shared back-connection column
        ("loki_in_place", "bias"),  # the closed slots' biases
        ("trap_weights", "balance"),  # exactly half of each row negated
        ("class_fishing", "degenerate"),  # zeroed output rows
    ],
)
@pytest.mark.parametrize("arch", ["mlp", "sme_cnn"])
def test_each_malicious_model_is_refused_for_its_signature(name, signature, arch):
    own = build_model(arch, SHAPE, CLASSES, seed=0)
    guard = ModelGuard(own)  # no drift reference: the stateless checks alone
    verdict = guard.inspect(malicious(name, own).state_dict(), probe())
    assert not verdict.safe
    assert signature in {f.check for f in verdict.findings}, verdict.reason()


def test_an_imprint_block_fails_the_architecture_check():
    own = build_model("mlp", SHAPE, CLASSES, seed=0)
    for name in ("robbing_the_fed", "loki"):
        verdict = ModelGuard(own).inspect(malicious(name, own).state_dict(), probe())
        assert {f.check for f in verdict.findings} == {"architecture"}
        assert "lacks" in verdict.reason()


def test_honest_models_pass_through_fedavg_training():
    """Every global model of 6 rounds of real FedAvg (4 clients, two epochs each) passes every client's
    guard, drift included (each guard remembers what it accepted)."""
    data = synthetic_dataset(n=160, shape=SHAPE, classes=CLASSES, seed=1)
    clients = [data.subset(list(range(i, 160, 4))) for i in range(4)]
    model = build_model("mlp", SHAPE, CLASSES, seed=2)
    guards = [ModelGuard(model, trusted_start=True) for _ in clients]
    training = LocalTraining(protocol="fedavg", epochs=2, batch_size=8, lr=0.2)
    sim = FederatedSimulation(model, clients, FLConfig(rounds=6, fraction=1.0, training=training), seed=3)
    first = {n: t.clone() for n, t in model.state_dict().items()}
    for r in range(7):
        for guard, c in zip(guards, clients, strict=True):
            verdict = guard.inspect(model.state_dict(), c.images)
            assert verdict.safe, f"round {r}: {verdict.reason()}"
        if r < 6:
            sim.run_round(r)
    moved = (model.state_dict()["layers.1.weight"] - first["layers.1.weight"]).norm()
    assert float(moved) > 0.01 * float(first["layers.1.weight"].norm())  # it did train


def test_drift_catches_the_evasions_of_the_stateless_checks():
    """Random halves evade the balance count and noisy bins the parallel test; a client that knows the
    model it accepted last sees the rewritten layer move by about its whole size."""
    own = build_model("mlp", SHAPE, CLASSES, seed=0)
    for name, options in (("trap_weights", {"exact_half": False}), ("rtf_in_place", {"noise": 1.0})):
        sent = malicious(name, own, **options).state_dict()
        stateless = ModelGuard(own).inspect(sent, probe())
        assert stateless.safe, stateless.reason()  # the evasion works on a guard without a reference
        verdict = ModelGuard(own, trusted_start=True).inspect(sent, probe())
        assert [f.check for f in verdict.findings if f.check != "bias"][:1] == ["drift"], verdict.reason()


def test_a_refused_model_does_not_become_the_reference():
    own = build_model("mlp", SHAPE, CLASSES, seed=0)
    guard = ModelGuard(own, trusted_start=True)
    bad = malicious("trap_weights", own, exact_half=False).state_dict()
    assert not guard.inspect(bad, probe()).safe
    assert not guard.inspect(bad, probe()).safe  # still measured against the trusted start
    assert guard.inspect(own.state_dict(), probe()).safe


def test_near_parallel_matches_the_pairwise_definition():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(40, 30, generator=g)
    m[5] = -3.0 * m[2]  # anti-parallel counts too
    m[17] = 0.5 * m[2] + 1e-4 * torch.randn(30, generator=g)
    m[30] = 0.0  # a zero row has no direction
    slow = set()
    for i, j in combinations(range(40), 2):
        ni, nj = float(m[i].norm()), float(m[j].norm())
        if ni > 0 and nj > 0 and abs(float(m[i] @ m[j])) / (ni * nj) >= 0.99:
            slow |= {i, j}
    assert slow == {2, 5, 17}
    assert near_parallel(m, 0.99) == len(slow)
    assert near_parallel(m, 0.99, chunk=7) == len(slow)  # chunking changes nothing


def test_random_rows_hit_the_exact_half_at_the_binomial_rate():
    """The balance check's premise: a random row of D entries has exactly D/2 negatives with probability
    C(D, D/2) / 2^D (about sqrt(2 / (pi D))), far below the 50 % that raises an alarm."""
    d = 144
    w = torch.randn(20_000, d, generator=torch.Generator().manual_seed(1))
    share = float(((w < 0).sum(dim=1) == d // 2).float().mean())
    exact = math.comb(d, d // 2) / 2**d
    assert abs(share - exact) < 4 * math.sqrt(exact * (1 - exact) / 20_000)  # 4 standard errors
    assert exact < 0.07


def test_architecture_check_names_each_problem():
    own = build_model("sme_cnn", SHAPE, CLASSES, seed=0)
    state = own.state_dict()
    guard = ModelGuard(own)
    first = next(iter(state))
    cases = {
        "lacks": {**state, "extra.weight": torch.zeros(2)},
        "missing": {n: t for n, t in state.items() if n != first},
        "shape": {**state, first: torch.zeros(3)},
        "non-finite": {**state, first: state[first].clone().fill_(math.nan)},
        "dtype": {**state, first: state[first].double()},
        "not a tensor": {**state, first: [1.0]},
    }
    for word, sent in cases.items():
        verdict = guard.inspect(sent, probe())
        assert [f.check for f in verdict.findings] == ["architecture"], word
        assert word in verdict.reason(), verdict.reason()


def test_an_integer_buffer_may_arrive_as_an_averaged_float():
    """Flower's FedAvg averages BatchNorm's num_batches_tracked in float64 (three clients at 7: 6.999...; 1
    and 2 steps weighted 10:40: 1.8): any finite count >= 0 passes, a negative one does not."""
    own = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(144, 32), torch.nn.BatchNorm1d(32),
                              torch.nn.ReLU(), torch.nn.Linear(32, CLASSES))  # fmt: skip
    state = own.state_dict()
    guard = ModelGuard(own)
    for count in (3.0, 7 * (1 / 3) * 3, 1.8):
        sent = {**state, "2.num_batches_tracked": torch.tensor(count, dtype=torch.float64)}
        assert guard.inspect(sent, probe(), remember=False).safe, count
    verdict = guard.inspect(
        {**state, "2.num_batches_tracked": torch.tensor(-1.0, dtype=torch.float64)}, probe()
    )
    assert "dtype" in verdict.reason()


def test_guard_model_raises_with_the_reasons():
    own = build_model("mlp", SHAPE, CLASSES, seed=0)
    with pytest.raises(MaliciousModelError, match="degenerate"):
        guard_model(malicious("class_fishing", own), probe())
    assert guard_model(own, probe()).safe


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"checks": ("parallel", "nope")}, "unknown guard checks"),
        ({"parallel_cosine": 0.0}, "parallel_cosine"),
        ({"max_drift": math.inf}, "max_drift"),
        ({"parallel_rows": 1}, "parallel_rows"),
        ({"probe_size": True}, "probe_size"),
    ],
)
def test_bad_config_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        GuardConfig(**options)


def _lora_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from gradleak.models.adapters import AdapterConfig, apply_adapter

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    adapter = AdapterConfig(r=16, alpha=32, target=["attention", "mlp"])
    return apply_adapter(LlamaForCausalLM(cfg).eval(), adapter, "causal_lm", seed=0)


def _lora_gpt2():
    """The GPT-2 arch at a 300-token vocabulary (the real one's 50,257-row head makes each check ~40 s)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from gradleak.models.adapters import AdapterConfig, apply_adapter

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    adapter = AdapterConfig(r=16, alpha=32, target=["attention", "mlp"])
    return apply_adapter(GPT2LMHeadModel(cfg).eval(), adapter, "causal_lm", seed=0)


@pytest.mark.parametrize("build", [_lora_llama, _lora_gpt2], ids=["llama", "gpt2_conv1d"])
def test_honest_lora_models_pass_and_peftleaks_planted_model_is_refused(build):
    """peft starts every adapter's B at zero, and a trained B's rows lie in its batches' few directions: the
    checks leave B out of parallel / balance / drift and out of degenerate while it is all zero (else every
    fresh LoRA model was refused, as it was), and read A and the frozen layers, HF's Conv1D (GPT-2) among
    them, which the guard did not read before. A fresh model and the same after five SGD steps on the
    adapters pass; peftleak_lora's planted model is refused for its bins (parallel gate rows) and zeroed
    attention outputs. Tiny random models (on SmolLM2's real weights the checks are not calibrated:
    docs/security.md)."""
    model = build()
    vocab = model.get_input_embeddings().num_embeddings
    probe = torch.randint(0, vocab, (8, 12), generator=torch.Generator().manual_seed(0))
    guard = ModelGuard(model, trusted_start=True)
    assert guard.inspect(model.state_dict(), probe).safe
    trained = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in trained.parameters() if p.requires_grad], lr=0.05)
    for step in range(5):
        opt.zero_grad()
        trained(input_ids=probe[step % 2 :: 2], labels=probe[step % 2 :: 2]).loss.backward()
        opt.step()
    assert any(bool(p.any()) for n, p in trained.named_parameters() if ".lora_B." in n)
    verdict = guard.inspect(trained.state_dict(), probe)
    assert verdict.safe, verdict.reason()
    # a FedAvg of equal frozen arrays may round (Flower averages in float64): no rewrite
    rounded = {k: v * (1 + 1e-7) if v.is_floating_point() else v for k, v in trained.state_dict().items()}
    verdict = guard.inspect(rounded, probe)
    assert verdict.safe, verdict.reason()
    planted, _ = create_attack("peftleak_lora").prepare(
        model, None, generator=torch.Generator().manual_seed(0)
    )
    verdict = guard.inspect(planted.state_dict(), probe, remember=False)
    checks = {f.check for f in verdict.findings}
    assert not verdict.safe and {"parallel", "degenerate", "drift"} <= checks, verdict.reason()
    assert any(".mlp." in f.where for f in verdict.findings if f.check == "parallel")


def test_bins_written_through_the_adapters_themselves_are_refused():
    """A server that leaves every frozen layer honest and writes the bins through the adapters: the gate's
    A rows one direction (scaled), its B a per-unit gain, the output projection's adapters one shared
    column. The adapters' A is read: its parallel rows give it away."""
    model = _lora_llama()
    probe = torch.randint(0, 300, (8, 12), generator=torch.Generator().manual_seed(0))
    guard = ModelGuard(model, trusted_start=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    a = torch.randn(64, generator=torch.Generator().manual_seed(1))
    for key, value in state.items():
        if "gate_proj.lora_A" in key:
            value[:] = 1e3 * a
        if "gate_proj.lora_B" in key:
            value.zero_()
            value[:16, :16] = torch.diag(torch.linspace(0.5, 2, 16))
        if "down_proj.lora_A" in key:
            value.zero_()
            value[:, :16] = torch.eye(16)
        if "down_proj.lora_B" in key:
            value[:] = torch.randn(64, 1, generator=torch.Generator().manual_seed(2))
    verdict = guard.inspect(state, probe, remember=False)
    assert not verdict.safe
    assert any("gate_proj.lora_A" in f.where for f in verdict.findings if f.check == "parallel"), (
        verdict.reason()
    )


def test_bins_written_through_an_adapters_b_alone_are_read_in_the_merged_map():
    """A server that leaves every linear layer's own weights and every A as they were and writes the bins
    through the MLP gate's LoRA B alone (one large gain along A's first row, a per-unit cut along its
    second, each unit read out by its own rank), its pass-through through block 0's norm: the merged map
    ``W + s B A`` shows the bins' near-parallel rows, and the norm that moved is a frozen parameter."""
    model = _lora_gpt2()
    probe = torch.randint(0, 300, (8, 12), generator=torch.Generator().manual_seed(0))
    guard = ModelGuard(model, trusted_start=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    prefix = "base_model.model.transformer.h.0."
    state[prefix + "ln_1.weight"].zero_()  # block 0's attention reads nothing
    b = torch.full_like(state[prefix + "mlp.c_fc.lora_B.default.weight"], 1e-30)  # no zero rows
    for unit in range(14):
        b[unit, 0], b[unit, 1], b[unit, 2 + unit] = 1e3, 10.0 * (unit - 7), 1e-2
    state[prefix + "mlp.c_fc.lora_B.default.weight"] = b
    verdict = guard.inspect(state, probe, remember=False)
    where = {(f.check, f.where) for f in verdict.findings}
    assert ("parallel", prefix + "mlp.c_fc") in where, verdict.reason()
    assert ("frozen", prefix + "ln_1.weight") in where, verdict.reason()
    bare = ModelGuard(model)  # without a reference the merged map alone refuses it
    assert not bare.inspect(state, probe, remember=False).safe


def test_a_conv1d_is_read_out_by_in_as_it_computes():
    """HF's Conv1D stores (in, out): the guard's view must be the map it computes, F.linear(x, W) + b."""
    model = _lora_gpt2()
    from gradleak.defenses.guard import linear_maps

    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    checked = 0
    for layer in linear_maps(model):
        if layer.adapter is None and layer.module.__class__.__name__ == "Conv1D":
            expected = layer.module(x) if layer.weight.shape[1] == 64 else None
            if expected is not None:
                got = torch.nn.functional.linear(x, layer.weight, layer.bias)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
                checked += 1
    assert checked >= 4  # c_attn and c_fc of both blocks


def test_the_frozen_check_allows_a_few_ulps_of_any_dtype_and_odd_lora_layers_do_not_break_the_guard():
    """FedAvg of equal frozen arrays rounds by a few units in the last place of their dtype (float16: 1e-3
    relative), which is no rewrite; a LoRA embedding (peft's, not a linear map) and a model that is itself
    one nn.Linear are read without error."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    model = _lora_gpt2().to(torch.float16)
    probe = torch.randint(0, 300, (8, 12), generator=torch.Generator().manual_seed(0))
    guard = ModelGuard(model, trusted_start=True)
    state = {k: v * (1 + 2e-3) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    assert {f.check for f in guard.inspect(state, probe, remember=False).findings} == set()
    rewritten = dict(state)
    key = "base_model.model.transformer.h.0.ln_2.weight"
    rewritten[key] = rewritten[key] * 1.1  # 10 %: about 100 ulps of float16, a rewrite
    assert {f.check for f in guard.inspect(rewritten, probe, remember=False).findings} == {"frozen"}

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=64, n_layer=1, n_head=4, n_positions=64))
    embedded = get_peft_model(gpt2, LoraConfig(r=4, target_modules=["c_attn", "wte"], fan_in_fan_out=True))
    assert ModelGuard(embedded, trusted_start=True).inspect(embedded.state_dict(), probe).safe
    linear = torch.nn.Linear(20, 5)
    assert ModelGuard(linear, trusted_start=True).inspect(linear.state_dict(), torch.randn(8, 20)).safe


def test_an_honest_bottleneck_model_trained_with_adam_passes_and_bins_in_its_adapter_are_refused():
    """A bottleneck adapter starts at N(0, 0.01^2) and moves by 0.65-0.78 of its size in ten Adam steps at
    lr 1e-3 (the review's measurement): the drift check leaves its layers out (as LoRA's B) and the model
    passes; the other checks still read them: Robbing the Fed's bins written into the first adapter's down
    projection (every row the same direction) are refused as parallel rows."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from gradleak.models.adapters import AdapterConfig, apply_adapter

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = apply_adapter(GPT2LMHeadModel(cfg).eval(), AdapterConfig(kind="bottleneck", r=16), "causal_lm", 0)
    probe = torch.randint(0, 300, (8, 12), generator=torch.Generator().manual_seed(0))
    guard = ModelGuard(model, trusted_start=True)
    trained = copy.deepcopy(model)
    opt = torch.optim.Adam([p for p in trained.parameters() if p.requires_grad], lr=1e-3)
    for step in range(10):
        opt.zero_grad()
        trained(input_ids=probe[step % 2 :: 2], labels=probe[step % 2 :: 2]).loss.backward()
        opt.step()
    moved = relative_change(
        model.transformer.h[0].bottleneck.down.weight, trained.transformer.h[0].bottleneck.down.weight
    )
    assert moved > GuardConfig().max_drift  # what the drift check would have called a rewrite
    verdict = guard.inspect(trained.state_dict(), probe)
    assert verdict.safe, verdict.reason()
    state = trained.state_dict()
    key = "transformer.h.0.bottleneck.down.weight"
    direction = torch.randn(64, generator=torch.Generator().manual_seed(1))
    state[key] = direction.expand_as(state[key]).clone()
    state["transformer.h.0.bottleneck.down.bias"] = -torch.linspace(-1, 1, 16)
    verdict = guard.inspect(state, probe, remember=False)
    assert not verdict.safe and any(
        f.check == "parallel" and "bottleneck.down" in f.where for f in verdict.findings
    ), verdict.reason()
