"""Figures: a PNG grid of originals (top row) over their matched reconstructions (bottom row)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from gradleak.fileio import atomic_write  # noqa: E402


def _to_hwc(img: torch.Tensor) -> torch.Tensor:
    img = img.detach().clamp(0, 1).cpu()
    return img[0] if img.shape[0] == 1 else img.permute(1, 2, 0)


def save_reconstruction_grid(
    originals: torch.Tensor,
    reconstructions: torch.Tensor,
    path: str | Path,
    *,
    title: str = "",
    captions: Sequence[str] | None = None,
    max_images: int = 16,
) -> Path:
    """Write originals (N, C, H, W) above reconstructions in the same order (already matched)."""
    if originals.shape[1:] != reconstructions.shape[1:]:
        raise ValueError(f"image shapes differ: {tuple(originals.shape)} vs {tuple(reconstructions.shape)}")
    n = min(len(originals), len(reconstructions), max_images)
    if n == 0:
        raise ValueError("no images to draw")
    fig, axes = plt.subplots(2, n, figsize=(1.6 * n + 0.6, 3.6), squeeze=False)
    gray = originals.shape[1] == 1
    for j in range(n):
        for i, (row, name) in enumerate(((originals, "original"), (reconstructions, "reconstruction"))):
            ax = axes[i][j]
            ax.imshow(_to_hwc(row[j]).numpy(), cmap="gray" if gray else None, vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
            if j == 0:
                ax.set_ylabel(name, fontsize=8)
            if i == 1 and captions is not None:
                ax.set_xlabel(captions[j], fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    try:
        return atomic_write(Path(path), lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)
