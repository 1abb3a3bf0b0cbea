"""ROUGE, METEOR (offline WordNet), matching, perplexity, accuracy and F1."""

from __future__ import annotations

import math

import pytest
import torch

from gradleak.data import wordnet
from gradleak.metrics.text import match, meteor, rouge, score_texts
from gradleak.metrics.utility import accuracy, macro_f1, perplexity

# nltk's documented example (nltk/translate/meteor_score.py docstring): round(meteor_score(...), 4) == 0.6944
HYP1 = "It is a guide to action which ensures that the military always obeys the commands of the party"
REF1 = "It is a guide to action that ensures that the military will forever heed Party commands"


def _wordnet_or_skip():
    try:
        wordnet.ensure_wordnet()
    except wordnet.WordNetMissingError as err:
        pytest.skip(f"WordNet absent and cannot be prepared: {err}")


def test_meteor_matches_nltk_documented_value():
    _wordnet_or_skip()
    assert round(meteor(HYP1, REF1), 4) == 0.6944


def test_wordnet_missing_error_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADLEAK_WORDNET_DICT", str(tmp_path / "nowhere"))
    with pytest.raises(wordnet.WordNetMissingError, match="apt-get install wordnet-base"):
        wordnet.ensure_wordnet(target=tmp_path / "nltk")


def test_rouge_identity_and_disjoint():
    assert rouge("a b c d", "a b c d") == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    assert rouge("x y", "a b")["rouge1"] == 0.0
    assert rouge("b a", "a b")["rouge1"] == 1.0 and rouge("b a", "a b")["rouge2"] == 0.0


def test_matching_is_one_to_one_and_scores_average_over_references():
    refs = ["the cat sat on the mat", "a dog barked loudly"]
    hyps = ["a dog barked loudly", "the cat sat on the mat"]
    assert sorted(match(hyps, refs)) == [(0, 1), (1, 0)]
    s = score_texts(hyps, refs, with_meteor=False)
    assert s.rouge1 == 1.0 and s.exact == 1.0 and s.meteor is None
    half = score_texts(hyps[:1], refs, with_meteor=False)  # a missing reconstruction scores 0
    assert half.rouge1 == pytest.approx(0.5) and half.exact == pytest.approx(0.5)


def test_perplexity_of_uniform_model_is_vocab_size(gpt2_lm, make_batch):
    batch = make_batch(gpt2_lm)

    class Uniform(torch.nn.Module):
        def forward(self, input_ids, attention_mask, labels):
            from transformers.modeling_outputs import CausalLMOutput

            logits = torch.zeros((*input_ids.shape, 50), requires_grad=False)
            shift = labels[:, 1:].clamp_max(49).masked_fill(labels[:, 1:] < 0, -100)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), shift.reshape(-1))
            return CausalLMOutput(loss=loss, logits=logits)

    assert perplexity(Uniform(), [batch]) == pytest.approx(50.0, rel=1e-5)
    assert math.isfinite(perplexity(gpt2_lm.model, [batch]))


def test_accuracy_and_macro_f1():
    assert accuracy([1, 0, 1, 1], [1, 0, 0, 1]) == 0.75
    # class 1: tp 2 fp 1 fn 0 -> 0.8; class 0: tp 1 fp 0 fn 1 -> 2/3
    assert macro_f1([1, 0, 1, 1], [1, 0, 0, 1]) == pytest.approx((0.8 + 2 / 3) / 2)
