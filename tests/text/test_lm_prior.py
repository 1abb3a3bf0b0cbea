"""The language-model prior LAMP scores its moves with (issue 53): trained here on a public split with the
victim's tokenizer, it prefers real sentences to their shuffles, and it is stored and reloaded exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradleak.attacks.text import lm_prior
from gradleak.attacks.text.lm_prior import LMPriorConfig, load_prior
from gradleak.data.text import load_text_dataset, sample
from gradleak.models.text import load_tokenizer

BIGRAM = LMPriorConfig(tokenizer="bert_tiny")
GPT2 = LMPriorConfig(tokenizer="bert_tiny", kind="gpt2", width=32, heads=2, layers=1, context=16, steps=2,
                     batch_size=4)  # fmt: skip


def test_the_bigram_prior_prefers_held_out_sentences_to_their_shuffles():
    """Rotten Tomatoes sentences (never seen: the prior counts WikiText-2 valid) against the same tokens
    shuffled between [CLS] and [SEP]."""
    prior = load_prior(BIGRAM)
    tok = load_tokenizer("bert_tiny")
    gen = torch.Generator().manual_seed(0)
    wins = 0
    texts = sample(load_text_dataset("rotten_tomatoes", split="all"), 40, seed=1).texts
    for text in texts:
        ids = torch.tensor(tok(text, truncation=True, max_length=32)["input_ids"])
        inner = ids[1:-1][torch.randperm(len(ids) - 2, generator=gen)]
        true, shuffled = prior.nll(torch.stack([ids, torch.cat([ids[:1], inner, ids[-1:]])])).tolist()
        wins += true < shuffled
    assert wins >= 34, wins  # of 40; chance is 20


def test_the_bigram_probabilities_match_a_hand_count():
    """Witten-Bell on a 12-token stream, against the formula evaluated by hand."""
    stream = torch.tensor([1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 3])
    prior = lm_prior.BigramPrior(stream, 6)
    uni = (torch.bincount(stream, minlength=6).double() + 1) / (12 + 6)
    # after 1: 2, 2, 2, 3 (c = 4, t = 2); after 2: 3, 4, 3 (c = 3, t = 2); 0 never precedes anything
    p12 = (3 + 2 * uni[2]) / (4 + 2)
    p23 = (2 + 2 * uni[3]) / (3 + 2)
    p25 = (0 + 2 * uni[5]) / (3 + 2)
    got = prior.nll(torch.tensor([[1, 2, 3], [1, 2, 5], [0, 1, 2]]))
    want = torch.stack(
        [-(p12.log() + p23.log()) / 2, -(p12.log() + p25.log()) / 2, -(uni[1].log() + p12.log()) / 2]
    )
    assert torch.allclose(got.double(), want, atol=1e-6)


def test_the_gpt2_prior_is_stored_and_reloaded_exactly(tmp_path, monkeypatch):
    stored = dataclasses.replace(GPT2, store=str(tmp_path))
    first = load_prior(stored)
    ids = torch.tensor([[101, 1996, 2143, 2001, 2307, 4569, 102]])
    (file,) = tmp_path.glob("lm-prior-*.safetensors")
    monkeypatch.setattr(lm_prior, "_MEMO", {})
    monkeypatch.setattr(lm_prior, "_train", lambda *a: pytest.fail("retrained instead of reloaded"))
    again = load_prior(stored)
    assert again is not first and torch.equal(again.nll(ids), first.nll(ids))
    with file.open("r+b") as f:  # a tensor's bytes changed to NaN: refused, not loaded
        raw = bytearray(f.read())
    (tmp_path / "nan").mkdir()
    nan_store = dataclasses.replace(stored, store=str(tmp_path / "nan"))
    header = 8 + int.from_bytes(raw[:8], "little")
    raw[header : header + 4] = bytes.fromhex("0000c07f")  # float32 NaN as the first value
    lm_prior._file(nan_store).write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="non-finite values"):
        load_prior(nan_store)
    other = dataclasses.replace(stored, seed=1)
    file.rename(lm_prior._file(other))  # a file under another key's name: refused, not trusted
    with pytest.raises(ValueError, match="written for other options"):
        load_prior(other)


def test_prior_options_are_checked():
    with pytest.raises(ValueError, match="multiple of heads"):
        LMPriorConfig(tokenizer="bert_tiny", width=30, heads=4)
    with pytest.raises(ValueError, match="prior tokenizer must be a text model's"):
        LMPriorConfig(tokenizer="nope")
