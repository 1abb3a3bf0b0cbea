"""dager_spectral: span tests above a known noise scale's bulk edge recover a batch exact DAGER refuses."""

from __future__ import annotations

import math

import pytest
import torch

from gradleak.attacks.text.dager.core import Dager
from gradleak.attacks.text.dager.spectral import DagerSpectral, DagerSpectralConfig, bulk_edge
from gradleak.attacks.text.family import family_of, input_side_gradient
from gradleak.defenses.baselines import BatchNoise, BatchNoiseConfig
from gradleak.registry import ATTACKS
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import AttackInputError, Observation, Update

# the batch's sentences have at most 6 tokens: 8 positions keep the scans short (the vocabulary's outliers
# pass the L1 test at every position, so the default 64 would all be scanned)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _noised(tm, batch, std: float, seed: int = 1) -> tuple[Observation, Observation]:
    """The clean FedSGD observation and the same gradient plus N(0, std^2) per entry (no metadata)."""
    update = fedsgd_text_update(tm.model, batch, "classification")
    g = _gen(seed)
    noisy = {n: t + std * torch.randn(t.shape, generator=g) for n, t in update.tensors.items()}
    shape = (batch.input_ids.shape[1],)
    return Observation(tm.model, update, shape, 2), Observation(tm.model, update.replace(noisy), shape, 2)


def test_bulk_edge_bounds_the_top_singular_value_of_pure_noise():
    """e = s (sqrt(d) + sqrt(k) + 6): 20 draws of 64 x 192 N(0, s^2) matrices all stay below it, and their
    largest singular value is within 5 % of s (sqrt(d) + sqrt(k)) (the Marchenko-Pastur edge)."""
    s, g = 3e-4, _gen()
    tops = torch.stack([torch.linalg.svdvals(s * torch.randn(64, 192, generator=g, dtype=torch.float64))[0]
                        for _ in range(20)])  # fmt: skip
    assert float(tops.max()) < bulk_edge((64, 192), s, 6.0)
    assert float(tops.mean()) == pytest.approx(s * (8 + math.sqrt(192)), rel=0.05)


@pytest.mark.parametrize("std", [1e-5, 3e-5])
def test_spectral_dager_recovers_the_batch_where_exact_dager_refuses(gpt2_cls, make_batch, std):
    """Noise whose bulk edge lies below every signal singular value of blocks 1 and 2 (asserted): exact DAGER
    sees a full-rank span and returns nothing; the spectral variant, told the noise scale, returns both
    sentences exactly."""
    batch = make_batch(gpt2_cls)
    clean, noisy = _noised(gpt2_cls, batch, std)
    spec = family_of(gpt2_cls.model)
    for layer in (0, 1):
        g = input_side_gradient(clean, gpt2_cls.model, spec.attn_inputs, layer)
        s = torch.linalg.svdvals(g)
        weakest = float(s[s > 1e-6 * s[0]][-1])  # the clean spectrum's smallest signal singular value
        assert bulk_edge(tuple(g.shape), std, 6.0) < weakest
    exact = Dager().reconstruct(noisy, generator=_gen())
    assert exact.token_ids == [] and exact.stats["span_full"] == 1.0
    spectral = DagerSpectral(DagerSpectralConfig(noise_std=std, max_positions=8))
    rec = spectral.reconstruct(noisy, generator=_gen())
    assert sorted(rec.token_ids) == sorted(batch.sequences())
    assert rec.stats["rank_l1"] == len({(t, p) for q in batch.sequences() for p, t in enumerate(q)})
    assert rec.stats["snr_l1"] > 1 and rec.stats["noise_std"] == std


def test_spectral_dager_reads_the_noise_scale_the_defense_states(gpt2_cls, make_batch):
    """batch_noise on a one-step FedSGD gradient states batch_noise/noise_std = sigma C / B; the registered
    attack reads it and recovers the batch (clip 1e6: no clipping, sigma 3e-5 x B = 1)."""
    batch = make_batch(gpt2_cls)
    noise = BatchNoise(BatchNoiseConfig(clip=1e6, sigma=3e-5 / 1e6, batch_size=1))
    update = fedsgd_text_update(gpt2_cls.model, batch, "classification", defenses=[noise], generator=_gen(1))
    assert update.metadata["batch_noise/noise_std"] == pytest.approx(3e-5)
    obs = Observation(gpt2_cls.model, update, (batch.input_ids.shape[1],), 2)
    rec = ATTACKS.create("dager_spectral", max_positions=8).reconstruct(obs, generator=_gen())
    assert sorted(rec.token_ids) == sorted(batch.sequences())


