"""dager_masked: a low-rank completion of a pruned gradient's kept entries recovers a batch exact DAGER
refuses, and says where the kept entries no longer determine the batch's rank."""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks.text.dager.core import Dager
from gradleak.attacks.text.dager.masked import (
    DagerMasked,
    DagerMaskedConfig,
    complete,
    max_identifiable_rank,
)
from gradleak.attacks.text.family import FULL_SPAN_FRACTION, family_of, input_side_gradient
from gradleak.defenses.pruning import Pruning, PruningConfig
from gradleak.registry import ATTACKS
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import Observation


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grads(obs: Observation) -> list[torch.Tensor]:
    spec = family_of(obs.model)
    return [input_side_gradient(obs, obs.model, spec.attn_inputs, i) for i in (0, 1)]


def _pruned(tm, batch, ratio: float) -> Observation:
    update = fedsgd_text_update(tm.model, batch, "classification")
    if ratio > 0:
        update = Pruning(PruningConfig(ratio)).on_update(update)
    return Observation(tm.model, update, (batch.input_ids.shape[1],), 2)


def test_completion_restores_a_low_rank_matrix_from_a_random_share_of_its_entries():
    """A rank-3 30 x 40 matrix with 60 % of its entries kept at random (210 degrees of freedom, 720 kept):
    the rank-3 completion equals the matrix everywhere, the dropped entries included (relative error
    < 1e-6); rank 2 cannot fit the kept entries (fit > 1e-3)."""
    g = _gen(1)
    truth = torch.randn(30, 3, generator=g, dtype=torch.float64) @ torch.randn(
        3, 40, generator=g, dtype=torch.float64
    )
    kept = torch.rand(30, 40, generator=g) < 0.6
    seen = torch.where(kept, truth, torch.zeros_like(truth))
    cfg = DagerMaskedConfig()
    (a, b), fit = complete(seen, 3, cfg, tol=1e-12, iters=500)
    assert fit < 1e-10
    scale = float(seen.abs().max())  # the factors are those of the matrix over its largest kept entry
    assert float((scale * a @ b.T - truth).norm() / truth.norm()) < 1e-6
    _, fit2 = complete(seen, 2, cfg, tol=1e-12, iters=500)
    assert fit2 > 1e-3


@pytest.mark.parametrize(
    ("d", "k", "kept"), [(64, 192, 6144), (64, 192, 1229), (768, 2304, 884736), (8, 8, 3)]
)
def test_max_identifiable_rank_is_the_largest_rank_the_kept_entries_determine(d, k, kept):
    """Against the definition, rank by rank: r (d + k - r) <= kept / oversampling and r < 0.95 d."""
    expected = max(
        r for r in range(d + 1) if r * (d + k - r) <= kept / 1.2 and (r == 0 or r < FULL_SPAN_FRACTION * d)
    )
    assert max_identifiable_rank((d, k), kept, 1.2) == expected


def test_masked_dager_recovers_a_pruned_batch_where_exact_dager_refuses(gpt2_cls, make_batch):
    """50 % magnitude pruning (tiny GPT-2, B = 2): the zeroed entries make the attention gradient full rank
    and exact DAGER returns nothing; the completion finds the batch's rank (11 token inputs, the
    token bound B x padded length is 12, the identifiability bound 23) and recovers both sentences
    exactly. The batch's largest L2 residual to the completed span is 0.0048 (native, avx2 kernels) /
    0.0123 (default), the threshold 0.05: the kept entries' float32 rounding, amplified along weak
    directions, is what the margin covers."""
    batch = make_batch(gpt2_cls)
    obs = _pruned(gpt2_cls, batch, 0.5)
    exact = Dager().reconstruct(obs, generator=_gen())
    assert exact.token_ids == [] and exact.stats["span_full"] == 1.0
    rec = ATTACKS.create("dager_masked", max_positions=8).reconstruct(obs, generator=_gen())
    assert sorted(rec.token_ids) == sorted(batch.sequences())
    tokens = len({(t, p) for q in batch.sequences() for p, t in enumerate(q)})
    assert rec.stats["completion_rank_l1"] == rec.stats["rank_l1"] == tokens == 11
    assert (
        rec.stats["kept_l1"] == pytest.approx(0.5, abs=1e-3) and rec.stats["fit_l1"] < 1e-6
    )  # refined below rank_fit


