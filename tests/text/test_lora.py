"""LoRA adapters through the one engine (gradleak/models/adapters.py, issue 52 item 1): an adapter
update holds exactly the trainable parameters, peft's zero-initialised B makes the first gradient of A
vanish, the base stays bit-identical through FedAvg rounds while the adapters move, and bad adapter configs
are refused."""

from __future__ import annotations

import json
import re

import pytest
import torch

from gradleak.data.text import TextDataset, TokenDataset
from gradleak.experiments import load_config, run_experiment
from gradleak.experiments.config import ConfigError
from gradleak.models.adapters import AdapterConfig, apply_adapter, target_modules
from gradleak.models.families import FAMILIES
from gradleak.models.text import build_bert_tiny, build_gpt2
from gradleak.tasks import CausalLM, TextClassification
from gradleak.tasks.client import train_client
from gradleak.types import LocalTraining
from gradleak.validation import trainable_of

TEXTS = ("the movie was surprisingly good", "a dull and lifeless film .", "an honest , moving story",
         "nothing works here")  # fmt: skip


def tokens(tm) -> TokenDataset:
    return TokenDataset.from_texts(
        TextDataset("t", TEXTS, (1, 0, 1, 0), ("neg", "pos")), tm.tokenizer, max_tokens=12
    )


@pytest.mark.parametrize(
    ("build", "task", "target", "head"),
    [
        (lambda: build_gpt2("tiny", "causal_lm", seed=0), "causal_lm", ["attention"], None),
        (
            lambda: build_gpt2("tiny", "classification", seed=0),
            "classification",
            ["attention", "mlp"],
            "score",
        ),
        (lambda: build_bert_tiny(seed=0), "classification", ["attention"], "classifier"),
    ],
    ids=["gpt2_lm_attention", "gpt2_cls_both", "bert_cls_attention"],
)
def test_an_adapter_update_holds_exactly_the_trainable_parameters(build, task, target, head):
    tm = build()
    family = FAMILIES.create(tm.family)
    layers = target_modules(tm.model, family, target)
    config = AdapterConfig(r=4, alpha=8, target=target)
    model = apply_adapter(tm.model, config, task, seed=0)
    trainable = trainable_of(model)
    # two matrices per adapted layer (A: r x in, B: out x r), and the head's copy where the task trains one
    lora = {n for n in trainable if ".lora_" in n}
    assert len(lora) == 2 * len(layers) and layers
    for name in lora:
        assert re.search(r"\.lora_(A|B)\.default\.weight$", name), name
        rank_dim = 0 if ".lora_A." in name else 1
        assert trainable[name].shape[rank_dim] == 4
    others = set(trainable) - lora
    assert (
        (others == set())
        if head is None
        else (others and all(f"{head}.modules_to_save" in n for n in others))
    )
    task_obj = CausalLM() if task == "causal_lm" else TextClassification()
    result = train_client(0, model, tokens(tm), LocalTraining("fedsgd", batch_size=4), [],
                          torch.Generator().manual_seed(0), task=task_obj)  # fmt: skip
    assert result.update is not None, result.error
    assert {n: t.shape for n, t in result.update.tensors.items()} == {
        n: p.shape for n, p in trainable.items()
    }
    # peft starts B at zero: the first gradient of every A is exactly zero, of B not (DAGER's LoRA note)
    a_grads = [t for n, t in result.update.tensors.items() if ".lora_A." in n]
    b_grads = [t for n, t in result.update.tensors.items() if ".lora_B." in n]
    assert all(bool((g == 0).all()) for g in a_grads) and any(float(g.abs().sum()) > 0 for g in b_grads)


