"""The ResNets written here (models/resnet.py) against the published architectures: parameter counts of
the reference implementations, shapes, BatchNorm buffers in train mode, and the norm choices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradleak.models import build_model
from gradleak.models.architecture import build, describe


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_resnet18_has_the_cifar_reference_parameter_count():
    """11,173,962: the CIFAR ResNet-18 (3x3 stem, no max-pooling) of kuangliu/pytorch-cifar."""
    assert count(build_model("resnet18", (3, 32, 32), 10, seed=0)) == 11_173_962


def test_wide_resnet_28_10_has_the_papers_parameter_count():
    """36.5M for WRN-28-10 (Zagoruyko and Komodakis, Table 1: 36.5M); 36,479,194 exactly in the reference
    PyTorch implementations with bias-free convolutions."""
    assert count(build_model("wide_resnet", (3, 32, 32), 10, seed=0, depth=28, widen=10)) == 36_479_194


@pytest.mark.parametrize(
    ("name", "options"), [("resnet18", {"width": 8}), ("wide_resnet", {"depth": 10, "widen": 1})]
)
@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 28, 28)])
def test_shapes_and_batchnorm_statistics_in_train_mode(name, options, shape):
    model = build_model(name, shape, 7, seed=0, **options).train()
    x = torch.rand(4, *shape, generator=torch.Generator().manual_seed(0))
    assert model(x).shape == (4, 7)
    counters = [m.num_batches_tracked for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert counters and all(int(c) == 1 for c in counters)  # every BatchNorm saw the batch


def test_group_and_no_norm_have_no_batch_statistics():
    for norm in ("group", "none"):
        model = build_model("resnet18", (3, 32, 32), 10, seed=0, width=8, norm=norm)
        assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
        assert not [n for n, _ in model.named_buffers()]


def test_the_spec_travels_with_the_options():
    model = build_model("wide_resnet", (3, 32, 32), 10, seed=3, depth=10, widen=2, norm="group")
    rebuilt = build(describe(model))
    for (n, a), (m, b) in zip(model.state_dict().items(), rebuilt.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("resnet18", {"norm": "layer"}, "norm must be one of"),
        ("resnet18", {"width": 0}, "width"),
        ("wide_resnet", {"depth": 12}, "6n \\+ 4"),
        ("wide_resnet", {"widen": 0}, "widen"),
    ],
)
def test_bad_options_are_refused(name, options, message):
    with pytest.raises(ValueError, match=message):
        build_model(name, (3, 32, 32), 10, seed=0, **options)
