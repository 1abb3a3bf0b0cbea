"""GI-NAS's search space: over-parameterised U-Net generators with searched skips and upsampling.

GI-NAS (Yu et al., "GI-NAS: Boosting Gradient Inversion Attacks through Adaptive Neural Architecture
Search", IEEE TIFS 20, 2025) draws candidate generators from one family and keeps the one whose *untrained*
output best matches the observed gradient (:mod:`gradleak.attacks.image.gi_nas`). The family, as the
official code (cswbyu/GI-NAS, ``model/cross_skip.py``, ``model/gen_upsample_layer.py``) builds it; read, not
copied:

- **Encoder**: ``levels`` blocks (conv 3x3 stride 2, BN, LeakyReLU(0.2), conv 3x3, BN, LeakyReLU), each
  halving the size (5 levels on 32 x 32: down to 1 x 1), all ``width`` channels wide (128).
- **Decoder**: level r (r = levels-1 .. 0, output at the size of encoder level r, level 0 the input's) is a
  block (BN, conv 3x3, BN, LeakyReLU, conv 3x3, BN, LeakyReLU, conv 1x1, BN, LeakyReLU) of the upsampled
  previous level (the bottleneck for the first) plus the **skips** the binary ``levels`` x ``levels`` matrix
  selects: source c (0: the input noise, c >= 1: encoder level c) brought to level r's size by a 1x1 block
  (c = r), a chain of stride-2 conv blocks (c < r) or of upsampling blocks (c > r). The chains' modules are
  shared: one per level transition, used by every skip that passes through it.
- **Upsampling** (every x2 of a candidate uses the same op, each with its own weights): an interpolation
  (bilinear, bicubic, nearest) or a pixel shuffle, followed by a convolution (plain, stride-1 transposed,
  split-stack-sum, separable, depthwise, or none) of kernel 1/3/5/7 with no activation, ReLU or
  LeakyReLU(0.2); or a convolution to 4x the channels followed by a pixel shuffle. Combinations the official
  code cannot build (pixel shuffle then depthwise or no convolution) are not in the space.
- **Output**: conv 1x1 to the image's channels and a sigmoid (images in [0, 1]).

The official list holds 5,000 candidates whose 25 skip bits are i.i.d. fair coins and whose op is the
line number mod 300; :func:`sample_architectures` draws the same distribution from a seeded generator.
Images whose sides are not multiples of 2**levels are generated at the next multiple and centre-cropped
(an adaptation: the official code runs on 32 x 32 and 256 x 256).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

PRIMITIVES = ("bilinear", "bicubic", "nearest", "pixel_shuffle")
CONVS = ("conv", "trans_conv", "split_stack_sum", "sep_conv", "depthwise", "none")
KERNELS = (1, 3, 5, 7)
ACTIVATIONS = ("none", "relu", "leaky_relu")
SHUFFLE_CONVS = ("conv", "trans_conv", "split_stack_sum", "sep_conv")  # conv to 4C, then pixel shuffle


@dataclass(frozen=True)
class UpsampleOp:
    """One x2 upsampling: ``primitive`` then ``conv`` (``order="primitive_first"``), or ``conv`` to four
    times the channels then a pixel shuffle (``order="conv_first"``)."""

    primitive: str
    conv: str
    kernel: int = 3
    activation: str = "none"
    order: str = "primitive_first"

    def __post_init__(self) -> None:
        if self.primitive not in PRIMITIVES:
            raise ValueError(f"primitive must be one of {PRIMITIVES}, got {self.primitive!r}")
        if self.conv not in CONVS:
            raise ValueError(f"conv must be one of {CONVS}, got {self.conv!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.order not in ("primitive_first", "conv_first"):
            raise ValueError(f"order must be 'primitive_first' or 'conv_first', got {self.order!r}")
        if self.order == "conv_first" and (
            self.primitive != "pixel_shuffle" or self.conv not in SHUFFLE_CONVS
        ):
            raise ValueError(f"conv_first is a conv in {SHUFFLE_CONVS} followed by a pixel shuffle")
        if (
            self.primitive == "pixel_shuffle"
            and self.order == "primitive_first"
            and self.conv in ("depthwise", "none")
        ):
            raise ValueError("a pixel shuffle (C -> C/4 channels) needs a channel-mixing conv after it")


def all_upsample_ops() -> list[UpsampleOp]:
    """Every op of the space (the official code's reachable, buildable indices)."""
    ops = []
    for prim in PRIMITIVES:
        for conv in CONVS:
            kernels = (3,) if conv == "none" else KERNELS
            for k in kernels:
                for act in ACTIVATIONS:
                    try:
                        ops.append(UpsampleOp(prim, conv, k, act))
                    except ValueError:
                        continue
    ops += [
        UpsampleOp("pixel_shuffle", conv, k, act, "conv_first")
        for conv in SHUFFLE_CONVS
        for k in KERNELS
        for act in ACTIVATIONS
    ]
    return ops


@dataclass(frozen=True)
class Architecture:
    """A candidate: the skip matrix (``skips[r][c]``: source c feeds decoder level r) and the upsampling."""

    skips: tuple[tuple[bool, ...], ...]
    upsample: UpsampleOp

    def __post_init__(self) -> None:
        n = len(self.skips)
        if n < 1 or any(len(row) != n for row in self.skips):
            raise ValueError(f"skips must be a square matrix, got rows of {[len(r) for r in self.skips]}")


def sample_architectures(levels: int, count: int, generator: torch.Generator) -> list[Architecture]:
    """``count`` candidates: skip bits i.i.d. fair coins, the op uniform over :func:`all_upsample_ops`."""
    ops = all_upsample_ops()
    out = []
    for _ in range(count):
        bits = torch.randint(0, 2, (levels, levels), generator=generator).bool().tolist()
        op = ops[int(torch.randint(len(ops), (1,), generator=generator))]
        out.append(Architecture(tuple(tuple(row) for row in bits), op))
    return out


def _activation(name: str) -> nn.Module:
    table: dict[str, Callable[[], nn.Module]] = {
        "none": nn.Identity,
        "relu": nn.ReLU,
        "leaky_relu": lambda: nn.LeakyReLU(0.2),
    }
    return table[name]()


def _conv(kind: str, c_in: int, c_out: int, k: int) -> nn.Module:
    pad = k // 2
    table: dict[str, Callable[[], nn.Module]] = {
        "conv": lambda: nn.Conv2d(c_in, c_out, k, padding=pad, bias=False),
        "trans_conv": lambda: nn.ConvTranspose2d(c_in, c_out, k, padding=pad, bias=False),
        "split_stack_sum": lambda: _SplitStackSum(c_in, c_out, k),
        "sep_conv": lambda: nn.Sequential(
            nn.Conv2d(c_in, c_in, k, padding=pad, groups=c_in, bias=False),
            nn.Conv2d(c_in, c_out, 1, bias=False),
        ),
        "depthwise": lambda: nn.Conv2d(c_in, c_out, k, padding=pad, groups=c_in, bias=False),
        "none": nn.Identity,
    }
    return table[kind]()


class _SplitStackSum(nn.Module):
    """The channels cut into four chunks and summed, then a convolution (C/4 -> C_out)."""

    def __init__(self, c_in: int, c_out: int, k: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in // 4, c_out, k, padding=k // 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.stack(x.chunk(4, dim=1)).sum(0))


class _Interpolate(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "nearest":
            return F.interpolate(x, scale_factor=2, mode="nearest")
        return F.interpolate(x, scale_factor=2, mode=self.mode, align_corners=False)


def upsample_block(op: UpsampleOp, width: int) -> nn.Module:
    """A x2 upsampling of ``width`` channels to ``width`` channels: the primitive and the activation, then
    the convolution and the activation (the official order), or the convolution then the shuffle."""
    act = _activation(op.activation)
    if op.order == "conv_first":
        return nn.Sequential(_conv(op.conv, width, 4 * width, op.kernel), nn.PixelShuffle(2), act)
    first: nn.Module = nn.PixelShuffle(2) if op.primitive == "pixel_shuffle" else _Interpolate(op.primitive)
    c_in = width // 4 if op.primitive == "pixel_shuffle" else width
    return nn.Sequential(first, act, _conv(op.conv, c_in, width, op.kernel), _activation(op.activation))


def _block(c_in: int, c_out: int, k: int, stride: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2),
        nn.BatchNorm2d(c_out),
        nn.LeakyReLU(0.2),
    ]


def generated_size(height: int, width: int, levels: int) -> tuple[int, int]:
    """The size a generator of ``levels`` halvings works at: each side rounded up to a multiple of 2**levels
    (its noise input has this size; the output is centre-cropped to the image's)."""
    step = 2**levels
    return -(-height // step) * step, -(-width // step) * step


class SkipGenerator(nn.Module):
    """One candidate of the family (module docstring) for images of ``shape`` (C, H, W); its input is noise
    of the :func:`generated_size`."""

    def __init__(self, arch: Architecture, shape: tuple[int, int, int], width: int = 128) -> None:
        super().__init__()
        if width < 16 or width % 16:  # a pixel shuffle quarters it, a split-stack-sum quarters that
            raise ValueError(f"width must be a positive multiple of 16, got {width}")
        levels = len(arch.skips)
        c, h, w = shape
        self.shape = shape
        self.size = generated_size(h, w, levels)
        self.arch = arch
        self.encoder = nn.ModuleList(
            nn.Sequential(*_block(c if i == 0 else width, width, 3, 2), *_block(width, width, 3))
            for i in range(levels)
        )
        self.up = nn.ModuleList(upsample_block(arch.upsample, width) for _ in range(levels))
        self.decoder = nn.ModuleList(
            nn.Sequential(
                nn.BatchNorm2d(width),
                *_block(width, width, 3),
                *_block(width, width, 3),
                *_block(width, width, 1),
            )
            for _ in range(levels)
        )
        # shared skip chains: same[c] (1x1 at level c), down[c] (level c -> c + 1), lift[c] (level c -> c - 1)
        self.same = nn.ModuleList(
            nn.Sequential(*_block(c if i == 0 else width, width, 1)) for i in range(levels)
        )
        self.down = nn.ModuleList(
            nn.Sequential(*_block(c if i == 0 else width, width, 3, 2)) for i in range(levels - 1)
        )
        self.lift = nn.ModuleList(upsample_block(arch.upsample, width) for _ in range(levels - 1))
        self.out = nn.Conv2d(width, c, 1)

    def _skip(self, feats: list[torch.Tensor], source: int, target: int) -> torch.Tensor:
        if source == target:
            return self.same[source](feats[source])
        x = feats[source]
        if source < target:
            for level in range(source, target):
                x = self.down[level](x)
        else:
            for level in range(source, target, -1):
                x = self.lift[level - 1](x)
        return x

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        feats = [z]
        for enc in self.encoder:
            feats.append(enc(feats[-1]))
        x = feats[-1]
        levels = len(self.arch.skips)
        for r in range(levels - 1, -1, -1):
            x = self.up[r](x)
            for source in range(levels):
                if self.arch.skips[r][source]:
                    x = x + self._skip(feats, source, r)
            x = self.decoder[r](x)
        img = torch.sigmoid(self.out(x))
        _, h, w = self.shape
        top, left = (self.size[0] - h) // 2, (self.size[1] - w) // 2
        return img[:, :, top : top + h, left : left + w]