def test_fedavg_rounds_move_the_adapters_and_keep_the_base_bit_identical():
    raw = {
        "experiment": {"name": "lora", "seed": 0},
        "data": {"dataset": "rotten_tomatoes", "train_split": "all", "test_split": "all", "train_limit": 40,
                 "test_limit": 8, "num_clients": 4, "partition": "iid"},
        "model": {"name": "gpt2_tiny", "adapter": {"r": 4, "alpha": 8}},
        "fl": {"rounds": 2, "fraction": 0.5,
               "training": {"protocol": "fedavg", "epochs": 1, "batch_size": 4, "lr": 0.05}},
        "audit": {"clients": 0},
    }  # fmt: skip
    from gradleak.experiments.runner import build_simulation

    sim = build_simulation(load_config(raw, []))
    before = {n: p.detach().clone() for n, p in sim.model.named_parameters()}
    sim.run(2)
    after = dict(sim.model.named_parameters())
    frozen = [n for n in before if ".lora_" not in n]
    assert frozen and all(torch.equal(before[n], after[n]) for n in frozen)
    moved = [n for n in before if ".lora_B." in n and not torch.equal(before[n], after[n])]
    assert moved, "no adapter moved in two FedAvg rounds"
    rounds = run_experiment(load_config(raw, [])).of_kind("round")
    assert len(rounds) == 2 and all(len(r["clients"]) == 2 for r in rounds)


@pytest.mark.parametrize(
    ("adapter", "message"),
    [({"r": 0}, "r must be an int >= 1"), ({"target": ["embedding"]}, "adapter target"),
     ({"alpha": 0.5}, "alpha"), ({"kind": "prefix"}, "adapter kind"), ({"dropout": 1.0}, "dropout")],
)  # fmt: skip
def test_bad_adapters_are_refused_on_construction(adapter, message):
    from gradleak.cli.demo import demo_config_path

    with pytest.raises(ConfigError, match=message):
        load_config(demo_config_path(), [f"model.adapter={_toml(adapter)}"])


def _toml(table: dict) -> str:
    """An inline TOML table (JSON's numbers, strings and arrays are TOML's)."""
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + "}"


@pytest.mark.parametrize(
    ("adapter", "field"),
    [({"r": 4, "alpha": 8, "target": ["attention", "mlp"]}, '"alpha": 8'),
     ({"kind": "bottleneck", "r": 8, "residual": False}, '"residual": false')],
    ids=["lora", "bottleneck"],
)  # fmt: skip
def test_an_adapter_model_travels_as_a_spec_and_rebuilds_with_its_adapter(adapter, field):
    """What a Flower node builds from the server's spec: the same peft wrapper or bottleneck adapters
    (names, shapes, which parameters train), into which the sent weights load strictly."""
    from gradleak.experiments.runner import build_simulation
    from gradleak.models.architecture import build, describe

    raw = {
        "experiment": {"name": "adapter", "seed": 3},
        "data": {"dataset": "rotten_tomatoes", "train_split": "all", "test_split": "all", "train_limit": 40,
                 "test_limit": 8, "num_clients": 4, "partition": "iid"},
        "model": {"name": "gpt2_tiny", "adapter": adapter},
        "audit": {"clients": 0},
    }  # fmt: skip
    model = build_simulation(load_config(raw, [])).model
    rebuilt = build(describe(model))
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    assert {n: (p.shape, p.requires_grad) for n, p in rebuilt.named_parameters()} == {
        n: (p.shape, p.requires_grad) for n, p in model.named_parameters()
    }
    x = torch.tensor([[464, 2646, 373, 1049, 1257]])
    torch.testing.assert_close(rebuilt(input_ids=x).logits, model(input_ids=x).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown option"):  # a spec's adapter is validated, not trusted
        bad = describe(model).replace(field, field + ', "exec": "x"')
        build(bad)


def test_adapters_need_a_text_data_set():
    from gradleak.cli.demo import demo_config_path

    with pytest.raises(
        ConfigError, match="model.adapter works on text tasks, but data.dataset = 'organamnist'"
    ):
        load_config(demo_config_path(), ["model.adapter={r = 4}"])


# ------------------------------------------------------------------------------------ DAGER on LoRA updates
def _trained_adapter_update(r: int, task: str = "classification", train_b: bool = True):
    """A FedSGD update of a GPT-2 arch adapter whose B has trained (random small entries: a later round)."""
    from gradleak.models.text import build_gpt2

    tm = build_gpt2("tiny", task, seed=0)
    model = apply_adapter(tm.model, AdapterConfig(r=r, alpha=2 * r, target=["attention"]), task, seed=0)
    if train_b:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))
    data = TokenDataset.from_texts(
        TextDataset("t", TEXTS[:2], (1, 0), ("neg", "pos")), tm.tokenizer, max_tokens=12
    )
    task_obj = CausalLM() if task == "causal_lm" else TextClassification()
    result = train_client(0, model, data, LocalTraining("fedsgd", batch_size=2), [],
                          torch.Generator().manual_seed(0), task=task_obj)  # fmt: skip
    assert result.update is not None, result.error
    return model, result.update, data.batch().sequences()