def test_masked_dager_beyond_the_identifiable_rank_returns_nothing_and_says_so(gpt2_cls, make_batch):
    """90 % pruning keeps 1,229 of 12,288 entries: no rank above 4 is determined (4 x 252 = 1,008 <=
    1,229 / 1.2), below the batch's 11; nothing is returned and the stats carry the limit."""
    rec = DagerMasked(DagerMaskedConfig(max_positions=8)).reconstruct(
        _pruned(gpt2_cls, make_batch(gpt2_cls), 0.9), generator=_gen()
    )
    assert rec.token_ids == [] and rec.stats["completion_rank_l1"] == 0
    assert rec.stats["max_rank_l1"] == 4 and rec.stats["kept_l1"] == pytest.approx(0.1, abs=1e-3)


def test_a_dense_update_with_a_few_exact_zeros_gets_exact_dagers_spans(gpt2_cls, make_batch):
    """Three exact zeros in 12,288 entries (a dense float32 draw can hold one: the null baseline's did)
    are below ``min_dropped``: exact DAGER's span and thresholds, and the batch exactly."""
    batch = make_batch(gpt2_cls)
    obs = _pruned(gpt2_cls, batch, 0.0)
    name = "transformer.h.0.attn.c_attn.weight"
    holed = obs.update.tensors[name].clone()
    holed.view(-1)[[5, 700, 9000]] = 0.0
    obs = Observation(obs.model, obs.update.replace({**obs.update.tensors, name: holed}), obs.input_shape, 2)
    dense = DagerMasked(DagerMaskedConfig(max_positions=8))
    assert dense.spans(obs, dense.spec(obs.model), *_grads(obs))[2] == dense.spec(obs.model)  # thresholds
    rec = dense.reconstruct(obs, generator=_gen())
    assert sorted(rec.token_ids) == sorted(batch.sequences())
    # each hole is a rank-one perturbation: the exact span has 11 + 3 directions, and still passes the batch
    assert rec.stats["kept_l1"] == pytest.approx(1 - 3 / 12288) and rec.stats["completion_rank_l1"] == 14
    assert rec.stats["kept_l2"] == 1.0 and "max_rank_l1" not in rec.stats  # no completion ran


@pytest.mark.parametrize(
    "bad",
    [{"fit_tol": 0.0}, {"fit_tol": 1e-4, "rank_fit": 1e-5}, {"rank_fit": 1.0}, {"oversampling": 0.5},
     {"ridge": 0.0}, {"min_dropped": 0.0}, {"completed_l2_threshold": 1.0}, {"max_iters": 0},
     {"refine_iters": 0}, {"row_chunk": 0}],
)  # fmt: skip
def test_bad_completion_options_are_refused(bad):
    with pytest.raises(ValueError):
        DagerMaskedConfig(**bad)


def test_a_completion_that_cannot_be_computed_does_not_fit_rather_than_raise(monkeypatch):
    """A least-squares system that cannot be solved (the GPT-2 small run at 99 % pruning once hit a singular
    one) means the rank does not fit (fit inf), and the factors are the last good ones; so does a matrix
    that is all zeros. Nothing raises."""
    import gradleak.attacks.text.dager.masked as dm

    t = torch.randn(20, 30, generator=_gen(2), dtype=torch.float64)
    start = dm.svd_start(torch.linalg.svd(dm.normalised(t), full_matrices=False), 3)
    monkeypatch.setattr(dm, "_rows", lambda *args: None)
    factors, fit = complete(t, 3, DagerMaskedConfig(), tol=1e-12, iters=5, start=start)
    assert fit == float("inf") and factors[0] is start[0]
    monkeypatch.undo()
    assert complete(torch.zeros(20, 30), 3, DagerMaskedConfig(), tol=1e-12, iters=5)[1] == float("inf")


def test_the_fit_is_scale_free():
    """The same pruned rank-3 matrix at scale 1, 1e-160 and 1e160 (squares outside float64 at both ends):
    the same rank-3 fit."""
    g = _gen(4)
    truth = torch.randn(30, 3, generator=g, dtype=torch.float64) @ torch.randn(
        3, 40, generator=g, dtype=torch.float64
    )
    seen = torch.where(torch.rand(30, 40, generator=g) < 0.6, truth, torch.zeros_like(truth))
    fits = [complete(seen * c, 3, DagerMaskedConfig(), tol=1e-12, iters=50)[1] for c in (1.0, 1e-160, 1e160)]
    assert (
        fits[0] < 1e-8
        and fits[1] == pytest.approx(fits[0], rel=1e-6)
        and fits[2] == pytest.approx(fits[0], rel=1e-6)
    )
