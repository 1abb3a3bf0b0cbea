"""AEGIS (paper 002): attention freeze, embedding/MLP/norm flooding, identity limit, exported == used."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradleak.attacks  # noqa: F401  (registers the attacks)
from gradleak.defenses import Defense, DefenseFailure
from gradleak.defenses.aegis_llm import AegisLLM, AegisLLMConfig, flood, row_norms
from gradleak.metrics.text import score_token_set
from gradleak.registry import ATTACKS, DEFENSES
from gradleak.tasks.text_client import fedavg_text_update, fedsgd_text_update
from gradleak.types import AttackInputError, Observation

ATTN = {
    "gpt2": ("attn.c_attn", "attn.c_proj"),
    "bert": ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"),
}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _is_attention(name: str, family: str) -> bool:
    return any(f".{part}." in name for part in ATTN[family])


@pytest.mark.parametrize("fixture", ["gpt2_lm", "bert_cls"])
def test_attention_gradients_exactly_zero_and_weights_unchanged(request, make_batch, fixture):
    tm = request.getfixturevalue(fixture)
    batch = make_batch(tm)
    grad = fedsgd_text_update(tm.model, batch, tm.task, defenses=[AegisLLM()], generator=_gen())
    delta = fedavg_text_update(
        tm.model,
        [batch],
        tm.task,
        lr=1e-3,
        epochs=3,
        optimizer="adamw",
        defenses=[AegisLLM()],
        generator=_gen(),
    )
    attn = [n for n in grad.tensors if _is_attention(n, tm.family)]
    assert len(attn) == (8 if tm.family == "gpt2" else 16)  # 2 blocks x (weight, bias) x projections
    for n in attn:
        assert torch.count_nonzero(grad.tensors[n]) == 0, n
        assert torch.count_nonzero(delta.tensors[n]) == 0, n
    mlp = next(n for n in delta.tensors if "c_fc.weight" in n or "intermediate.dense.weight" in n)
    assert delta.tensors[mlp].abs().max() > 0  # the rest of the model did train
    assert all(p.requires_grad for p in tm.model.parameters())  # the broadcast model is not touched


def test_every_embedding_row_nonzero_after_flooding(gpt2_cls, make_batch):
    batch = make_batch(gpt2_cls)
    plain = fedsgd_text_update(gpt2_cls.model, batch, "classification").tensors["transformer.wte.weight"]
    assert (plain.norm(dim=1) > 0).sum() == len({t for s in batch.sequences() for t in s})  # sparse before
    grad = fedsgd_text_update(
        gpt2_cls.model, batch, "classification", defenses=[AegisLLM()], generator=_gen()
    )
    rows = grad.tensors["transformer.wte.weight"].norm(dim=1)
    assert rows.numel() == 50257 and bool((rows > 0).all())


def test_embedding_flood_std_matches_lambda_times_mean_active_row_norm(gpt2_cls, make_batch):
    batch = make_batch(gpt2_cls)
    name = "transformer.wte.weight"
    plain = fedsgd_text_update(gpt2_cls.model, batch, "classification").tensors[name]
    norms = plain.norm(dim=1)
    m_bar = float(norms[norms > 0].mean())  # every nonzero row is a batch token here
    cfg = AegisLLMConfig(lam=2.0)
    grad = fedsgd_text_update(
        gpt2_cls.model, batch, "classification", defenses=[AegisLLM(cfg)], generator=_gen()
    )
    absent = grad.tensors[name][norms == 0]  # ~50k rows x 64 entries of pure noise
    assert float(absent.std()) == pytest.approx(2.0 * m_bar, rel=0.01)
    assert float(absent.mean()) == pytest.approx(0.0, abs=0.01 * m_bar)
    present = norms > 0
    signal = grad.tensors[name][present] - cfg.rho * plain[present]
    assert float(signal.std()) == pytest.approx(2.0 * m_bar, rel=0.15)  # ~40 rows: looser


def test_mlp_flood_rows_are_input_features_and_rho_fc_zero_leaves_pure_noise(gpt2_cls, make_batch):
    batch = make_batch(gpt2_cls)
    name = "transformer.h.0.mlp.c_fc.weight"  # Conv1D: stored (in = 64, out = 256)
    plain = fedsgd_text_update(gpt2_cls.model, batch, "classification").tensors[name]
    m_bar = float(plain.norm(dim=1).mean())
    grad = fedsgd_text_update(
        gpt2_cls.model, batch, "classification", defenses=[AegisLLM()], generator=_gen()
    )
    out = grad.tensors[name]
    assert float(out.std()) == pytest.approx(8.0 * m_bar, rel=0.02)
    corr = torch.nn.functional.cosine_similarity(out.reshape(-1), plain.reshape(-1), dim=0)
    assert abs(float(corr)) < 0.02  # no retained signal at rho_fc = 0


def test_mlp_blocks_floods_the_named_blocks_only(gpt2_cls, make_batch):
    """mlp_blocks = [1]: block 1's MLP is pure noise as under AEGIS, every later block's MLP gradient leaves
    as the undefended one (attention frozen does not change an MLP gradient); a block the model lacks is
    refused before any step."""
    batch = make_batch(gpt2_cls)
    blocks = gpt2_cls.model.config.n_layer
    assert blocks >= 2
    plain = fedsgd_text_update(gpt2_cls.model, batch, "classification").tensors
    cfg = AegisLLMConfig(mlp_blocks=(1,))
    out = fedsgd_text_update(
        gpt2_cls.model, batch, "classification", defenses=[AegisLLM(cfg)], generator=_gen()
    ).tensors
    first = "transformer.h.0.mlp.c_fc.weight"
    m_bar = float(plain[first].norm(dim=1).mean())
    assert float(out[first].std()) == pytest.approx(8.0 * m_bar, rel=0.02)
    for i in range(1, blocks):
        for part in ("c_fc", "c_proj"):
            for kind in ("weight", "bias"):
                name = f"transformer.h.{i}.mlp.{part}.{kind}"
                assert torch.allclose(out[name], plain[name], rtol=0, atol=1e-7), name
    with pytest.raises((DefenseFailure, ValueError), match="mlp_blocks"):
        fedsgd_text_update(
            gpt2_cls.model, batch, "classification",
            defenses=[AegisLLM(AegisLLMConfig(mlp_blocks=(blocks + 1,)))], generator=_gen(),
        )  # fmt: skip
    for bad in ((0,), (1, 1), (True,)):
        with pytest.raises(ValueError, match="mlp_blocks"):
            AegisLLMConfig(mlp_blocks=bad)


def test_flood_helper_against_reference_loop():
    g = torch.zeros(6, 4)
    g[1] = torch.tensor([3.0, 0.0, 4.0, 0.0])  # norm 5
    g[4] = torch.tensor([0.0, 1.0, 0.0, 0.0])  # norm 1
    g[5, 0] = 1e-4  # below the relative-norm rule (1e-2 x 5): treated as absent
    out, m_bar = flood(g, lam=0.5, rho=0.3, rows="dim0", generator=_gen(3))
    assert m_bar == pytest.approx(3.0)
    noise = torch.randn(g.shape, generator=_gen(3)) * (0.5 * 3.0)
    expected = noise.clone()
    expected[1] += 0.3 * g[1]
    expected[4] += 0.3 * g[4]
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.allclose(row_norms(g.T.contiguous(), "dim1"), row_norms(g, "dim0"))
    zero, m0 = flood(torch.zeros(3, 2), lam=1.0, rho=0.3, rows="dim0", generator=_gen())
    assert m0 == 0.0 and torch.count_nonzero(zero) == 0


def test_rho_one_lambda_zero_is_the_identity(gpt2_lm_untied, make_batch):
    tm = gpt2_lm_untied
    batch = make_batch(tm)
    cfg = AegisLLMConfig(
        lam=0.0,
        rho=1.0,
        lam_fc=0.0,
        rho_fc=1.0,
        lam_ln=0.0,
        rho_ln=1.0,
        active_rel_tol=0.0,
        freeze_attention=False,
    )
    plain = fedsgd_text_update(tm.model, batch, "causal_lm")
    defended = fedsgd_text_update(tm.model, batch, "causal_lm", defenses=[AegisLLM(cfg)], generator=_gen())
    assert plain.tensors.keys() == defended.tensors.keys()
    for n, t in plain.tensors.items():
        assert torch.equal(t, defended.tensors[n]), n


def test_exported_gradient_is_what_the_optimiser_used(gpt2_lm_untied, make_batch):
    tm = gpt2_lm_untied
    batch = make_batch(tm)
    lr = 0.01
    grad = fedsgd_text_update(tm.model, batch, "causal_lm", defenses=[AegisLLM()], generator=_gen(5))
    delta = fedavg_text_update(
        tm.model,
        [batch],
        "causal_lm",
        lr=lr,
        epochs=1,
        optimizer="sgd",
        defenses=[AegisLLM()],
        generator=_gen(5),
    )
    assert "lm_head.weight" in grad.tensors
    for n, g in grad.tensors.items():
        assert torch.allclose(delta.tensors[n], -lr * g, rtol=1e-4, atol=1e-7), n
    head = grad.tensors["lm_head.weight"].norm(dim=1)
    assert bool((head > 0).all())  # the untied head is flooded too


class _PoisonGradient(Defense):
    name = "poison"

    def on_gradients(self, model: nn.Module, step: int) -> None:
        next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("inf"))


def test_non_finite_step_is_skipped_in_fedavg_and_fails_closed_in_fedsgd(gpt2_cls, make_batch):
    batch = make_batch(gpt2_cls)
    aegis = AegisLLM()
    delta = fedavg_text_update(
        gpt2_cls.model,
        [batch],
        "classification",
        lr=0.1,
        defenses=[_PoisonGradient(), aegis],
        generator=_gen(),
    )
    assert aegis.skipped_steps == 1
    assert all(torch.count_nonzero(t) == 0 for t in delta.tensors.values())  # the only step was skipped
    with pytest.raises(DefenseFailure, match="nothing is sent"):
        fedsgd_text_update(gpt2_cls.model, batch, "classification", defenses=[_PoisonGradient(), AegisLLM()])


def test_unknown_architecture_fails_closed(make_batch, gpt2_cls):
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = gpt2_cls.model

        def forward(self, **kw):
            return self.inner(**kw)

    with pytest.raises(DefenseFailure, match="no parameter map"):
        fedsgd_text_update(Plain(), make_batch(gpt2_cls), "classification", defenses=[AegisLLM()])


def test_config_rejects_bad_values_and_registry_builds_it():
    with pytest.raises(ValueError, match="lam_fc"):
        AegisLLMConfig(lam_fc=-1.0)
    with pytest.raises(ValueError, match="active_rel_tol"):
        AegisLLMConfig(active_rel_tol=1.0)
    d = DEFENSES.create("aegis_llm", flood_mlp=False)
    assert isinstance(d, AegisLLM) and not d.config.flood_mlp


def test_attacks_blocked_on_defended_gradient(gpt2_cls, make_batch):
    """Undefended: DAGER exact and embedding-norm recovers the token set; defended: DAGER has no channel
    left (zero attention gradient) and the embedding-norm probe falls to the null regime."""
    batch = make_batch(gpt2_cls)
    seq_len = (batch.input_ids.shape[1],)
    grad = fedsgd_text_update(
        gpt2_cls.model, batch, "classification", defenses=[AegisLLM()], generator=_gen()
    )
    obs = Observation(gpt2_cls.model, grad, seq_len, 2)
    with pytest.raises(AttackInputError, match="attention gradient is zero"):
        ATTACKS.create("dager").reconstruct(obs, generator=_gen())
    rec = ATTACKS.create("embedding_norm").reconstruct(obs, generator=_gen())
    tok = gpt2_cls.tokenizer
    r1 = score_token_set(rec.token_ids[0], batch.sequences(), tok).rouge1
    assert r1 <= 0.05
    plain = Observation(
        gpt2_cls.model, fedsgd_text_update(gpt2_cls.model, batch, "classification"), seq_len, 2
    )
    rec0 = ATTACKS.create("embedding_norm").reconstruct(plain, generator=_gen())
    assert score_token_set(rec0.token_ids[0], batch.sequences(), tok).rouge1 >= 0.9
