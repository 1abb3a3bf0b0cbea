"""embedding_norm_noise / lm_head_noise: the row-norm side channels read above the noise edge (issue 21,
item 2: AEGIS's remaining channels, the embedding rows and an untied head, under a noise-tolerant test)."""

from __future__ import annotations

import math

import pytest
import torch

from gradleak.attacks.text.rownorm import NoisyRowNormConfig, noise_edge
from gradleak.defenses.aegis_llm import AegisLLM, AegisLLMConfig
from gradleak.defenses.baselines import BatchNoise, BatchNoiseConfig
from gradleak.registry import ATTACKS
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import Observation


def _observe(tm, batch, task, defenses) -> Observation:
    update = fedsgd_text_update(tm.model, batch, task, defenses=defenses,
                                generator=torch.Generator().manual_seed(1))  # fmt: skip
    return Observation(tm.model, update, (batch.input_ids.shape[1],), 2)


def _noise(std: float) -> BatchNoise:
    """N(0, std^2) per entry, unclipped (clip 1e6 times sigma), its scale stated in the update."""
    return BatchNoise(BatchNoiseConfig(clip=1e6, sigma=std * 1e-6, batch_size=1))


def test_no_row_of_pure_noise_passes_the_edge_and_the_largest_sits_where_theory_puts_it():
    """20,000 rows of 64 i.i.d. N(0, 0.5^2) entries: none above s (sqrt(64) + 6); the largest row norm over
    the edge is about (8 + sqrt(ln 20000)) / 14 = 0.79 (the max of 20,000 chi_64 / sqrt(2) normals), within
    0.05 (measured 0.79)."""
    rows = 0.5 * torch.randn(20000, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    edge = noise_edge(64, 0.5, 6.0)
    assert edge == pytest.approx(0.5 * 14)
    top = float(rows.norm(dim=1).max())
    assert top < edge
    assert top / edge == pytest.approx((8 + math.sqrt(math.log(20000))) / 14, abs=0.05)


def test_under_stated_noise_the_probe_reads_every_batch_token_the_gap_rule_misses(gpt2_cls, make_batch):
    """The tiny GPT-2 classifier's embedding gradient (11 batch tokens, rows of norm 0.22-2.53 over d = 64)
    under N(0, 0.01^2) per entry: the plain gap rule cuts at the largest ratio between neighbouring rows,
    which is now inside the batch, and returns 2 tokens; the probe that knows the noise keeps every row above
    the edge 0.14: all 11 batch tokens and nothing else (SNR 18)."""
    batch = make_batch(gpt2_cls)
    tokens = {t for q in batch.sequences() for t in q}
    obs = _observe(gpt2_cls, batch, "classification", [_noise(0.01)])
    plain = ATTACKS.create("embedding_norm").reconstruct(obs, generator=torch.Generator())
    rec = ATTACKS.create("embedding_norm_noise").reconstruct(obs, generator=torch.Generator())
    assert len(tokens) == 11 and len(set(plain.token_ids[0]) & tokens) <= 3  # measured: 2
    assert set(rec.token_ids[0]) == tokens
    assert rec.stats["noise_std"] == pytest.approx(0.01) and rec.stats["noise_estimated"] == 0.0
    assert rec.stats["snr"] > 10


@pytest.mark.parametrize(("fixture", "task", "attack"), [
    ("gpt2_cls", "classification", "embedding_norm_noise"),
    ("gpt2_lm_untied", "causal_lm", "embedding_norm_noise"),
    ("gpt2_lm_untied", "causal_lm", "lm_head_noise"),
])  # fmt: skip
def test_aegis_flood_leaves_the_rows_at_pure_noise_and_the_probe_says_so(request, make_batch, fixture, task,
                                                                          attack):  # fmt: skip
    """AEGIS at the paper's settings (embedding and untied head: lambda 1, rho 0.3): the flood's scale,
    estimated from the table, puts the largest row at pure noise's ratio to the edge (0.8 at d = 64, V =
    50,257; measured 0.77-0.78), so the probe returns nothing; the plain rule returns rows anyway, none of
    them a batch token (measured 1 for the embedding, 7 for the head)."""
    tm = request.getfixturevalue(fixture)
    batch = make_batch(tm)
    obs = _observe(tm, batch, task, [AegisLLM(AegisLLMConfig())])
    plain = ATTACKS.create(attack.replace("_noise", "_probe" if "head" in attack else "")).reconstruct(
        obs, generator=torch.Generator()
    )
    assert plain.token_ids[0] and not set(plain.token_ids[0]) & {t for q in batch.sequences() for t in q}
    rec = ATTACKS.create(attack).reconstruct(obs, generator=torch.Generator())
    assert rec.token_ids == [[]] and rec.stats["tokens"] == 0.0 and rec.stats["noise_estimated"] == 1.0
    assert 0.7 < rec.stats["snr"] < 0.9


def test_a_clean_gradient_gives_the_exact_rows():
    """Without noise the estimated scale of a table whose other rows are exactly zero is 0: the edge is 0 and
    the probe returns exactly the nonzero rows, as the plain rule does."""
    from gradleak.data.text import encode
    from gradleak.models.text import build_gpt2

    tm = build_gpt2("tiny", "classification", seed=0)
    batch = encode(["the movie was surprisingly good"], tm.tokenizer, labels=[1])
    obs = _observe(tm, batch, "classification", [])
    rec = ATTACKS.create("embedding_norm_noise").reconstruct(obs, generator=torch.Generator())
    assert set(rec.token_ids[0]) == set(batch.sequences()[0]) and rec.stats["edge"] == 0.0


@pytest.mark.parametrize(("options", "match"), [({"noise_std": 0.0}, "noise_std"), ({"tail": -1.0}, "tail"),
                                                ({"noise_std": math.inf}, "noise_std")])  # fmt: skip
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        NoisyRowNormConfig(**options)
