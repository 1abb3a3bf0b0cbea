"""dp_sgd (Opacus) on transformers models: per-sample clipping against a slow per-sample loop."""

from __future__ import annotations

import math

import pytest
import torch

from gradleak.defenses.dp_sgd import DPSGD, DPSGDConfig


@pytest.mark.parametrize("fixture", ["gpt2_cls", "bert_cls"])
def test_text_models_per_sample_clipping_matches_the_loop(request, make_batch, fixture):
    """Transformers models in eval mode (no dropout): position ids looked up once for the batch are
    split per sample, GPT-2's Conv1D goes through Opacus' functorch path."""
    from gradleak.data.text import TextBatch
    from gradleak.tasks import text_loss
    from gradleak.tasks.text_client import fedsgd_text_update

    tm = request.getfixturevalue(fixture)
    batch = make_batch(tm)
    clip = 1e-3
    defense = DPSGD(DPSGDConfig(clip=clip, noise_multiplier=0.0, sample_rate=0.01))
    update = fedsgd_text_update(
        tm.model, batch, tm.task, generator=torch.Generator().manual_seed(0), defenses=[defense]
    )
    model = tm.model.eval()
    want = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(len(batch)):
        model.zero_grad()
        one = TextBatch(batch.input_ids[i : i + 1], batch.attention_mask[i : i + 1], batch.labels[i : i + 1])
        text_loss(model, one, tm.task).backward()
        g = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
        norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in g.values()))
        assert norm > clip
        for n in want:
            want[n] += g[n] * clip / (norm + 1e-6) / len(batch)
    model.zero_grad()
    for n, w in want.items():
        torch.testing.assert_close(update.tensors[n], w, rtol=1e-3, atol=1e-9)