def test_a_stated_noise_scale_of_zero_is_exact_dager(gpt2_cls, make_batch):
    """dp_sgd with clipping only states noise_std 0: the spans are exact and so is the recovery."""
    batch = make_batch(gpt2_cls)
    clean, _ = _noised(gpt2_cls, batch, 1e-5)
    stated = Observation(clean.model, clean.update.replace(dict(clean.update.tensors)), clean.input_shape, 2)
    stated.update.metadata["dp_sgd/noise_std"] = 0.0
    rec = ATTACKS.create("dager_spectral", max_positions=8).reconstruct(stated, generator=_gen())
    assert sorted(rec.token_ids) == sorted(batch.sequences()) and rec.stats["noise_std"] == 0.0


def test_spectral_dager_above_its_reach_returns_nothing_and_says_how_far(gpt2_cls, make_batch):
    """Noise far above the signal (edge > the largest singular value): nothing kept, nothing returned, and
    the SNR against the edge recorded below 1."""
    _, noisy = _noised(gpt2_cls, make_batch(gpt2_cls), 0.1)
    rec = DagerSpectral(DagerSpectralConfig(noise_std=0.1)).reconstruct(noisy, generator=_gen())
    assert rec.token_ids == [] and rec.stats["rank_l1"] == 0 and rec.stats["snr_l1"] < 1


def test_spectral_dager_without_a_noise_scale_is_refused(gpt2_cls, make_batch):
    _, noisy = _noised(gpt2_cls, make_batch(gpt2_cls), 1e-5)
    with pytest.raises(AttackInputError, match="noise_std"):
        DagerSpectral().reconstruct(noisy, generator=_gen())
    for bad in ({"noise_std": 0.0}, {"noise_std": math.inf}, {"tail": -1.0}, {"scale": 0.0},
                {"max_threshold": 1.0}, {"whiten": -0.1}, {"whiten": 2.0}):  # fmt: skip
        with pytest.raises(ValueError):
            DagerSpectralConfig(**bad)


def test_the_outlier_rule_passes_an_input_far_below_the_reference_that_its_bound_alone_rejects():
    """outlier_scores: a vector with residual 0.3 to a 4-dimensional span of R^64 fails its first-order
    bound (about 0.002 here) but lies far below random vectors' residuals (~0.97 +- 0.02): it scores below
    1 (passes); a random vector scores about 1 / (1 - 5 sd / mean) > 1 (fails); with a bound above its
    residual the bound alone passes it."""
    from gradleak.attacks.text.dager.spectral import NoisySpan, outlier_scores

    g = _gen(3)
    basis, _ = torch.linalg.qr(torch.randn(64, 4, generator=g, dtype=torch.float64))
    span = NoisySpan(basis, torch.ones(4, dtype=torch.float64), edge=0.5, noise_std=1e-4, tail=6.0,
                     scale=1.0, floor=1e-3, cap=0.5)  # fmt: skip
    inside = basis @ torch.randn(4, generator=g, dtype=torch.float64)
    off = torch.randn(64, generator=g, dtype=torch.float64)
    off = off - basis @ (basis.T @ off)
    near = inside / inside.norm() * (1 - 0.3**2) ** 0.5 + off / off.norm() * 0.3  # residual exactly 0.3
    reference = torch.randn(512, 64, generator=g, dtype=torch.float64)
    assert float(span.raw_residual(near[None])[0]) == pytest.approx(0.3, rel=1e-9)
    assert float(span.residual(near[None])[0]) > 1  # its bound alone rejects it
    scores = outlier_scores(span, torch.stack([near, reference[0]]), 5.0, reference)
    assert float(scores[0]) < 1 < float(scores[1])
    loose = NoisySpan(basis, torch.ones(4, dtype=torch.float64), 0.5, 1e-2, 6.0, 100.0, 1e-3, 0.5)
    assert float(loose.residual(near[None])[0]) == pytest.approx(0.3 / 0.5)  # capped bound 0.5 > 0.3: passes


