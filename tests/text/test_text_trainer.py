"""LocalTrainer: the schedule, the optimiser over unfrozen parameters, steps on the defended gradient."""

from __future__ import annotations

import copy

import pytest
import torch

from gradleak.defenses.aegis_llm import AegisLLM
from gradleak.defenses.base import SetupContext
from gradleak.tasks.text_client import LocalTrainer, text_loss


def test_warmup_then_linear_decay_matches_the_formula(gpt2_cls):
    trainer = LocalTrainer(copy.deepcopy(gpt2_cls.model), "classification", lr=1.0, warmup_steps=4,
                           total_steps=12)  # fmt: skip
    got = [trainer.lr_at(s) for s in range(13)]
    want = [0.25, 0.5, 0.75, 1.0] + [(12 - s) / 8 for s in range(4, 13)]
    assert got == pytest.approx(want, abs=1e-12)
    constant = LocalTrainer(copy.deepcopy(gpt2_cls.model), "classification", lr=0.3)
    assert [constant.lr_at(s) for s in (0, 5, 1000)] == [0.3, 0.3, 0.3]


@pytest.mark.parametrize(
    "kwargs",
    [{"optimizer": "rmsprop"}, {"lr": 0.0}, {"weight_decay": -1.0}, {"warmup_steps": 5, "total_steps": 5}],
)
def test_bad_settings_are_refused(gpt2_cls, kwargs):
    with pytest.raises(ValueError):
        LocalTrainer(copy.deepcopy(gpt2_cls.model), "classification", **kwargs)


def test_adam_steps_as_torchs_adam_the_optimiser_local_training_allows(gpt2_cls, make_batch):
    """Adam, which LocalTraining allows, is no longer refused by the text trainer (issue 51 defect): three
    constant-lr steps equal torch's Adam driven by hand on the same batch."""
    batch = make_batch(gpt2_cls)
    model = copy.deepcopy(gpt2_cls.model)
    trainer = LocalTrainer(model, "classification", lr=1e-3, optimizer="adam", weight_decay=0.01)
    ref = copy.deepcopy(gpt2_cls.model).eval()
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(3):
        trainer.step(batch)
        opt.zero_grad(set_to_none=True)
        text_loss(ref, batch, "classification").backward()
        opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
    assert (
        max((p - q).abs().max() for p, q in zip(model.parameters(), gpt2_cls.model.parameters(), strict=True))
        > 1e-4
    )


def test_adamw_steps_equal_a_hand_written_loop_on_the_defended_gradient(gpt2_cls, make_batch):
    """Four AdamW steps with warm-up and weight decay under AEGIS equal torch's AdamW driven by hand on the
    same flooded gradients (same generator), frozen attention excluded from the optimiser."""
    batch = make_batch(gpt2_cls)
    model = copy.deepcopy(gpt2_cls.model)
    trainer = LocalTrainer(model, "classification", lr=1e-3, optimizer="adamw", weight_decay=0.01,
                           warmup_steps=2, total_steps=6, defenses=[AegisLLM()],
                           generator=torch.Generator().manual_seed(3))  # fmt: skip
    ref = copy.deepcopy(gpt2_cls.model).eval()  # no dropout, as the trainer by default
    defense = AegisLLM()
    defense.setup(ref, SetupContext(torch.Generator().manual_seed(3)))
    params = [p for p in ref.parameters() if p.requires_grad]
    assert len(params) < len(list(ref.parameters()))  # attention frozen
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    for step, lr in enumerate([5e-4, 1e-3, 1e-3, 7.5e-4]):
        trainer.step(batch)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        text_loss(ref, batch, "classification").backward()
        defense.on_gradients(ref, step)
        opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
    moved = [
        (p - q).abs().max() for p, q in zip(model.parameters(), gpt2_cls.model.parameters(), strict=True)
    ]
    assert max(moved) > 1e-4  # the comparison is not between two untouched models


def test_batch_to_a_device_keeps_every_field(make_batch, gpt2_cls):
    batch = make_batch(gpt2_cls)
    assert batch.to("cpu") is batch
    moved = batch.to("meta")  # a second device without hardware: shapes, dtypes and fields travel
    assert moved.input_ids.device.type == "meta" and moved.labels is not None
    assert moved.labels.device.type == "meta" and moved.attention_mask.shape == batch.attention_mask.shape
