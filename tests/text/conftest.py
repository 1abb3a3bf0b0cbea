"""Shared fixtures for the text tests: tiny GPT-2/BERT models (random init, real tokenizers) and a batch."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gradleak.data.text import TextBatch, encode
from gradleak.models.text import TextModel, build_bert_tiny, build_gpt2

SENTENCES = ("the movie was surprisingly good", "a dull and lifeless film .")


@pytest.fixture(scope="session")
def gpt2_cls() -> TextModel:
    return build_gpt2("tiny", "classification", seed=0)


@pytest.fixture(scope="session")
def gpt2_lm() -> TextModel:
    return build_gpt2("tiny", "causal_lm", seed=0)


@pytest.fixture(scope="session")
def gpt2_lm_untied() -> TextModel:
    return build_gpt2("tiny", "causal_lm", seed=0, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def bert_cls() -> TextModel:
    return build_bert_tiny(seed=0)


def _batch_for(tm: TextModel, sentences: tuple[str, ...] = SENTENCES) -> TextBatch:
    return encode(list(sentences), tm.tokenizer, labels=[1, 0][: len(sentences)])


@pytest.fixture(scope="session")
def make_batch() -> Callable[..., TextBatch]:
    """``make_batch(model, sentences=SENTENCES)``: the sentences encoded with labels 1, 0."""
    return _batch_for
