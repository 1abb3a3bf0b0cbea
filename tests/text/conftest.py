"""Shared fixtures for the text tests: tiny GPT-2/BERT models (random init, real tokenizers) and a batch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from gradleak.data.text import TextBatch, encode
from gradleak.models.text import TextModel, build_bert_tiny, build_gpt2
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import Observation

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


def _observe_lm(tm: TextModel, texts: list[str]) -> tuple[Observation, list[list[int]]]:
    batch = encode(texts, tm.tokenizer, max_tokens=16)
    update = fedsgd_text_update(tm.model, batch, "causal_lm")
    return Observation(tm.model, update, (batch.input_ids.shape[1],), 50257), batch.sequences()


@pytest.fixture(scope="session")
def observe_lm() -> Callable[..., tuple[Observation, list[list[int]]]]:
    """``observe_lm(model, texts)``: the causal-LM FedSGD observation of ``texts`` (<= 16 tokens, padded to
    the longest) and their token ids."""
    return _observe_lm


def _tiny_llama(seqs: list[list[int]], kv_heads: int = 4) -> Observation:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    update = fedsgd_text_update(model, TextBatch(ids, mask), "causal_lm")
    return Observation(model, update, (width,), cfg.vocab_size)


@pytest.fixture(scope="session")
def tiny_llama() -> Callable[..., Observation]:
    """``tiny_llama(seqs, kv_heads=4)``: a 2-block random-init Llama (rotary positions, 4 query heads, tied
    head; seed 0) and the causal-LM FedSGD gradient of ``seqs`` (shorter ones padded and masked)."""
    return _tiny_llama