def test_dager_lora_recovers_a_batch_from_the_adapters_a_gradients():
    """r = 16 above the batch's 11 distinct (token, position) pairs and B trained: both sentences exactly; a
    norm-matched random update in its place recovers nothing."""
    from gradleak.attacks import create_attack
    from gradleak.attacks.text.baseline import null_observation
    from gradleak.types import Observation

    model, update, truth = _trained_adapter_update(16)
    obs = Observation(model, update, (12,), 2)
    rec = create_attack("dager_lora").reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert sorted(rec.token_ids) == sorted(truth) and rec.stats["rank_l1"] == 11
    null = create_attack("dager_lora").reconstruct(
        null_observation(obs, torch.Generator().manual_seed(1)), generator=torch.Generator().manual_seed(0)
    )
    assert null.token_ids == []


def test_dager_lora_reads_a_fresh_adapter_through_its_b_gradient():
    """B = 0 (a fresh adapter's first step): dL/dA vanishes, and side B tests each candidate's projection
    A z against the span of (dL/dB)^T in r = 16 dimensions: both sentences exactly, nothing from noise;
    side A forced on it is refused, saying why."""
    from gradleak.attacks import create_attack
    from gradleak.attacks.text.baseline import null_observation
    from gradleak.types import AttackInputError, Observation

    model, update, truth = _trained_adapter_update(16, train_b=False)
    obs = Observation(model, update, (12,), 2)
    rec = create_attack("dager_lora").reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert rec.stats["side_b"] == 1.0 and sorted(rec.token_ids) == sorted(truth)
    null = create_attack("dager_lora", side="B").reconstruct(
        null_observation(obs, torch.Generator().manual_seed(1)), generator=torch.Generator().manual_seed(0)
    )
    assert null.token_ids == []
    with pytest.raises(AttackInputError, match="side A with B still zero"):
        create_attack("dager_lora", side="A").reconstruct(obs, generator=torch.Generator())


def test_dager_lora_states_its_rank_limit():
    from gradleak.attacks import create_attack
    from gradleak.types import Observation

    model, update, _ = _trained_adapter_update(8)  # r below the 11 token positions: the span is capped at r
    rec = create_attack("dager_lora").reconstruct(
        Observation(model, update, (12,), 2), generator=torch.Generator()
    )
    assert rec.stats["rank_l1"] == 8 and rec.stats["side_b"] == 0.0  # side B is full too: A is read


