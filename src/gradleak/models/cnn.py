"""Victim classifiers used by the papers, registered by name.

- ``aegis_cnn``: paper 000's default classifier, "three convolutional layers and a 512-unit fully connected
  layer" (000, Experimental setup). Kernel sizes and widths are not given; we use 3x3 convs of 32/64/128
  channels, each followed by ReLU and 2x2 max-pooling, then FC-512, ReLU and the output layer.
- ``sme_cnn``: paper 001's victim, "two convolutional layers followed by two fully connected layers, as in
  SME/NL-SME" (001, Sec. 4): 5x5 convs of 32/64 channels with ReLU and 2x2 max-pooling, then FC-``hidden``
  and the output layer (LEAF's FEMNIST CNN uses hidden=2048; the CIFAR variant uses 512).
- ``sme_cifar_cnn``: the CIFAR victim of the official SME code (its ``CNNcifar``, the model of issue 21's
  side-by-side with it): 3x3 convs of 64/128 channels with ReLU and 2x2 *average* pooling, then FC-200, ReLU
  and the output layer, its inputs standardised per channel (CIFAR-10's statistics) as the official data
  pipeline does, here as a fixed first layer. Average pooling is linear, so its update is smoother in the
  input than ``sme_cnn``'s max-pooled one.
- ``lenet``: the sigmoid LeNet of DLG (Zhu et al. 2019): three 5x5 convs of 12 channels (strides 2, 2, 1)
  with sigmoid, then one linear layer. Smooth activations make it the classic gradient-inversion target.

Every factory takes ``input_shape`` (C, H, W) and ``num_classes`` plus keyword options.
"""

from __future__ import annotations

import torch
from torch import nn

from gradleak.registry import MODELS


def _flat_dim(features: nn.Module, input_shape: tuple[int, int, int]) -> int:
    with torch.no_grad():
        return int(features(torch.zeros(1, *input_shape)).numel())


class ConvClassifier(nn.Module):
    """``features`` (conv stack) then ``classifier`` (flatten + fully connected layers)."""

    features: nn.Sequential
    classifier: nn.Sequential

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _two_layer_head(
    features: nn.Module, input_shape: tuple[int, int, int], hidden: int, classes: int
) -> nn.Sequential:
    """Flatten -> Linear(hidden) -> ReLU -> Linear(classes)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(_flat_dim(features, input_shape), hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


class AegisCNN(ConvClassifier):
    """Paper 000's classifier: 3 conv blocks + FC-512 + output layer."""

    def __init__(
        self, input_shape: tuple[int, int, int], num_classes: int, width: int = 32, hidden: int = 512
    ):
        super().__init__()
        c = input_shape[0]
        self.features = nn.Sequential(
            nn.Conv2d(c, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.classifier = _two_layer_head(self.features, input_shape, hidden, num_classes)


class SMECNN(ConvClassifier):
    """Paper 001's victim: 2 conv (5x5, 32/64) + 2 FC layers."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, hidden: int | None = None):
        super().__init__()
        c = input_shape[0]
        if hidden is None:  # LEAF FEMNIST CNN for grayscale, a narrower head for RGB (CIFAR)
            hidden = 2048 if c == 1 else 512
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.classifier = _two_layer_head(self.features, input_shape, hidden, num_classes)


CIFAR10_MEAN_STD = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))  # per channel, of the training set


class Standardize(nn.Module):
    """``(x - mean) / std`` per channel, fixed (buffers, no parameters): a data pipeline's normalisation as
    the model's first layer, so that images (and every attack's dummy images) stay in [0, 1]."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).reshape(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std).reshape(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class SMECifarCNN(ConvClassifier):
    """The official SME code's CIFAR victim: 2 conv (3x3, 64/128, average pooling) + FC-200 + output, on
    inputs standardised per channel as its data pipeline does (``standardize``; RGB only)."""

    def __init__(
        self, input_shape: tuple[int, int, int], num_classes: int, hidden: int = 200, standardize: bool = True
    ):
        super().__init__()
        c = input_shape[0]
        if standardize and c != 3:
            raise ValueError(f"sme_cifar_cnn standardizes RGB inputs (CIFAR-10 statistics); got {c} channels")
        self.features = nn.Sequential(
            *([Standardize(*CIFAR10_MEAN_STD)] if standardize else []),
            nn.Conv2d(c, 64, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
        )  # fmt: skip
        self.classifier = _two_layer_head(self.features, input_shape, hidden, num_classes)


class LeNet(ConvClassifier):
    """DLG's LeNet (Zhu et al. 2019): sigmoid convs, one linear output layer."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, width: int = 12):
        super().__init__()
        c = input_shape[0]
        self.features = nn.Sequential(
            nn.Conv2d(c, width, 5, padding=2, stride=2), nn.Sigmoid(),
            nn.Conv2d(width, width, 5, padding=2, stride=2), nn.Sigmoid(),
            nn.Conv2d(width, width, 5, padding=2, stride=1), nn.Sigmoid(),
        )  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(_flat_dim(self.features, input_shape), num_classes)
        )


MODELS.register("aegis_cnn", AegisCNN, summary="paper 000 classifier: 3 conv + FC-512", modality="image")
MODELS.register("sme_cnn", SMECNN, summary="paper 001 victim: 2 conv + 2 FC (SME/NL-SME)", modality="image")
MODELS.register(
    "sme_cifar_cnn",
    SMECifarCNN,
    summary="the official SME code's CIFAR victim: 2 conv (avg pool) + 2 FC",
    modality="image",
)
MODELS.register("lenet", LeNet, summary="DLG's sigmoid LeNet", modality="image")


class MLP(nn.Module):
    """A fully connected classifier: flatten, ``hidden`` ReLU layers, the output layer. The first layer reads
    the raw pixels, the setting of Boenisch et al.'s trap weights and of Robbing the Fed's imprint written
    into a model's own first layer (:mod:`gradleak.attacks.linear.in_place`)."""

    def __init__(
        self, input_shape: tuple[int, int, int], num_classes: int, hidden: tuple[int, ...] = (256, 128)
    ):
        super().__init__()
        widths = [int(torch.tensor(input_shape).prod()), *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


MODELS.register(
    "mlp", MLP, summary="fully connected: flatten + ReLU layers (hidden=(256, 128))", modality="image"
)
