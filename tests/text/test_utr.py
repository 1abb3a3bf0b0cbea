"""Bottleneck adapters (gradleak/models/adapters.py) and UTR on them (gradleak/attacks/text/utr.py, issue 52):
the adapter computes what its docstring says on every block's input, an update holds exactly the adapters
(and a classifier's head), and UTR reads a seeded batch back exactly where its
rank allows and nothing from a null update."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from gradleak.attacks import create_attack
from gradleak.attacks.text.baseline import null_observation
from gradleak.data.text import TextDataset, TokenDataset
from gradleak.models.adapters import AdapterConfig, apply_adapter
from gradleak.models.families import FAMILIES
from gradleak.models.text import build_bert_tiny, build_gpt2
from gradleak.tasks import CausalLM, TextClassification
from gradleak.tasks.client import train_client
from gradleak.types import AttackInputError, LocalTraining, Observation
from gradleak.validation import trainable_of

TEXTS = ("the movie was surprisingly good", "a dull and lifeless film .", "an honest , moving story",
         "nothing works here")  # fmt: skip
BUILDS = {
    "gpt2_cls": (lambda: build_gpt2("tiny", "classification", seed=0), "classification", "score"),
    "gpt2_lm": (lambda: build_gpt2("tiny", "causal_lm", seed=0), "causal_lm", None),
    "bert_cls": (lambda: build_bert_tiny(seed=0), "classification", "classifier"),
}


def _adapted(key: str, r: int = 32, residual: bool = True):
    build, task, head = BUILDS[key]
    tm = build()
    model = apply_adapter(tm.model, AdapterConfig(kind="bottleneck", r=r, residual=residual), task, seed=0)
    return tm, model, task, head


def _update(key: str, r: int = 32, residual: bool = True, texts: tuple[str, ...] = TEXTS):
    tm, model, task, _ = _adapted(key, r, residual)
    data = TokenDataset.from_texts(
        TextDataset("t", texts, tuple(i % 2 for i in range(len(texts))), ("neg", "pos")), tm.tokenizer,
        max_tokens=12,
    )  # fmt: skip
    result = train_client(0, model, data, LocalTraining("fedsgd", batch_size=len(texts)), [],
                          torch.Generator().manual_seed(0),
                          task=CausalLM() if task == "causal_lm" else TextClassification())  # fmt: skip
    assert result.update is not None, result.error
    return model, result.update, data.batch().sequences()


@pytest.mark.parametrize("key", sorted(BUILDS))
def test_an_update_holds_exactly_the_adapters_and_a_classifiers_head(key):
    tm, model, task, head = _adapted(key, r=8)
    family = FAMILIES.create(tm.family)
    width = model.config.hidden_size
    blocks = [n for n, _ in model.named_modules() if __import__("re").search(family.block_pattern, n)]
    expected = {f"{b}.bottleneck.{p}": s for b in blocks for p, s in
                (("down.weight", (8, width)), ("down.bias", (8,)), ("up.weight", (width, 8)),
                 ("up.bias", (width,)))}  # fmt: skip
    if head is not None:
        expected |= {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith(head + ".")}
    assert len(blocks) == 2 and {n: tuple(p.shape) for n, p in trainable_of(model).items()} == expected
    model, update, _ = _update(key, r=8)
    assert set(update.tensors) == set(expected)


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "utr_official"])
def test_each_block_input_goes_through_the_adapters_formula_also_in_a_deep_copy(residual):
    """The adapted model against the bare model whose blocks' inputs a hand-written pre-hook maps by
    ``x + W_up relu(W_down x + b_down) + b_up`` (or UTR's ``relu(...)``); a deep copy whose adapter is
    changed hooks its own adapter, not the original's."""
    tm, model, _, _ = _adapted("gpt2_lm", r=8, residual=residual)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".bottleneck." in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    ids = torch.tensor([[464, 3807, 373, 922, 13]])
    got = model(input_ids=ids).logits

    def reference(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        bare = build_gpt2("tiny", "causal_lm", seed=0).model
        for i, block in enumerate(bare.transformer.h):
            w = {k: weights[f"transformer.h.{i}.bottleneck.{k}"] for k in
                 ("down.weight", "down.bias", "up.weight", "up.bias")}  # fmt: skip

            def hook(_m, args, kw, w=w):
                x = args[0]
                h = torch.relu(x @ w["down.weight"].T + w["down.bias"]) @ w["up.weight"].T + w["up.bias"]
                return (x + h if residual else torch.relu(h), *args[1:]), kw

            block.register_forward_pre_hook(hook, with_kwargs=True)
        return bare(input_ids=ids).logits

    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.testing.assert_close(got, reference(weights), rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.transformer.h[0].bottleneck.down.weight.mul_(2.0)
    torch.testing.assert_close(model(input_ids=ids).logits, got, rtol=0, atol=0)
    twin_weights = {n: p.detach().clone() for n, p in twin.named_parameters()}
    torch.testing.assert_close(twin(input_ids=ids).logits, reference(twin_weights), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(twin(input_ids=ids).logits, got)


@pytest.mark.parametrize(
    ("adapter", "message"),
    [({"kind": "bottleneck", "target": ["mlp"]}, "takes no target"),
     ({"kind": "lora", "residual": False}, "bottleneck adapter's option"),
     ({"kind": "bottleneck", "residual": "no"}, "residual must be true or false")],
)  # fmt: skip
def test_bad_bottleneck_configs_are_refused_on_construction(adapter, message):
    with pytest.raises(ValueError, match=message):
        AdapterConfig(**adapter)


# ------------------------------------------------------------------------------------------------- UTR
@pytest.mark.parametrize(
    ("key", "residual", "r"),
    [("gpt2_cls", True, 32), ("gpt2_cls", False, 64), ("gpt2_lm", True, 32), ("bert_cls", True, 32)],
    ids=["gpt2_cls", "gpt2_cls_utr_official", "gpt2_lm", "bert_cls"],
)
def test_utr_reads_the_batch_back_and_nothing_from_a_null_update(key, residual, r):
    """r above the batch's distinct (token, position) count: every sentence exactly (a causal LM's without
    its last token, only a label there); a norm-matched random update in its place gives nothing. UTR's own
    adapter (non-residual, nn.Linear's initialisation) has units no token activates (15 of 32 here: its
    uniform biases), so it needs the wider r = 64 (18 dead) to hold the batch's 19 inputs."""
    model, update, truth = _update(key, r=r, residual=residual)
    obs = Observation(model, update, (12,), 2)
    rec = create_attack("utr").reconstruct(obs, generator=torch.Generator().manual_seed(0))
    expected = [s[:-1] for s in truth] if key == "gpt2_lm" else truth
    assert sorted(rec.token_ids) == sorted(expected)
    null = create_attack("utr").reconstruct(
        null_observation(obs, torch.Generator().manual_seed(1)), generator=torch.Generator().manual_seed(0)
    )
    assert null.token_ids == []


def test_utr_stops_where_the_tokens_outnumber_the_adapters_width():
    """r = 8 against 19 distinct (token, position) pairs: the first adapter's span has rank 8 (a subspace of
    the inputs' span), and no sentence passes (the rank limit its docstring states)."""
    model, update, _ = _update("gpt2_cls", r=8)
    rec = create_attack("utr").reconstruct(
        Observation(model, update, (12,), 2), generator=torch.Generator().manual_seed(0)
    )
    assert rec.stats["rank_l1"] == 8 and rec.stats["span_full"] == 1.0 and rec.token_ids == []


def test_utr_refuses_a_model_without_bottleneck_adapters_before_work():
    """A LoRA update: refused by name, before any span is estimated."""
    tm = build_gpt2("tiny", "classification", seed=0)
    model = apply_adapter(tm.model, AdapterConfig(r=4, alpha=8), "classification", seed=0)
    data = TokenDataset.from_texts(
        TextDataset("t", TEXTS[:2], (1, 0), ("n", "p")), tm.tokenizer, max_tokens=12
    )
    result = train_client(0, model, data, LocalTraining("fedsgd", batch_size=2), [],
                          torch.Generator().manual_seed(0), task=TextClassification())  # fmt: skip
    assert result.update is not None
    with pytest.raises(AttackInputError, match="utr reads bottleneck adapters"):
        create_attack("utr").reconstruct(
            Observation(model, result.update, (12,), 2), generator=torch.Generator()
        )


@pytest.mark.parametrize(
    ("protocol", "epochs", "attack"),
    [("fedsgd", 1, "utr"), ("fedavg", 1, "utr_fedavg"), ("fedavg", 3, "utr_fedavg")],
    ids=["fedsgd", "fedavg_1_step", "fedavg_3_steps"],
)
def test_the_engine_trains_bottleneck_adapters_and_utr_reads_them(protocol, epochs, attack):
    """Through run_experiment: FedSGD, and FedAvg of 1 and 3 SGD steps (lr 1e-3) on the batch; every
    audited client's batch back exactly (ROUGE-1 1) above a null floor of 0."""
    from gradleak.experiments import load_config, run_experiment

    training = {"protocol": protocol, "batch_size": 2}
    if protocol == "fedavg":
        training |= {"epochs": epochs, "lr": 1e-3, "optimizer": "sgd"}
    raw = {
        "experiment": {"name": "utr", "seed": 0},
        "data": {"dataset": "rotten_tomatoes", "train_split": "all", "test_split": "all", "train_limit": 40,
                 "test_limit": 8, "num_clients": 4, "partition": "iid", "options": {"max_tokens": 12}},
        "model": {"name": "gpt2_tiny", "task": "classification", "adapter": {"kind": "bottleneck", "r": 32}},
        "fl": {"rounds": 0, "fraction": 0.5},
        "audit": {"clients": 2, "max_samples": 2, "training": training, "attacks": [{"name": attack}]},
    }  # fmt: skip
    records = run_experiment(load_config(raw, [])).of_kind("attack")
    assert len(records) == 2
    for r in records:
        assert r["floor_null_rouge1"] == 0.0 and r["rouge1"] == 1.0, r


def test_utr_spectral_reads_the_batch_through_stated_noise_and_nothing_from_a_null_update():
    """batch_noise of std 1e-7 (stated in the update's metadata) on gradients whose largest entry is about
    2e-3: the spans above the noise's bulk edge hold the batch, and every sentence comes back exactly (exact
    utr finds the rank, 19, but its 1e-3 test keeps no token at any position); a norm-matched random update
    with the same stated noise gives nothing."""
    from gradleak.defenses.baselines import BatchNoise, BatchNoiseConfig

    tm, model, _, _ = _adapted("gpt2_cls")
    data = TokenDataset.from_texts(
        TextDataset("t", TEXTS, (1, 0, 1, 0), ("neg", "pos")), tm.tokenizer, max_tokens=12
    )
    noise = BatchNoise(BatchNoiseConfig(clip=1.0, sigma=1e-7, batch_size=1))
    result = train_client(0, model, data, LocalTraining("fedsgd", batch_size=4), [noise],
                          torch.Generator().manual_seed(0), task=TextClassification())  # fmt: skip
    assert result.update is not None
    obs = Observation(model, result.update, (12,), 2)
    rec = create_attack("utr_spectral").reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert sorted(rec.token_ids) == sorted(data.batch().sequences())
    null = create_attack("utr_spectral").reconstruct(
        null_observation(obs, torch.Generator().manual_seed(1)), generator=torch.Generator().manual_seed(0)
    )
    assert null.token_ids == []


def test_utr_masked_completes_a_pruned_update_and_reads_the_batch():
    """Pruning 50 % of a width-128 adapter's gradients (the GPT-2 arch, d = 64: 8,192 entries each, 4,096
    kept against 1,991 degrees of freedom at the batch's rank 11): the completion finds rank 11 at both
    blocks and both sentences come back exactly; a norm-matched random update with the same zeros gives
    nothing."""
    from gradleak.defenses.pruning import Pruning, PruningConfig

    tm, model, _, _ = _adapted("gpt2_cls", r=128)
    data = TokenDataset.from_texts(
        TextDataset("t", TEXTS[:2], (1, 0), ("neg", "pos")), tm.tokenizer, max_tokens=12
    )
    result = train_client(0, model, data, LocalTraining("fedsgd", batch_size=2),
                          [Pruning(PruningConfig(ratio=0.5))], torch.Generator().manual_seed(0),
                          task=TextClassification())  # fmt: skip
    assert result.update is not None
    obs = Observation(model, result.update, (12,), 2)
    rec = create_attack("utr_masked").reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert rec.stats["completion_rank_l1"] == rec.stats["completion_rank_l2"] == 11
    assert sorted(rec.token_ids) == sorted(data.batch().sequences())
    noise = null_observation(obs, torch.Generator().manual_seed(1))
    masked = {n: torch.where(obs.update.tensors[n] == 0, 0.0, t) for n, t in noise.update.tensors.items()}
    null = create_attack("utr_masked").reconstruct(
        dataclasses.replace(noise, update=dataclasses.replace(noise.update, tensors=masked)),
        generator=torch.Generator().manual_seed(0),
    )
    assert null.token_ids == []


def test_units_no_token_activates_are_not_read_as_pruned_entries():
    """One 3-token sentence leaves some of a width-32 adapter's units off for every token (zero gradient
    rows, 12-19 % of the entries here): utr_masked reads the unpruned update on exact DAGER's path (nothing
    counted as dropped) and gets the sentence back."""
    model, update, truth = _update("gpt2_cls", texts=("nothing works here",))
    down = update.tensors["transformer.h.0.bottleneck.down.weight"]
    assert bool((down.abs().amax(dim=1) == 0).any())  # the case: dead units
    rec = create_attack("utr_masked").reconstruct(
        Observation(model, update, (12,), 2), generator=torch.Generator().manual_seed(0)
    )
    assert rec.stats["kept_l1"] == rec.stats["kept_l2"] == 1.0 and rec.token_ids == truth


def test_a_tied_head_a_second_adapter_and_a_block_without_hidden_states_are_refused():
    tm = build_gpt2("tiny", "causal_lm", seed=0)
    with pytest.raises(ValueError, match="tied to the input embedding"):
        apply_adapter(tm.model, AdapterConfig(kind="bottleneck", r=8, train_head=True), "causal_lm", seed=0)
    model = apply_adapter(tm.model, AdapterConfig(kind="bottleneck", r=8), "causal_lm", seed=0)
    with pytest.raises(ValueError, match="bottleneck adapters already"):
        apply_adapter(model, AdapterConfig(kind="bottleneck", r=8), "causal_lm", seed=0)
    adapter = model.transformer.h[0].bottleneck
    x = torch.randn(1, 3, model.config.hidden_size)
    args, kwargs = adapter.pre_hook(model.transformer.h[0], (), {"hidden_states": x, "use_cache": False})
    torch.testing.assert_close(kwargs["hidden_states"], adapter(x))
    assert args == () and kwargs["use_cache"] is False
    with pytest.raises(TypeError, match="reads its block's hidden states"):
        adapter.pre_hook(model.transformer.h[0], (), {"use_cache": False})
