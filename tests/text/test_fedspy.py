"""FedSpy-LLM as read here (issue 53): the token set from the gradient, the order by aligning partial-sequence
gradients with the update, on the 2-layer GPT-2 with the real tokenizer."""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks import create_attack
from gradleak.attacks.text.baseline import null_observation
from gradleak.data.text import encode
from gradleak.models import build_model
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import AttackInputError, Observation, Update


@pytest.fixture(scope="module")
def gpt2():
    return build_model("gpt2_tiny", (16,), 2, task="causal_lm", seed=0)


def observe(tm, texts: list[str]) -> tuple[Observation, list[list[int]]]:
    batch = encode(texts, tm.tokenizer, max_tokens=16)
    update = fedsgd_text_update(tm.model, batch, "causal_lm")
    return Observation(tm.model, update, (batch.input_ids.shape[1],), 50257), batch.sequences()


def run(obs: Observation, **options) -> list[list[int]]:
    return (
        create_attack("fedspy", **options)
        .reconstruct(obs, generator=torch.Generator().manual_seed(0))
        .token_ids
    )


def test_one_sentence_comes_back_exactly_from_the_embedding_rows(gpt2):
    obs, (true,) = observe(gpt2, ["the film was great fun"])
    assert run(obs) == [true]


def test_the_span_reading_recovers_all_but_the_last_token(gpt2):
    """Under the next-token loss the last token is only a label: no block-1 input holds it."""
    obs, (true,) = observe(gpt2, ["the film was great fun"])
    assert run(obs, tokens="span") == [true[:-1]]


@pytest.mark.slow  # 17 s: one backward pass per tried token and step
def test_two_sentences_each_come_back_in_order(gpt2):
    """Each sentence is the start of one recovered sequence: the first runs on into the other's words (an
    extension from the rest of the batch also raises the cosine, measured +0.03 against +0.06-0.14 for the
    true ones), and with shorter sentences ("great fun", "a dull movie") it takes a word the second then
    lacks: where a sentence ends is what this reading of the ordering stage does not find."""
    obs, truth = observe(gpt2, ["the film was great fun", "a dull and boring movie"])
    got = run(obs)
    assert len(got) == 2
    for true in truth:
        assert any(seq[: len(true)] == true for seq in got), (truth, got)


def test_a_null_update_gives_none_of_the_words(gpt2):
    obs, (true,) = observe(gpt2, ["the film was great fun"])
    null = null_observation(obs, torch.Generator().manual_seed(1))
    got = run(null, max_length=6)
    assert not set(true) & {t for seq in got for t in seq}


def test_what_fedspy_cannot_read_is_refused_before_work(gpt2):
    obs, _ = observe(gpt2, ["the film was great fun"])
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
