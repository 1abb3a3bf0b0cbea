"""The image victims' construction: the official SME victim's fixed input standardisation."""

from __future__ import annotations

import pytest
import torch

from gradleak.models import build_model
from gradleak.models.cnn import CIFAR10_MEAN_STD, Standardize


def test_sme_cifar_cnn_standardises_inputs_as_a_fixed_first_layer():
    """The model on x equals its unstandardised twin (same weights) on (x - mean) / std computed by hand, and
    the standardisation holds no parameter (nothing to train, nothing in an update)."""
    model = build_model("sme_cifar_cnn", input_shape=(3, 32, 32), num_classes=10, seed=0)
    plain = build_model("sme_cifar_cnn", input_shape=(3, 32, 32), num_classes=10, seed=0, standardize=False)
    shifted = {}  # the twin's layers sit one index lower in ``features`` (no standardisation at 0)
    for k, v in model.state_dict().items():
        part, index, rest = k.split(".", 2) if k.startswith("features.") else (k, "", "")
        if part != "features":
            shifted[k] = v
        elif index != "0":
            shifted[f"features.{int(index) - 1}.{rest}"] = v
    plain.load_state_dict(shifted)
    assert isinstance(model.features[0], Standardize)
    assert not list(model.features[0].parameters())
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())
    x = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    mean = torch.tensor(CIFAR10_MEAN_STD[0]).reshape(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_MEAN_STD[1]).reshape(1, 3, 1, 1)
    torch.testing.assert_close(model(x), plain((x - mean) / std), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="RGB"):
        build_model("sme_cifar_cnn", input_shape=(1, 28, 28), num_classes=62, seed=0)
