"""Text loaders (real files under the data root), seeded splits and <= 64-token encoding."""

from __future__ import annotations

import pytest

from gradleak.data.root import DataFileMissingError
from gradleak.data.text import (
    MAX_TOKENS,
    encode,
    load_emotion,
    load_financial_phrasebank,
    load_rotten_tomatoes,
    load_text_dataset,
    load_wikitext2,
    sample,
    split,
)
from gradleak.registry import DATASETS


def test_loaders_read_the_real_files():
    rt = load_rotten_tomatoes()
    assert len(rt) == 10662 and rt.num_labels == 2 and sum(rt.labels) == 5331
    assert len(load_financial_phrasebank("AllAgree")) == 2264
    emo = load_emotion("val")
    assert len(emo) == 2000 and set(emo.labels) == set(range(6))
    wiki = load_wikitext2("valid")
    assert len(wiki) > 1000 and wiki.labels is None and not any(t.startswith("=") for t in wiki.texts)
    text = {e.name for e in DATASETS if e.modality == "text"}
    assert text == {"rotten_tomatoes", "wikitext2", "financial_phrasebank", "emotion"}
    assert len(load_text_dataset("emotion", split="test", limit=5)) == 5


def test_missing_file_and_bad_split_are_clear(tmp_path):
    with pytest.raises(DataFileMissingError, match="rt-polarity"):
        load_rotten_tomatoes(root=tmp_path)
    with pytest.raises(ValueError, match="train split is not available"):
        load_wikitext2("train")


def test_seeded_split_is_reproducible_and_disjoint():
    ds = load_financial_phrasebank(limit=200)
    a1, b1 = split(ds, [0.8, 0.2], seed=3)
    a2, _ = split(ds, [0.8, 0.2], seed=3)
    a3, _ = split(ds, [0.8, 0.2], seed=4)
    assert a1.texts == a2.texts and a1.texts != a3.texts
    assert len(a1) == 160 and len(b1) == 40 and not set(a1.texts) & set(b1.texts) - set(ds.texts[:0])
    assert sample(ds, 5, seed=1).texts == sample(ds, 5, seed=1).texts


def test_encode_truncates_and_pads(gpt2_cls):
    long = " ".join(["word"] * 200)
    batch = encode([long, "short text"], gpt2_cls.tokenizer, labels=[0, 1])
    assert batch.input_ids.shape == (2, MAX_TOKENS)
    assert (
        batch.attention_mask[1].sum() == 2
        and batch.sequences()[1] == gpt2_cls.tokenizer("short text").input_ids
    )
    assert encode([long], gpt2_cls.tokenizer, max_tokens=32).input_ids.shape == (1, 32)
    with pytest.raises(ValueError, match="max_tokens"):
        encode(["x"], gpt2_cls.tokenizer, max_tokens=65)
