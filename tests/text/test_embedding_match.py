"""TAG and LAMP (issue 53): text from a classifier's FedSGD gradient by matching input embeddings.

On the 2-layer random BERT with the real bert-base-uncased vocabulary, one sentence of 7 tokens: LAMP (its
defaults but a short budget) recovers it exactly; TAG (its L2 + L1 distance, started at the vocabulary's
norm) recovers most of it; from a norm-matched null update neither recovers any of its words. Both
refuse, before work, a causal language model and a batch whose labels are not granted.
"""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks import create_attack
from gradleak.attacks.text.baseline import null_observation
from gradleak.data.text import TextBatch
from gradleak.models import build_model
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import AttackInputError, Observation

SENTENCE = "the film was great fun"


@pytest.fixture(scope="module")
def case():
    tm = build_model("bert_tiny", (16,), 2, seed=0)
    enc = tm.tokenizer([SENTENCE], return_tensors="pt")
    batch = TextBatch(enc["input_ids"], enc["attention_mask"], torch.tensor([1]))
    update = fedsgd_text_update(tm.model, batch, "classification")
    obs = Observation(tm.model, update, (enc["input_ids"].shape[1],), 2, labels=batch.labels)
    return tm, obs, enc["input_ids"][0].tolist()


def words(tm, ids: list[int]) -> list[str]:
    return tm.tokenizer.convert_ids_to_tokens(ids)


def test_lamp_recovers_a_sentence_exactly(case):
    tm, obs, true = case
    rec = create_attack("lamp", steps=300, init_candidates=50).reconstruct(
        obs, generator=torch.Generator().manual_seed(0)
    )
    assert rec.token_ids == [true], words(tm, rec.token_ids[0])
    assert rec.stats["sequence_length"] == 7 and rec.stats["vocabulary"] == 7  # read off the gradient
    assert torch.equal(rec.labels, obs.labels)


def test_tag_recovers_most_of_a_sentence(case):
    tm, obs, true = case
    rec = create_attack("tag", steps=800, lr=0.01, init_norm=0.16).reconstruct(
        obs, generator=torch.Generator().manual_seed(0)
    )
    (got,) = rec.token_ids
    in_place = sum(a == b for a, b in zip(got, true, strict=True))
    content = set(true[1:-1])  # the five words between [CLS] and [SEP]
    assert in_place >= 4 and len(content & set(got)) >= 3, words(tm, got)


@pytest.mark.parametrize("name", ["tag", "lamp"])
def test_a_null_update_gives_none_of_the_words(case, name):
    tm, obs, true = case
    null = null_observation(obs, torch.Generator().manual_seed(1))
    rec = create_attack(name, steps=100, init_candidates=5).reconstruct(
        null, generator=torch.Generator().manual_seed(0)
    )
    assert not set(true[1:-1]) & set(rec.token_ids[0]), words(tm, rec.token_ids[0])


def test_a_causal_lm_and_hidden_labels_are_refused_before_work(case):
    tm, obs, _ = case
    hidden = Observation(obs.model, obs.update, obs.input_shape, 2)
    for name in ("tag", "lamp"):
        with pytest.raises(AttackInputError, match="grant them"):
            create_attack(name).reconstruct(hidden, generator=torch.Generator())
    lm = build_model("gpt2_tiny", (8,), 2, task="causal_lm", seed=0)
    enc = lm.tokenizer([SENTENCE], return_tensors="pt")
    update = fedsgd_text_update(lm.model, TextBatch(enc["input_ids"], enc["attention_mask"]), "causal_lm")
    causal = Observation(lm.model, update, (enc["input_ids"].shape[1],), 2, labels=torch.tensor([0]))
    with pytest.raises(AttackInputError, match="no classification head"):
        create_attack("lamp").reconstruct(causal, generator=torch.Generator())