@pytest.mark.parametrize("train_b", [True, False], ids=["trained_b", "fresh_adapter"])
def test_dager_lora_on_a_causal_lm_recovers_whole_sentences_with_their_last_tokens(train_b):
    """The span search stops one token short (a last token is only a label); the adapters' gradient still
    holds the labels (lora_completion, opt-in): with the completion both sentences come back whole,
    without it (the default) every token but the last, and the completion alone on the true prefixes of a
    norm-matched random update does not reproduce the true last tokens."""
    from gradleak.attacks import create_attack
    from gradleak.attacks.text.baseline import null_observation
    from gradleak.attacks.text.dager.lora_completion import complete_from_adapters
    from gradleak.types import Observation

    model, update, truth = _trained_adapter_update(16, task="causal_lm", train_b=train_b)
    obs = Observation(model, update, (12,), 2)
    whole = create_attack("dager_lora", complete_from_adapters=True).reconstruct(
        obs, generator=torch.Generator()
    )
    assert sorted(whole.token_ids) == sorted(truth)
    cut = create_attack("dager_lora").reconstruct(obs, generator=torch.Generator())  # off by default
    assert sorted(cut.token_ids) == sorted(s[:-1] for s in truth)
    prefixes = [s[:-1] for s in truth]
    null = null_observation(obs, torch.Generator().manual_seed(0))
    guessed = complete_from_adapters(null, model, prefixes)
    assert [s[-1] for s in guessed] != [s[-1] for s in truth]


