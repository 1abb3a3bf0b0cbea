"""Figures: a PNG grid of originals (top row) over their matched reconstructions (bottom row)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from gradleak.fileio import atomic_write  # noqa: E402
from gradleak.types import Observation  # noqa: E402


def _to_hwc(img: torch.Tensor) -> torch.Tensor:
    img = img.detach().clamp(0, 1).cpu()
    return img[0] if img.shape[0] == 1 else img.permute(1, 2, 0)


def save_reconstruction_grid(
    originals: torch.Tensor | None,
    reconstructions: torch.Tensor,
    path: str | Path,
    *,
    title: str = "",
    captions: Sequence[str] | None = None,
    max_images: int = 16,
) -> Path:
    """Write originals (N, C, H, W) above reconstructions in the same order (already matched); without
    originals (a real server's audit has none) the reconstructions alone. The file is its owner's alone
    (:func:`~gradleak.fileio.atomic_write`): a reconstruction is a client's data."""
    if originals is not None and originals.shape[1:] != reconstructions.shape[1:]:
        raise ValueError(f"image shapes differ: {tuple(originals.shape)} vs {tuple(reconstructions.shape)}")
    rows = [(reconstructions, "reconstruction")]
    if originals is not None:
        rows.insert(0, (originals, "original"))
    n = min(*(len(r) for r, _ in rows), max_images)
    if n == 0:
        raise ValueError("no images to draw")
    fig, axes = plt.subplots(len(rows), n, figsize=(1.6 * n + 0.6, 1.8 * len(rows)), squeeze=False)
    gray = reconstructions.shape[1] == 1
    for j in range(n):
        for i, (row, name) in enumerate(rows):
            ax = axes[i][j]
            ax.imshow(_to_hwc(row[j]).numpy(), cmap="gray" if gray else None, vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
            if j == 0:
                ax.set_ylabel(name, fontsize=8)
            if i == len(rows) - 1 and captions is not None:
                ax.set_xlabel(captions[j], fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    try:
        return atomic_write(Path(path), lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)


Figure = tuple[torch.Tensor, torch.Tensor, str, list[str]]  # originals, reconstructions, title, captions


SHOWN_PER_RANK = 4  # images shown from the best, the middle and the worst of a figure's matches


def representative(psnr: list[float], per_rank: int = SHOWN_PER_RANK) -> list[tuple[int, str]]:
    """Positions into ``psnr`` (one per matched image) to show, best first, each with its rank: the
    ``per_rank`` best, the ``per_rank`` around the median and the ``per_rank`` worst (all of them, sorted,
    when there are at most ``3 * per_rank``): a figure shows the spread, not the first matches."""
    order = sorted(range(len(psnr)), key=lambda k: -psnr[k])
    n = len(order)
    if n <= 3 * per_rank:
        return [(k, "") for k in order]
    mid = max(per_rank, min(n // 2 - per_rank // 2, n - 2 * per_rank))
    ranks = [
        ("best", order[:per_rank]),
        ("median", order[mid : mid + per_rank]),
        ("worst", order[-per_rank:]),
    ]
    return [(k, rank) for rank, ks in ranks for k in ks]


def matched_figure(
    name: str, obs: Observation, images: torch.Tensor, truth: torch.Tensor, scores: dict[str, Any]
) -> Figure:
    """Originals above their matched reconstructions, the best, median and worst matches by PSNR
    (:func:`representative`), each captioned with its rank and PSNR (capped at 100 dB)."""
    matched = [j for j, i in enumerate(scores["matching"]) if i >= 0]
    psnr = [float(scores["psnr"][m]) for m in range(len(matched))]  # psnr[m] scores matched[m]
    shown = representative(psnr)
    rows = [matched[k] for k, _ in shown]
    recon = images[[scores["matching"][j] for j in rows]]
    caps = [f"{rank} {psnr[k]:.1f} dB".strip() for k, rank in shown]
    who = f"the secure-aggregation sum of {obs.num_clients} clients" if obs.aggregated else (
        f"client {obs.update.metadata.get('client_id')}")  # fmt: skip
    unmatched = len(scores["matching"]) - len(matched)
    title = (f"{name} on {who}: {len(shown)} of {len(matched)} matched images (best, median, worst by PSNR)"
             + (f"; {unmatched} not reconstructed" if unmatched else ""))  # fmt: skip
    return truth[rows], recon, title, caps
