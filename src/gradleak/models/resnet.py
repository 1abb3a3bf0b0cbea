"""ResNets as users train them, written here (torchvision cannot be installed beside this torch).

- ``resnet18``: He et al., "Deep Residual Learning for Image Recognition" (CVPR 2016), Table 1's 18-layer
  network of basic blocks (2-2-2-2, widths 64-128-256-512), with the CIFAR stem of the common CIFAR-10
  variant: one 3x3 convolution of stride 1 and no max-pooling, so 32x32 inputs keep their resolution into
  the first stage; global average pooling and one linear layer. ``width`` scales every stage (64: the
  original; 16: a narrow variant).
- ``wide_resnet``: Zagoruyko and Komodakis, "Wide Residual Networks" (BMVC 2016), WRN-``depth``-``widen``:
  pre-activation basic blocks (BN-ReLU-conv), ``(depth - 4) / 6`` blocks per stage, widths 16k-32k-64k.

``norm``: ``"batch"`` (BatchNorm, the users' default; its running statistics are buffers a FedAvg reply
carries), ``"group"`` (GroupNorm with 8 groups or fewer: what Opacus and FedBN-free DP need) or ``"none"``.
Every factory takes ``input_shape`` (C, H, W) and ``num_classes`` like the other registered models.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gradleak.registry import MODELS

NORMS = ("batch", "group", "none")


def norm_layer(kind: str) -> Callable[[int], nn.Module]:
    """The normalisation layer for ``channels`` channels (:data:`NORMS`)."""
    if kind == "batch":
        return nn.BatchNorm2d
    if kind == "group":
        return lambda channels: nn.GroupNorm(min(8, channels), channels)
    if kind == "none":
        return lambda channels: nn.Identity()
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")


class BasicBlock(nn.Module):
    """He et al.'s basic block: conv3x3-norm-ReLU-conv3x3-norm, plus the (projected) shortcut, ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = norm(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), norm(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class PreActBlock(nn.Module):
    """Zagoruyko and Komodakis' block: norm-ReLU-conv3x3-norm-ReLU-conv3x3, plus the shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.bn1 = norm(c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn2 = norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Conv2d(c_in, c_out, 1, stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(x))
        shortcut = self.shortcut(out) if not isinstance(self.shortcut, nn.Identity) else x
        out = self.conv1(out)
        out = self.conv2(torch.relu(self.bn2(out)))
        return out + shortcut


class ResNet(nn.Module):
    """A stem, stages of blocks, global average pooling and a linear classifier."""

    def __init__(
        self, stem: nn.Module, stages: nn.Sequential, head_norm: nn.Module, width: int, classes: int
    ):
        super().__init__()
        self.stem = stem
        self.stages = stages
        self.head_norm = head_norm
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head_norm(self.stages(self.stem(x)))
        return self.fc(self.pool(out).flatten(1))


def _stages(
    block: type[BasicBlock] | type[PreActBlock],
    widths: list[int],
    blocks: int | list[int],
    c_in: int,
    norm: Callable[[int], nn.Module],
) -> nn.Sequential:
    counts = blocks if isinstance(blocks, list) else [blocks] * len(widths)
    layers: list[nn.Module] = []
    for i, (w, n) in enumerate(zip(widths, counts, strict=True)):
        for j in range(n):
            layers.append(block(c_in, w, 2 if (j == 0 and i > 0) else 1, norm))
            c_in = w
    return nn.Sequential(*layers)


def resnet18(
    input_shape: tuple[int, int, int], num_classes: int, width: int = 64, norm: str = "batch"
) -> ResNet:
    """ResNet-18 with the CIFAR stem (module docstring)."""
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be an int >= 1, got {width!r}")
    make = norm_layer(norm)
    stem = nn.Sequential(nn.Conv2d(input_shape[0], width, 3, 1, 1, bias=False), make(width), nn.ReLU())
    widths = [width, 2 * width, 4 * width, 8 * width]
    return ResNet(stem, _stages(BasicBlock, widths, 2, width, make), nn.Identity(), 8 * width, num_classes)


def wide_resnet(
    input_shape: tuple[int, int, int], num_classes: int, depth: int = 16, widen: int = 4, norm: str = "batch"
) -> ResNet:
    """WRN-``depth``-``widen`` (module docstring); ``depth`` = 6n + 4."""
    if not isinstance(depth, int) or depth < 10 or (depth - 4) % 6:
        raise ValueError(f"depth must be 6n + 4 with n >= 1 (10, 16, 22, 28, ...), got {depth!r}")
    if not isinstance(widen, int) or widen < 1:
        raise ValueError(f"widen must be an int >= 1, got {widen!r}")
    make = norm_layer(norm)
    widths = [16 * widen, 32 * widen, 64 * widen]
    stem = nn.Conv2d(input_shape[0], 16, 3, 1, 1, bias=False)
    head = nn.Sequential(make(widths[-1]), nn.ReLU())
    stages = _stages(PreActBlock, widths, (depth - 4) // 6, 16, make)
    return ResNet(stem, stages, head, widths[-1], num_classes)


MODELS.register(
    "resnet18", resnet18, summary="ResNet-18, CIFAR stem (width=64, norm=batch|group|none)", modality="image"
)
MODELS.register(
    "wide_resnet",
    wide_resnet,
    summary="WRN-depth-widen, pre-activation (depth=16, widen=4)",
    modality="image",
)

__all__ = ["NORMS", "BasicBlock", "PreActBlock", "ResNet", "norm_layer", "resnet18", "wide_resnet"]
