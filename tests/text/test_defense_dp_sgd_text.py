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


@pytest.mark.parametrize("kind", ["lora", "bottleneck"])
@pytest.mark.parametrize("fixture", ["gpt2_cls", "bert_cls"])
def test_dp_sgd_on_adapters_equals_the_per_sample_reference(request, make_batch, fixture, kind):
    """Issue 52 item 3, the class of Opacus issue #820 (LoRA weights silently corrupted by DP training
    with a peft release): on a peft LoRA model (adapters on attention and MLP, the head trained), and on
    bottleneck adapters (gradleak's, applied by block pre-hooks), the DP-SGD update carries exactly the
    trainable parameters, and each equals the slow loop's per-sample clipping over those parameters alone
    (noise 0, so the comparison is exact up to float rounding). LoRA's B is set non-zero first, so that A's
    gradient is not peft's initial zero and both matrices are checked."""
    import copy

    from gradleak.data.text import TextBatch
    from gradleak.models.adapters import AdapterConfig, apply_adapter
    from gradleak.tasks import text_loss
    from gradleak.tasks.text_client import fedsgd_text_update
    from gradleak.validation import trainable_of

    tm = request.getfixturevalue(fixture)
    config = (
        AdapterConfig(r=4, alpha=8, target=["attention", "mlp"])
        if kind == "lora"
        else AdapterConfig(kind="bottleneck", r=8)
    )
    model = apply_adapter(copy.deepcopy(tm.model), config, tm.task, seed=0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = set(trainable_of(model))
    marks = (".lora_A.", ".lora_B.") if kind == "lora" else (".bottleneck.down.", ".bottleneck.up.")
    assert all(any(mark in n for n in trainable) for mark in marks)
    batch = make_batch(tm)
    clip = 1e-3
    defense = DPSGD(DPSGDConfig(clip=clip, noise_multiplier=0.0, sample_rate=0.01))
    update = fedsgd_text_update(model, batch, tm.task, generator=torch.Generator().manual_seed(0),
                                defenses=[defense])  # fmt: skip
    assert set(update.tensors) == trainable
    model.eval()
    want = {n: torch.zeros_like(p) for n, p in model.named_parameters() if n in trainable}
    for i in range(len(batch)):
        model.zero_grad()
        one = TextBatch(batch.input_ids[i : i + 1], batch.attention_mask[i : i + 1], batch.labels[i : i + 1])
        text_loss(model, one, tm.task).backward()
        g = {n: p.grad for n, p in model.named_parameters() if n in trainable}
        assert all(v is not None for v in g.values())
        norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in g.values()))  # type: ignore[union-attr]
        assert norm > clip  # the clipping binds
        for n in want:
            want[n] += g[n] * clip / (norm + 1e-6) / len(batch)  # type: ignore[operator]
    model.zero_grad()
    for n, w in want.items():
        assert float(w.abs().max()) > 0, n  # A's gradient too: B is not zero
        torch.testing.assert_close(update.tensors[n], w, rtol=1e-3, atol=1e-9, msg=n)
    for n, p in model.named_parameters():  # the frozen base is left as it was, bit for bit
        if n in base:
            assert torch.equal(p, base[n]), n
