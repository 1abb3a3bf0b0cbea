"""FedSpy-LLM as read here (issue 53): the token set from the gradient, the order by aligning partial-sequence
gradients with the update, where sequences end from block 2's span, on the 2-layer GPT-2 with the real
tokenizer."""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks import create_attack
from gradleak.attacks.text.baseline import null_observation
from gradleak.attacks.text.fedspy import FedSpy, FedSpyConfig
from gradleak.data.text import encode
from gradleak.models import build_model
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import AttackInputError, Observation, Update


@pytest.fixture(scope="module")
def gpt2():
    return build_model("gpt2_tiny", (16,), 2, task="causal_lm", seed=0)


def run(obs: Observation, **options) -> list[list[int]]:
    return (
        create_attack("fedspy", **options)
        .reconstruct(obs, generator=torch.Generator().manual_seed(0))
        .token_ids
    )


def test_one_sentence_comes_back_exactly_from_the_embedding_rows(observe_lm, gpt2):
    obs, (true,) = observe_lm(gpt2, ["the film was great fun"])
    assert run(obs) == [true]


def test_the_span_reading_recovers_all_but_the_last_token(observe_lm, gpt2):
    """Under the next-token loss the last token is only a label: no block-1 input holds it."""
    obs, (true,) = observe_lm(gpt2, ["the film was great fun"])
    assert run(obs, tokens="span") == [true[:-1]]


@pytest.mark.parametrize(
    "texts",
    [
        ["the film was great fun", "a dull and boring movie"],
        # short: the gain rule alone gave "great fun movie dull movie", "a dull"
        ["great fun", "a dull movie"],
        ["the film was great fun", "a dull and boring movie", "it was fun"],
    ],
)
def test_sentences_come_back_exactly_with_their_ends_read_off_block_2s_span(observe_lm, gpt2, texts):
    """The cosine alone does not find where a sentence ends (an extension from the rest of the batch also
    raises it: +0.03 measured, against +0.06-0.14 for true ones; the first sentence ran on into the
    others' words in all three batches); the span test of the last position's block-2 input does."""
    obs, truth = observe_lm(gpt2, texts)
    rec = create_attack("fedspy").reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert sorted(rec.token_ids) == sorted(truth), [gpt2.tokenizer.decode(s) for s in rec.token_ids]
    assert rec.stats["span_ends"] == 1


def test_a_true_prefix_outranks_a_better_aligned_wrong_pair(observe_lm, gpt2, monkeypatch):
    """The span test comes before the cosine: a wrong second token given the best cosine of all pairs (a
    WikiText-2 sentence on GPT-2 small ended after two tokens that way: "It" + "unk") is passed over for
    the true one, which passes the test where the wrong one fails."""
    from gradleak.attacks.text import fedspy

    obs, (true,) = observe_lm(gpt2, ["the film was great fun"])
    wrong = [true[0], true[3]]  # "the great"
    ends = fedspy.FedSpy().span_ends(obs, obs.client_model())
    assert ends is not None and ends.continues([true[:2], wrong]) == [True, False]
    plain = fedspy.Alignment.cosine
    monkeypatch.setattr(  # cosines are <= 1: +2 puts the wrong pair above every other
        fedspy.Alignment, "cosine", lambda self, ids: plain(self, ids) + (2.0 if ids == wrong else 0.0)
    )
    assert run(obs) == [true]


def test_without_block_2s_attention_the_gain_rule_alone_ends_sequences(observe_lm, gpt2):
    obs, (true,) = observe_lm(gpt2, ["the film was great fun"])
    frozen = {n: t for n, t in obs.update.tensors.items() if ".h.1.attn." not in n}
    rec = create_attack("fedspy").reconstruct(
        Observation(obs.model, Update(frozen, 1, kind="gradient"), obs.input_shape, 50257),
        generator=torch.Generator().manual_seed(0),
    )
    assert rec.token_ids == [true] and rec.stats["span_ends"] == 0


