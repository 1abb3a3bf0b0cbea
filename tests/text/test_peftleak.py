"""PEFTLeak's malicious server on LoRA language models (gradleak/attacks/text/peftleak.py, issue 52 item 2):
the attack reads exactly the tokens that a bin holds alone, checked against a reference that finds those
bins from the client's own forward pass (the gating projection's pre-activations on the batch), on the
GPT-2 arch (learned positions, biased gate) and a tiny Llama (rotary, no bias, SwiGLU); FedAvg keeps it
exact; a norm-matched random update gives nothing; what it cannot attack is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradleak.attacks import create_attack
from gradleak.attacks.text.baseline import null_observation
from gradleak.attacks.text.family import family_of, find_module
from gradleak.data.text import TextBatch, TextDataset, TokenDataset
from gradleak.models.adapters import AdapterConfig, apply_adapter
from gradleak.models.text import build_bert_tiny, build_gpt2
from gradleak.tasks import CausalLM
from gradleak.tasks.client import train_client
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import AttackInputError, LocalTraining, Observation

TEXTS = ("the movie was surprisingly good", "a dull and lifeless film .", "an honest , moving story",
         "nothing works here")  # fmt: skip


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _gpt2(r: int, target: list[str] | None = None) -> tuple[nn.Module, object]:
    tm = build_gpt2("tiny", "causal_lm", seed=0)
    model = apply_adapter(tm.model, AdapterConfig(r=r, alpha=2 * r, target=target or ["attention", "mlp"]),
                          "causal_lm", seed=0)  # fmt: skip
    return model, tm.tokenizer


def _llama(r: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    return apply_adapter(LlamaForCausalLM(cfg).eval(), AdapterConfig(r=r, alpha=2 * r, target=["mlp"]),
                         "causal_lm", seed=0)  # fmt: skip


@torch.no_grad()
def alone_in_a_bin(model: nn.Module, batch: TextBatch, secrets: dict) -> set[tuple[int, int]]:
    """The reference: the (token, position) pairs that some block's bins hold alone. It runs the client's
    forward pass on the batch, reads each bin unit's pre-activation at the gating projection (a unit fires
    for a token when it is positive) and groups the tokens whose loss reaches them (a causal LM's last
    token is only a label) by how many units fire; a group of one distinct pair is that pair's bin. (A bin
    whose tokens' gradients one token dominates can match that token too: the reference is what the attack
    must read at least, and the batch what it may read at most.)"""
    spec = family_of(model)
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name in secrets["lora_a"]:
        module_name = name.split(".lora_A.")[0]
        _, module = find_module(model, module_name)
        hooks.append(module.base_layer.register_forward_hook(
            lambda _m, _a, out, key=module_name: seen.__setitem__(key, out.detach())))  # fmt: skip
    try:
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    lengths = batch.attention_mask.sum(dim=1).tolist()
    visible = [(n, t) for n, length in enumerate(lengths) for t in range(int(length) - 1)]
    found: set[tuple[int, int]] = set()
    for key, pre in seen.items():
        r = model.get_parameter(f"{key}.lora_A.default.weight").shape[0]
        groups: dict[int, set[tuple[int, int]]] = {}
        for n, t in visible:
            fired = int((pre[n, t, :r] > 0).sum())
            groups.setdefault(fired, set()).add((int(batch.input_ids[n, t]), t))
        found |= {next(iter(g)) for fired, g in groups.items() if fired and len(g) == 1}  # 0: below every cut
    assert spec.causal
    return found


def test_on_the_gpt2_arch_every_token_a_bin_holds_alone_is_read_and_nothing_else():
    """r = 16 on both blocks (32 bins) against four sentences' 15 visible tokens: the attack returns every
    token of the reference and only the batch's visible tokens (an unordered set: positions repeat across
    sentences), and from a norm-matched random update nothing."""
    model, tokenizer = _gpt2(16)
    attack = create_attack("peftleak_lora")
    malicious, secrets = attack.prepare(model, None, generator=_gen())
    data = TokenDataset.from_texts(
        TextDataset("t", TEXTS, (1, 0, 1, 0), ("n", "p")), tokenizer, max_tokens=12
    )
    batch = data.batch()
    obs = Observation(malicious, fedsgd_text_update(malicious, batch, "causal_lm"), (12,), 2, secrets=secrets)
    rec = attack.reconstruct(obs, generator=_gen())
    expected = alone_in_a_bin(malicious, batch, secrets)
    assert not rec.ordered and len(rec.token_ids) == 1
    got, visible = set(rec.token_ids[0]), {t for s in batch.sequences() for t in s[:-1]}
    assert {tok for tok, _ in expected} <= got <= visible and len(expected) >= 5, (
        sorted(expected),
        got,
    )  # 7 here
    null = attack.reconstruct(null_observation(obs, _gen(1)), generator=_gen())
    assert null.token_ids == [] and null.stats["bins_live"] == 32


def test_one_sentence_comes_back_in_order_but_its_last_token():
    """B = 1 with learned positions: each recovered token carries its position, so the sentence is one
    ordered sequence; the last token is only a label (its position has no loss)."""
    model, tokenizer = _gpt2(16)
    attack = create_attack("peftleak_lora")
    malicious, secrets = attack.prepare(model, None, generator=_gen())
    data = TokenDataset.from_texts(TextDataset("t", TEXTS[:1], (1,), ("n", "p")), tokenizer, max_tokens=12)
    truth = data.batch().sequences()[0]
    update = fedsgd_text_update(malicious, data.batch(), "causal_lm")
    rec = attack.reconstruct(Observation(malicious, update, (12,), 2, secrets=secrets), generator=_gen())
    assert rec.ordered and rec.token_ids == [truth[:-1]]


def test_a_llama_without_gate_bias_is_read_through_its_constant_coordinate():
    """Rotary positions, an RMS norm, a bias-free SwiGLU gate: the constant embedding coordinate carries
    the cuts, and the up projection multiplies the gate by 1 (module docstring). Two sentences of six
    tokens, r = 16: every visible token, positions unknown; noise gives nothing."""
    model = _llama(16)
    attack = create_attack("peftleak_lora")
    malicious, secrets = attack.prepare(model, None, generator=_gen())
    seqs = [[11, 57, 203, 9, 141, 77], [34, 120, 5, 260, 88, 19]]
    batch = TextBatch(torch.tensor(seqs), torch.ones(2, 6, dtype=torch.long))
    obs = Observation(
        malicious, fedsgd_text_update(malicious, batch, "causal_lm"), (6,), 300, secrets=secrets
    )
    rec = attack.reconstruct(obs, generator=_gen())
    expected = alone_in_a_bin(malicious, batch, secrets)
    assert (
        sorted(rec.token_ids[0])
        == sorted({tok for tok, _ in expected})
        == sorted(s for q in seqs for s in q[:-1])
    )
    emb = malicious.get_input_embeddings().weight
    rms = emb.pow(2).mean(dim=1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=0, atol=1e-5)  # every row's RMS is 1
    assert attack.reconstruct(null_observation(obs, _gen(1)), generator=_gen()).token_ids == []


def test_fedavg_over_several_local_steps_stays_exact():
    """Two batches, two epochs, lr 0.05: four SGD steps whose gradients add into the same bins (the
    embeddings are frozen and the attention zero, so no token's input moves): the attack reads the tokens
    the union of the batches leaves alone in a bin, and nothing outside the batches."""
    model, tokenizer = _gpt2(32)
    attack = create_attack("peftleak_lora")
    malicious, secrets = attack.prepare(model, None, generator=_gen())
    data = TokenDataset.from_texts(
        TextDataset("t", TEXTS, (1, 0, 1, 0), ("n", "p")), tokenizer, max_tokens=12
    )
    training = LocalTraining("fedavg", epochs=2, batch_size=2, lr=0.05)
    result = train_client(0, malicious, data, training, [], _gen(), task=CausalLM())
    assert result.update is not None and result.update.metadata["local_steps"] == 4, result.error
    obs = Observation(malicious, result.update, (12,), 2, secrets=secrets, training=training)
    rec = attack.reconstruct(obs, generator=_gen())
    expected = alone_in_a_bin(malicious, data.batch(), secrets)  # the union of both batches' tokens
    visible = {t for s in data.batch().sequences() for t in s[:-1]}
    got = set(rec.token_ids[0])
    assert {tok for tok, _ in expected} <= got <= visible and len(expected) >= 10, (sorted(expected), got)


def test_the_engine_sends_the_planted_model_and_scores_what_comes_back():
    """Through run_experiment (in-process engine): the audited clients train the server's model, the
    secrets reach the attack, and each record's ROUGE-1 stands above a null floor of 0."""
    from gradleak.experiments import load_config, run_experiment

    raw = {
        "experiment": {"name": "peftleak", "seed": 0},
        "data": {"dataset": "rotten_tomatoes", "train_split": "all", "test_split": "all", "train_limit": 40,
                 "test_limit": 8, "num_clients": 4, "partition": "iid", "options": {"max_tokens": 16}},
        "model": {"name": "gpt2_tiny", "task": "causal_lm",
                  "adapter": {"r": 64, "alpha": 128, "target": ["attention", "mlp"]}},
        "fl": {"rounds": 0, "fraction": 0.5},
        "audit": {"clients": 2, "max_samples": 2, "training": {"protocol": "fedsgd", "batch_size": 2},
                  "attacks": [{"name": "peftleak_lora"}]},
    }  # fmt: skip
    records = run_experiment(load_config(raw, [])).of_kind("attack")
    assert len(records) == 2
    for r in records:
        assert r["floor_null_rouge1"] == 0.0 and r["rouge1"] >= 0.4 and r["token_precision"] == 1.0, r


@pytest.mark.parametrize(
    ("build", "message"),
    [(lambda: _gpt2(8, ["attention"])[0], "target must include 'mlp'"),
     (lambda: apply_adapter(build_bert_tiny(seed=0).model, AdapterConfig(r=4, alpha=8, target=["mlp"]),
                            "classification", seed=0), "no pass-through map")],
    ids=["attention_only_lora", "bert"],
)  # fmt: skip
def test_what_it_cannot_attack_is_refused_by_name(build, message):
    with pytest.raises(AttackInputError, match=message):
        create_attack("peftleak_lora").prepare(build(), None, generator=_gen())


@pytest.mark.parametrize(
    ("options", "message"),
    [({"blocks": 0}, "blocks"), ({"sharpness": -1.0}, "sharpness"), ({"min_cosine": 1.5}, "min_cosine"),
     ({"sample": 1}, "sample"), ({"leak_scale": float("nan")}, "leak_scale"), ({"positions": 0}, "positions"),
     ({"leak_scale": 0.5}, "leak_scale must be <= 0.01"), ({"min_cosine": True}, "min_cosine")],
)  # fmt: skip
def test_bad_options_are_refused_on_construction(options, message):
    with pytest.raises(ValueError, match=message):
        create_attack("peftleak_lora", **options)


def test_the_text_scorer_reports_the_token_overlap_a_token_set_is_read_by():
    """``token_recall`` / ``token_precision`` over distinct ids, by hand: a set holding every distinct
    token of a sentence but its last (a causal LM's label) and one foreign id."""
    from gradleak.audit import TextScorer
    from gradleak.types import Reconstruction

    _, tokenizer = _gpt2(4)
    data = TokenDataset.from_texts(TextDataset("t", TEXTS[:2], (1, 0), ("n", "p")), tokenizer, max_tokens=12)
    seqs = data.batch().sequences()
    distinct = {t for s in seqs for t in s}
    held = {t for s in seqs for t in s[:-1]} | {99}  # 99 is in neither sentence
    assert 99 not in distinct
    scores = TextScorer(tokenizer).score(Reconstruction(token_ids=[sorted(held)], ordered=False), data)
    hit = len(held & distinct)
    assert scores["token_recall"] == pytest.approx(hit / len(distinct), abs=1e-12)
    assert scores["token_precision"] == pytest.approx(hit / len(held), abs=1e-12)
    assert 0 < scores["token_recall"] < 1 and 0 < scores["token_precision"] < 1


def test_tokens_of_a_batch_at_distinct_positions_are_not_called_a_sentence():
    """A classifier's loss reaches only each sentence's last token, at a different position per sentence:
    positions alone do not make two sentences' tokens one sequence, so a batch gives an unordered set."""
    tm = build_gpt2("tiny", "classification", seed=0)
    adapter = AdapterConfig(r=16, alpha=32, target=["attention", "mlp"])
    model = apply_adapter(tm.model, adapter, "classification", seed=0)
    attack = create_attack("peftleak_lora")
    malicious, secrets = attack.prepare(model, None, generator=_gen())
    data = TokenDataset.from_texts(
        TextDataset("t", TEXTS[:2], (1, 0), ("n", "p")), tm.tokenizer, max_tokens=12
    )
    batch = data.batch()
    obs = Observation(
        malicious, fedsgd_text_update(malicious, batch, "classification"), (12,), 2, secrets=secrets
    )
    rec = attack.reconstruct(obs, generator=_gen())
    last = {s[-1] for s in batch.sequences()}
    assert not rec.ordered and set(rec.token_ids[0]) == last, rec.token_ids  # each sentence's last token


def _small_llama(intermediate: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    return apply_adapter(model, AdapterConfig(r=16, alpha=32, target=["mlp"]), "causal_lm", seed=0)


@pytest.mark.parametrize(
    ("build", "message"),
    [(lambda: _small_llama(8), "16 bins need at least 16 gate units"),
     (lambda: _small_llama(128, torch.float16), "underflows in torch.float16")],
    ids=["fewer_units_than_rank", "float16"],
)  # fmt: skip
def test_a_model_the_bins_do_not_fit_is_refused_by_name(build, message):
    with pytest.raises(AttackInputError, match=message):
        create_attack("peftleak_lora").prepare(build(), None, generator=_gen())


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_the_masked_variant_reads_the_bins_pruning_leaves(ratio):
    """Pruning zeroes each tensor's smallest entries and breaks the bin differences (peftleak_lora reads
    nothing); peftleak_lora_masked matches each difference on the coordinates both rows kept (all of a row's
    where the row below is zero throughout). Checked against a plain loop over every difference, position
    and candidate, against the batch (precision 1), and, unpruned, against peftleak_lora."""
    from gradleak.attacks.text.peftleak import candidate_positions, first_block, mlp_inputs
    from gradleak.defenses.pruning import Pruning, PruningConfig

    model, tokenizer = _gpt2(32)
    plain, masked = create_attack("peftleak_lora"), create_attack("peftleak_lora_masked")
    malicious, secrets = masked.prepare(model, None, generator=_gen())
    data = TokenDataset.from_texts(
        TextDataset("t", TEXTS, (1, 0, 1, 0), ("n", "p")), tokenizer, max_tokens=12
    )
    update = Pruning(PruningConfig(ratio)).on_update(fedsgd_text_update(malicious, data.batch(), "causal_lm"))
    obs = Observation(malicious, update, (12,), 2, secrets=secrets)
    assert plain.reconstruct(obs, generator=_gen()).token_ids == []
    got = set(masked.reconstruct(obs, generator=_gen()).token_ids[0])
    spec = family_of(malicious)
    first = first_block(malicious, spec, secrets["lora_a"][0])
    vocab = torch.arange(malicious.get_input_embeddings().num_embeddings)
    features = {p: mlp_inputs(malicious, spec, first, vocab, torch.full_like(vocab, p))
                for p in candidate_positions(malicious, spec, 12)}  # fmt: skip
    expected = set()
    for name in secrets["lora_a"]:
        rows = update.tensors[name].to(torch.float64)
        for j in range(len(rows)):
            below = rows[j + 1] if j + 1 < len(rows) else torch.zeros_like(rows[j])
            kept = (rows[j] != 0) & (
                (below != 0) if bool(below.any()) else torch.ones_like(below, dtype=torch.bool)
            )
            if int(kept.sum()) < 8:
                continue
            d = (rows[j] - below)[kept]
            if float(d.norm()) == 0:
                continue
            best, token = 0.0, None
            for x in features.values():
                cos = (x[:, kept] @ d).abs() / (x[:, kept].norm(dim=1) * d.norm())
                if float(cos.max()) > best:
                    best, token = float(cos.max()), int(cos.argmax())
            if best >= 0.999:
                expected.add(token)
    visible = {t for s in data.batch().sequences() for t in s[:-1]}
    assert got == expected and got <= visible and len(got) >= 5, (sorted(got), sorted(expected))
    # unpruned, the masked variant reads what peftleak_lora reads
    whole = fedsgd_text_update(malicious, data.batch(), "causal_lm")
    obs = Observation(malicious, whole, (12,), 2, secrets=secrets)
    assert (
        masked.reconstruct(obs, generator=_gen()).token_ids
        == plain.reconstruct(obs, generator=_gen()).token_ids
    )