def test_the_whitened_l1_reference_passes_a_batch_an_anisotropic_vocabulary_hides():
    """outlier_scores at L1 (the vocabulary its own reference; module docstring, "Whitened L1 reference"):
    2,000 inputs in R^64 with a common direction and standard deviations from 100 down to 0.1 along a
    random basis (a trained model's anisotropic embeddings, SmolLM2's in the module docstring); the span
    of 12 of them, each moved by N(0, 3^2) per entry (the directions the noise hides), holds their strong
    directions, so every input is mostly inside it. The vocabulary's plain residuals spread (about
    0.52 +- 0.11, measured), mean - 5 sd falls below zero and the plain rule passes none of the 12 batch
    inputs; whitened by the inputs' second moments they cluster (about 0.82 +- 0.06) and all 12 pass, the
    batch's largest at about 0.44, with at most 2 of the 1,988 others (none measured)."""
    from gradleak.attacks.text.dager.spectral import NoisySpan, outlier_scores, whitened_residual

    g = _gen(0)
    d, n, k = 64, 2000, 12
    mu = torch.randn(d, generator=g, dtype=torch.float64)
    rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    spread = torch.logspace(2, -1, d, dtype=torch.float64)
    z = 3 * mu / mu.norm() + (torch.randn(n, d, generator=g, dtype=torch.float64) * spread) @ rotation.T
    moved = z[:k] + 3.0 * torch.randn(k, d, generator=g, dtype=torch.float64)
    basis, _ = torch.linalg.qr(moved.T)
    # bounds of 1e-3 (noise_std 1e-12): the outlier rule decides
    span = NoisySpan(basis, torch.ones(k, dtype=torch.float64), edge=1.0, noise_std=1e-12, tail=6.0,
                     scale=1.0, floor=1e-3, cap=0.5)  # fmt: skip
    assert bool((span.raw_residual(z[:k]) > 1e-2).all())  # no batch input passes its bound
    plain = outlier_scores(span, z, 5.0) < 1
    white = outlier_scores(span, z, 5.0, whiten=1e-2) < 1
    assert int(plain[:k].sum()) == 0 and int(plain[k:].sum()) == 0
    assert int(white[:k].sum()) == k and int(white[k:].sum()) <= 2
    # the whitening is the map it says: a vector of the span maps into W S (residual ~0: float32 products,
    # so the square root of rounding, 4e-4 measured), a vector off the span does not
    inside = basis @ torch.randn(k, generator=g, dtype=torch.float64)
    off = torch.randn(d, generator=g, dtype=torch.float64)
    off = off - basis @ (basis.T @ off)
    both = whitened_residual(span, torch.cat([z, inside[None], off[None]]), 1e-2)
    assert float(both[-2]) < 2e-3 and float(both[-1]) > 0.1
    # the attack's block-1 test applies its config's whitening (default 1e-2; 0: the plain rule)
    whitened, _ = DagerSpectral().l1_test(span, z, 1.0)
    plain_ids, _ = DagerSpectral(DagerSpectralConfig(whiten=0.0)).l1_test(span, z, 1.0)
    assert set(range(k)) <= set(whitened.tolist()) and len(whitened) <= k + 2 and plain_ids.numel() == 0


def test_averaging_views_brings_the_bulk_edge_under_the_signal(gpt2_cls, make_batch):
    """100 views of the batch's gradient, each with its own N(0, (3e-4)^2) draw (stated as batch_noise
    does): one view's bulk edge lies above the weakest signal singular values (measured: 9 of the 11
    input directions of block 1 above it) and the spectral attack returns nothing; the views' mean has the
    noise of one view at 3e-5, which it recovers exactly (as in
    test_spectral_dager_recovers_the_batch_where_exact_dager_refuses)."""
    batch = make_batch(gpt2_cls)
    update = fedsgd_text_update(gpt2_cls.model, batch, "classification")
    g = _gen(5)
    views = tuple(
        Update(
            {n: t + 3e-4 * torch.randn(t.shape, generator=g) for n, t in update.tensors.items()},
            update.num_samples,
            update.kind,
            {"batch_noise/noise_std": 3e-4},
        )  # fmt: skip
        for _ in range(100)
    )
    obs = Observation(gpt2_cls.model, views[0], (batch.input_ids.shape[1],), 2, views=views[1:])
    one = ATTACKS.create("dager_spectral", max_positions=8).reconstruct(obs, generator=_gen())
    distinct = len({(t, p) for q in batch.sequences() for p, t in enumerate(q)})
    assert one.token_ids == [] and one.stats["rank_l1"] < distinct and one.stats["views_averaged"] == 1.0
    mean = ATTACKS.create("dager_spectral", max_positions=8, average_views=True)
    rec = mean.reconstruct(obs, generator=_gen())
    assert sorted(rec.token_ids) == sorted(batch.sequences())
    assert rec.stats["views_averaged"] == 100.0 and rec.stats["noise_std"] == pytest.approx(3e-5, rel=1e-9)
