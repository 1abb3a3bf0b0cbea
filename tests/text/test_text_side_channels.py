"""Embedding-norm, LM-head and MLP-SVD side channels, the null baseline and the validity gate (paper 002)."""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks.text.baseline import is_blocked, is_valid, null_observation
from gradleak.metrics.text import score_token_set
from gradleak.registry import ATTACKS
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import AttackInputError, Observation


def _observe(tm, batch, task):
    return Observation(tm.model, fedsgd_text_update(tm.model, batch, task), (batch.input_ids.shape[1],), 2)


def _gen():
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("fixture", ["gpt2_cls", "bert_cls"])
def test_embedding_norm_recovers_exact_token_set(request, make_batch, fixture):
    tm = request.getfixturevalue(fixture)
    batch = make_batch(tm)
    rec = ATTACKS.create("embedding_norm").reconstruct(
        _observe(tm, batch, "classification"), generator=_gen()
    )
    assert set(rec.token_ids[0]) == {t for s in batch.sequences() for t in s}
    assert len(rec.token_ids[0]) == len(set(rec.token_ids[0]))


def test_embedding_norm_on_tied_causal_lm_still_finds_the_input_tokens(gpt2_lm, make_batch):
    batch = make_batch(gpt2_lm)
    rec = ATTACKS.create("embedding_norm").reconstruct(
        _observe(gpt2_lm, batch, "causal_lm"), generator=_gen()
    )
    assert set(rec.token_ids[0]) == {t for s in batch.sequences() for t in s}


def test_lm_head_probe_recovers_target_tokens_of_untied_head(gpt2_lm_untied, make_batch):
    batch = make_batch(gpt2_lm_untied)
    rec = ATTACKS.create("lm_head_probe").reconstruct(
        _observe(gpt2_lm_untied, batch, "causal_lm"), generator=_gen()
    )
    assert set(rec.token_ids[0]) == {t for s in batch.sequences() for t in s[1:]}


def test_lm_head_probe_refuses_tied_head_and_classifiers(gpt2_lm, gpt2_cls, make_batch):
    with pytest.raises(AttackInputError, match="tied"):
        ATTACKS.create("lm_head_probe").reconstruct(
            _observe(gpt2_lm, make_batch(gpt2_lm), "causal_lm"), generator=_gen()
        )
    with pytest.raises(AttackInputError, match="LM head"):
        ATTACKS.create("lm_head_probe").reconstruct(
            _observe(gpt2_cls, make_batch(gpt2_cls), "classification"), generator=_gen()
        )


def test_mlp_svd_is_a_valid_probe_and_null_scores_near_zero(gpt2_cls, make_batch):
    batch = make_batch(gpt2_cls)
    obs = _observe(gpt2_cls, batch, "classification")

    def r1(rec):
        return score_token_set(rec.token_ids[0], batch.sequences(), gpt2_cls.tokenizer).rouge1

    attack = ATTACKS.create("mlp_svd")
    rec = attack.reconstruct(obs, generator=_gen())
    null_r1 = r1(attack.reconstruct(null_observation(obs, _gen()), generator=_gen()))
    first_tokens = {s[0] for s in batch.sequences()}
    assert first_tokens <= set(rec.token_ids[0])  # exact for each sequence's first token
    assert null_r1 < 0.05
    assert is_valid(r1(rec), null_r1) and r1(rec) > 0.3


@pytest.mark.parametrize("attack", ["embedding_norm", "mlp_svd", "dager"])
def test_null_baseline_scores_near_zero(gpt2_cls, make_batch, attack):
    batch = make_batch(gpt2_cls)
    obs = null_observation(_observe(gpt2_cls, batch, "classification"), _gen())
    rec = ATTACKS.create(attack).reconstruct(obs, generator=_gen())
    tokens = [t for s in rec.token_ids for t in s]
    assert score_token_set(tokens, batch.sequences(), gpt2_cls.tokenizer).rouge1 < 0.05


def test_null_observation_matches_norms_and_shapes(gpt2_cls, make_batch):
    obs = _observe(gpt2_cls, make_batch(gpt2_cls), "classification")
    null = null_observation(obs, _gen())
    for name, t in obs.update.tensors.items():
        z = null.update.tensors[name]
        assert z.shape == t.shape
        assert float(z.norm()) == pytest.approx(float(t.norm()), rel=1e-4, abs=1e-12)
        if float(t.norm()) > 0:
            assert not torch.equal(z, t)


def test_validity_gate_and_blocking_rule():
    assert is_valid(0.5, 0.1) and not is_valid(0.09, 0.0) and not is_valid(0.2, 0.16)
    assert is_blocked(0.04, 0.0) and is_blocked(0.1, 0.06) and not is_blocked(0.2, 0.0)