def _fedavg_adapter_update(
    r: int, n: int, epochs: int, lr: float, train_b: bool = True, b_scale: float = 0.02
):
    """A FedAvg delta of a GPT-2 arch classification adapter over ``n`` sentences in batches of 2 (B drawn
    at ``b_scale`` when ``train_b``)."""
    tm = build_gpt2("tiny", "classification", seed=0)
    model = apply_adapter(tm.model, AdapterConfig(r=r, alpha=2 * r, target=["attention"]), "classification",
                          seed=0)  # fmt: skip
    if train_b:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(b_scale * torch.randn(p.shape, generator=g))
    data = TokenDataset.from_texts(
        TextDataset("t", TEXTS[:n], (1, 0, 1, 0)[:n], ("neg", "pos")), tm.tokenizer, max_tokens=12
    )
    training = LocalTraining("fedavg", epochs=epochs, batch_size=2, lr=lr)
    result = train_client(0, model, data, training, [], torch.Generator().manual_seed(0),
                          task=TextClassification())  # fmt: skip
    assert result.update is not None and result.update.kind == "delta", result.error
    assert result.update.metadata["local_steps"] == epochs * -(-n // 2)
    return model, result.update, training, data.batch().sequences()


@pytest.mark.parametrize(("n", "epochs"), [(2, 3), (4, 1)], ids=["one_batch_3_steps", "two_batches_2_steps"])
def test_dager_lora_fedavg_recovers_every_sentence_of_a_few_small_local_steps(n, epochs):
    """FedAvg at lr 1e-2 (B trained, r = 16 / 32 above the block-1 rank of 11 / 19): block 1's inputs do
    not move under LoRA (the embeddings are frozen), block 2's do, read at the midpoint weights: every
    sentence exactly; a norm-matched random delta in its place gives nothing."""
    from gradleak.attacks import create_attack
    from gradleak.attacks.text.baseline import null_observation
    from gradleak.types import Observation

    model, update, training, truth = _fedavg_adapter_update(16 if n == 2 else 32, n, epochs, 1e-2)
    obs = Observation(model, update, (12,), 2, training=training)
    rec = create_attack("dager_lora_fedavg").reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert sorted(rec.token_ids) == sorted(truth)
    assert rec.stats["rank_l1"] == (11 if n == 2 else 19) and rec.stats["side_b"] == 0.0
    null = create_attack("dager_lora_fedavg").reconstruct(
        null_observation(obs, torch.Generator().manual_seed(1)), generator=torch.Generator().manual_seed(0)
    )
    assert null.token_ids == []


def test_a_saturated_side_a_falls_back_to_side_b():
    """B trained but tiny (1e-5, an adapter one round old at a small lr): the delta's A part is mostly float32
    cancellation and its span fills all r = 16 dimensions, so side A would find nothing; the rule reads
    side B, which recovers every sentence (one with a token too many)."""
    from gradleak.attacks import create_attack
    from gradleak.attacks.text.family import estimate_span, family_of
    from gradleak.types import Observation

    model, update, training, truth = _fedavg_adapter_update(16, 2, 1, 1e-2, b_scale=1e-5)
    a = next(k for k in update.tensors if ".lora_A." in k and ".h.0." in k)
    assert estimate_span(update.tensors[a].T, family_of(model).rank_tol).rank == 16  # side A saturated
    rec = create_attack("dager_lora_fedavg").reconstruct(
        Observation(model, update, (12,), 2, training=training), generator=torch.Generator()
    )
    assert rec.stats["side_b"] == 1.0 and len(rec.token_ids) == len(truth)
    for (
        t
    ) in truth:  # every sentence whole, in order; the relaxed L2 test may accept one token more (measured:
        # one sentence exact, the other with its "." repeated)
        assert any(r[: len(t)] == t and len(r) - len(t) <= 1 for r in rec.token_ids), (t, rec.token_ids)


def test_a_fresh_adapters_fedavg_delta_is_read_on_side_b():
    """peft's B = 0 in the broadcast model: after the first step B moves, so the delta's A part is nonzero,
    but only through a B a few small steps old; the side rule reads the broadcast model and takes B."""
    from gradleak.attacks import create_attack
    from gradleak.types import Observation

    model, update, training, _ = _fedavg_adapter_update(16, 2, 3, 1e-2, train_b=False)
    a = [k for k in update.tensors if ".lora_A." in k]
    assert a and max(float(update.tensors[k].abs().max()) for k in a) > 0  # A moved after step 1
    rec = create_attack("dager_lora_fedavg").reconstruct(
        Observation(model, update, (12,), 2, training=training), generator=torch.Generator()
    )
    assert rec.stats["side_b"] == 1.0


def test_an_adapter_that_is_not_a_table_is_refused():
    from gradleak.cli.demo import demo_config_path

    with pytest.raises(ConfigError, match="model.adapter must be a table, got str 'lora'"):
        load_config(demo_config_path(), ["model.adapter='lora'"])


@pytest.mark.parametrize(
    ("adapter", "param"),
    [({"r": 4, "alpha": 8}, "lora_A"), ({"kind": "bottleneck", "r": 8}, "bottleneck")],
    ids=["lora", "bottleneck"],
)
def test_aegis_llm_is_refused_on_an_adapter_model_at_config_time_and_in_setup(adapter, param):
    """AEGIS's channels are defined on full fine-tuning: on a model that trains adapters only (LoRA, or
    bottleneck adapters), a config naming it is refused before any work, and a user loop that applies it to
    such a model fails closed in setup with the reason (the adapters' gradients have no AEGIS rule), not with
    "no attention projection"."""
    from gradleak.defenses.base import DefenseFailure
    from gradleak.defenses.in_loop import defend

    raw = {
        "experiment": {"name": "lora", "seed": 0},
        "data": {"dataset": "rotten_tomatoes", "train_split": "all", "test_split": "all", "train_limit": 40,
                 "test_limit": 8, "num_clients": 4, "partition": "iid"},
        "model": {"name": "gpt2_tiny", "adapter": adapter},
        "audit": {"clients": 0},
        "grid": {"defenses": ["none", "update_noise", "aegis_2ch"]},
    }  # fmt: skip
    with pytest.raises(ConfigError, match=r"grid.defenses\[2\] 'aegis_2ch' is defined on full fine-tuning"):
        load_config(raw, [])
    raw["grid"]["defenses"] = ["none", "update_noise", "pruning"]  # type: ignore[index]
    load_config(raw, [])  # the defenses that mean something on adapters pass
    tm = build_gpt2("tiny", "causal_lm", seed=0)
    model = apply_adapter(tm.model, AdapterConfig(**adapter), "causal_lm", seed=0)
    with pytest.raises(DefenseFailure, match=f"{param}.*no AEGIS rule"):
        defend(model, None, ["aegis_llm"], generator=torch.Generator().manual_seed(0))