def test_a_fedavg_delta_is_refused_before_work(case):
    import dataclasses

    _, obs, _ = case
    delta = dataclasses.replace(obs.update, kind="delta")
    fedavg = Observation(obs.model, delta, obs.input_shape, 2, labels=obs.labels)
    for name in ("tag", "lamp"):
        with pytest.raises(AttackInputError, match="one FedSGD gradient"):
            create_attack(name).reconstruct(fedavg, generator=torch.Generator())


def test_lamps_moves_add_the_prior_term_of_each_trial(case):
    """The moves are scored by distance + the language-model term of the moved sequence: a term that makes
    every trial but one cost 1e6 picks that one, whatever the distance says."""
    from gradleak.attacks.text.embedding_match import Inversion, Lamp, LampConfig, moves

    tm, obs, _ = case
    lamp = Lamp(LampConfig(swap_tries=12))
    model = obs.client_model()
    params = [p.requires_grad_(True) for p in model.parameters()]
    target = [obs.update.tensors[n] for n, _ in model.named_parameters()]
    problem = Inversion(model, params, target, obs.labels, lamp.distance())
    x = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(0))
    perms = moves(7, torch.Generator().manual_seed(3), 12)
    chosen = 5
    assert not torch.equal(perms[chosen], perms[0])

    def term(seq: torch.Tensor, tried: list[torch.Tensor]) -> torch.Tensor:  # each move of the sequence
        assert torch.equal(seq, x[0]) and len(tried) == 12
        return torch.tensor([0.0 if torch.equal(p, perms[chosen]) else 1e6 for p in tried])

    out = lamp._swap(problem, x, 1.0, torch.Generator().manual_seed(3), term)
    assert torch.equal(out[0], x[0, perms[chosen]])


def test_the_prior_term_is_the_weighted_nll_of_each_moved_sequences_tokens_over_b(case, monkeypatch):
    """LAMP adds prior_weight x the batch-mean LM loss: one moved sequence of B weighs 1/B."""
    from gradleak.attacks.text import embedding_match
    from gradleak.attacks.text.embedding_match import Lamp, LampConfig, nearest_tokens
    from gradleak.attacks.text.lm_prior import LMPriorConfig

    tm, obs, _ = case
    seen: list[torch.Tensor] = []

    class Counting:  # an NLL that is the sum of the ids: easy to predict
        def nll(self, ids: torch.Tensor) -> torch.Tensor:
            seen.append(ids)
            return ids.double().sum(dim=1)

    monkeypatch.setattr(embedding_match, "load_prior", lambda config: Counting())
    lamp = Lamp(LampConfig(prior_weight=0.3, prior=LMPriorConfig(tokenizer="bert_tiny")))
    model = obs.client_model()
    table = model.get_input_embeddings().weight.detach()
    vocab = torch.tensor([101, 102, 1996, 2143, 2001])
    term = lamp._prior(model, table, vocab, 2, 5)
    assert term is not None
    seq = table[torch.tensor([101, 2143, 1996, 2001, 102])] * 1.5
    perms = [torch.arange(5), torch.tensor([0, 2, 1, 3, 4])]
    got = term(seq, perms)
    ids = nearest_tokens(seq.unsqueeze(0), table, vocab)[0]
    assert ids.tolist() == [101, 2143, 1996, 2001, 102]
    assert torch.equal(seen[0], torch.stack([ids, ids[perms[1]]]))
    assert torch.allclose(got, 0.3 / 2 * ids.double().sum() * torch.ones(2, dtype=torch.float64))


def test_a_prior_for_another_vocabulary_or_without_moves_is_refused_before_work(case):
    _, obs, _ = case
    attack = create_attack("lamp", steps=1, init_candidates=1, prior={"tokenizer": "gpt2_tiny"})
    with pytest.raises(ValueError, match="50257 tokens, the model's embedding 30522"):
        attack.reconstruct(obs, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="prior_weight > 0 and swap_every > 0"):
        create_attack("tag", prior={"tokenizer": "bert_tiny"})
    with pytest.raises(ValueError, match="prior tokenizer must be a text model's"):
        create_attack("lamp", prior={"tokenizer": "nope"})
