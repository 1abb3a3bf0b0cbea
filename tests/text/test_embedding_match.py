"""TAG and LAMP (issue 53): text from a FedSGD gradient by matching input embeddings.

On the 2-layer random BERT with the real bert-base-uncased vocabulary, one sentence of 7 tokens: LAMP (its
defaults but a short budget) recovers it exactly; TAG (its L2 + L1 distance, started at the vocabulary's
norm) recovers most of it; from a norm-matched null update neither recovers any of its words. Under the
next-token loss of a causal LM (the 2-layer GPT-2 with the real tokenizer; a 2-block rotary Llama, whose
T is read from the span's rank): LAMP recovers the sentence exactly, TAG most of its tokens, and from a
null update neither any of its words. Both refuse, before work, a model with neither head and a
classifier's batch whose labels are not granted.
"""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks import create_attack
from gradleak.attacks.text.baseline import null_observation
from gradleak.data.text import TextBatch, encode
from gradleak.models import build_model
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import AttackInputError, Observation, Update

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


def test_pinned_special_tokens_stay_through_steps_starts_and_moves(case):
    """LAMP's fix_special_tokens: [CLS] and [SEP] pinned at the ends; the starts' permutations and the
    discrete moves shuffle only the positions between them."""
    tm, obs, true = case
    noise = null_observation(obs, torch.Generator().manual_seed(1))  # nothing to pull them there but the pin
    lamp = create_attack("lamp", steps=30, init_candidates=5, swap_every=5, swap_burnin=0.0, swap_tries=10,
                         first_token_id=true[0], last_token_id=true[-1])  # fmt: skip
    got = lamp.reconstruct(noise, generator=torch.Generator().manual_seed(0)).token_ids[0]
    assert got[0] == true[0] and got[-1] == true[-1] and len(got) == obs.input_shape[0]
    with pytest.raises(AttackInputError, match=r"pinned token ids \[99999\]"):
        create_attack("tag", first_token_id=99999).reconstruct(obs, generator=torch.Generator())
    with pytest.raises(ValueError, match="first_token_id must be a token id"):
        create_attack("tag", first_token_id=-1)


@pytest.mark.parametrize("name", ["tag", "lamp"])
def test_a_null_update_gives_none_of_the_words(case, name):
    tm, obs, true = case
    null = null_observation(obs, torch.Generator().manual_seed(1))
    rec = create_attack(name, steps=100, init_candidates=5).reconstruct(
        null, generator=torch.Generator().manual_seed(0)
    )
    assert not set(true[1:-1]) & set(rec.token_ids[0]), words(tm, rec.token_ids[0])


def test_hidden_labels_and_a_model_without_a_head_are_refused_before_work(case):
    tm, obs, _ = case
    hidden = Observation(obs.model, obs.update, obs.input_shape, 2)
    for name in ("tag", "lamp"):
        with pytest.raises(AttackInputError, match="grant them"):
            create_attack(name).reconstruct(hidden, generator=torch.Generator())
    bare = tm.model.bert  # the encoder alone: neither a classification nor a language-model head
    update = Update({n: torch.zeros_like(p) for n, p in bare.named_parameters()}, 1, kind="gradient")
    with pytest.raises(AttackInputError, match="neither head"):
        create_attack("lamp").reconstruct(Observation(bare, update, (7,), 2), generator=torch.Generator())


# ---- causal language models: the labels are the sequence's own next tokens


@pytest.fixture(scope="module")
def causal():
    tm = build_model("gpt2_tiny", (16,), 2, task="causal_lm", seed=0)
    batch = encode([SENTENCE], tm.tokenizer, max_tokens=16)
    update = fedsgd_text_update(tm.model, batch, "causal_lm")
    return tm, Observation(tm.model, update, (16,), 50257), batch.sequences()[0]


def test_lamp_recovers_a_sentence_under_the_next_token_loss(causal):
    tm, obs, true = causal
    rec = create_attack("lamp", steps=100, init_candidates=20).reconstruct(
        obs, generator=torch.Generator().manual_seed(0)
    )
    assert rec.token_ids == [true], words(tm, rec.token_ids[0])
    # T read off the position gradient (the last token is only a label), below the input width of 16
    assert rec.stats["sequence_length"] == 5 and rec.stats["length_read"] == 1
    assert rec.stats["vocabulary"] == 5 and rec.labels is None


def test_a_null_causal_update_gives_none_of_the_words(causal):
    tm, obs, true = causal
    null = null_observation(obs, torch.Generator().manual_seed(1))
    for name in ("tag", "lamp"):
        rec = create_attack(name, steps=30, init_candidates=5).reconstruct(
            null, generator=torch.Generator().manual_seed(0)
        )
        # every position row is non-zero in noise: T is the input width, not read off the gradient
        assert rec.stats["sequence_length"] == 16 and rec.stats["length_read"] == 0
        assert not set(true) & set(rec.token_ids[0]), words(tm, rec.token_ids[0])


def _rotary(seq: list[int]) -> Observation:
    """A 2-block random-init Llama (rotary positions, tied head) and the next-token gradient of ``seq``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()  # sdpa attention: the attack switches its copy to eager
    batch = TextBatch(torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))
    update = fedsgd_text_update(model, batch, "causal_lm")
    return Observation(model, update, (16,), cfg.vocab_size)


ROTARY = [17, 42, 101, 7, 250, 99]


def test_lamp_on_rotary_positions_reads_t_from_the_span_rank():
    obs = _rotary(ROTARY)
    rec = create_attack("lamp", steps=100, init_candidates=20).reconstruct(
        obs, generator=torch.Generator().manual_seed(0)
    )
    assert rec.token_ids == [ROTARY]
    assert rec.stats["sequence_length"] == 6 and rec.stats["length_read"] == 1


def test_tag_on_rotary_positions_recovers_most_tokens():
    obs = _rotary(ROTARY)
    rec = create_attack("tag", steps=300).reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert len(set(ROTARY) & set(rec.token_ids[0])) >= 4, rec.token_ids  # measured: 5 of 6