def test_a_null_update_gives_none_of_the_words(observe_lm, gpt2):
    obs, (true,) = observe_lm(gpt2, ["the film was great fun"])
    null = null_observation(obs, torch.Generator().manual_seed(1))
    got = run(null, max_length=6)
    assert not set(true) & {t for seq in got for t in seq}


def test_what_fedspy_cannot_read_is_refused_before_work(observe_lm, gpt2):
    obs, _ = observe_lm(gpt2, ["the film was great fun"])
    delta = Observation(obs.model, Update(dict(obs.update.tensors), 1, kind="delta"), obs.input_shape, 50257)
    with pytest.raises(AttackInputError, match="FedAvg delta"):
        run(delta)
    frozen = {n: t for n, t in obs.update.tensors.items() if "wte" not in n}
    no_rows = Observation(obs.model, Update(frozen, 1, kind="gradient"), obs.input_shape, 50257)
    with pytest.raises(AttackInputError, match="use tokens='span'"):
        run(no_rows)
    with pytest.raises(AttackInputError, match="5 tokens and 1 sequences .at most 4"):
        run(obs, max_tokens=4)
    bert = build_model("bert_tiny", (16,), 2, seed=0)
    enc = encode(["the film was great fun"], bert.tokenizer, max_tokens=16, labels=[1])
    cls = Observation(bert.model, fedsgd_text_update(bert.model, enc, "classification"), (16,), 2)
    with pytest.raises(AttackInputError, match="causal language model"):
        run(cls)


def test_the_union_reads_input_tokens_the_rows_miss_and_the_last_token_the_span_lacks(tiny_llama):
    """Under a tied head the embedding rows can miss an input token (on SmolLM2 the head's softmax term hid
    "what" and " up" of a Rotten Tomatoes sentence); here the first token's row is replaced in the update by
    that of a token outside the batch (the head's term alone) to make the rows miss it. The span test
    (rotary positions: one scan of the vocabulary) finds it but lacks the last token, a label only; the
    union of the two holds both, and the sentence comes back exactly. Without block 1's attention in the
    update the union is the rows (no refusal)."""
    seq = [11, 23, 5, 200, 31, 64, 9, 150]
    obs = tiny_llama([seq])
    tensors = dict(obs.update.tensors)
    name = "model.embed_tokens.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][seq[0]] = tensors[name][0]
    hidden = Observation(obs.model, Update(tensors, 1, kind="gradient"), obs.input_shape, obs.num_classes)
    model = hidden.client_model()
    rows = FedSpy(FedSpyConfig(tokens="rows")).token_set(hidden, model)
    span = FedSpy(FedSpyConfig(tokens="span")).token_set(hidden, model)
    assert set(rows) == set(seq) - {seq[0]} and set(span) == set(seq) - {seq[-1]}
    assert FedSpy(FedSpyConfig(tokens="union")).token_set(hidden, model) == sorted(set(seq))
    assert run(hidden, tokens="union") == [seq]
    no_block1 = {n: t for n, t in tensors.items() if "layers.0.self_attn." not in n}
    frozen = Observation(obs.model, Update(no_block1, 1, kind="gradient"), obs.input_shape, obs.num_classes)
    assert FedSpy(FedSpyConfig(tokens="union")).token_set(frozen, frozen.client_model()) == rows


def test_an_extension_that_passes_the_span_test_is_taken_whatever_its_cosine_gain(observe_lm, gpt2):
    """A passing extension is a true prefix: near the end of a long SmolLM2 WikiText-2 sentence the true
    next token raised the cosine by 2e-5, below ``min_gain``, and the sentence stopped two tokens early.
    With a gain no extension can bring (2: cosines lie in [-1, 1]), every passing token that raises the
    cosine at all is still taken; only the last one, a label that fails the test, must bring the gain, so
    it alone is left out."""
    obs, (true,) = observe_lm(gpt2, ["the film was great fun"])
    assert run(obs, min_gain=2.0) == [true[:-1]]
