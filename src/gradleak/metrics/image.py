"""Image reconstruction metrics for gradient-leakage attacks: PSNR, SSIM, FSIM, LPIPS status, matching.

All functions take float tensors ``(N, C, H, W)`` with values in [0, 1] and return one score per image.

* PSNR = 10 log10(1 / MSE) with data range 1 (torchmetrics; its constants are float32, so values agree
  with the exact formula to ~1e-6 dB). Identical images give ``+inf``: the per-image
  function returns ``inf`` on purpose; summaries cap every value at ``PSNR_CAP_DB`` = 100 dB before
  averaging so that means and variances stay finite.
* SSIM: Wang, Bovik, Sheikh, Simoncelli, "Image quality assessment: from error visibility to structural
  similarity", IEEE TIP 13(4), 2004, eq. 13, Gaussian window 11x11 with sigma 1.5, K1 = 0.01, K2 = 0.03,
  averaged over the windows that lie inside the image (torchmetrics' SSIM map, border cropped).
* FSIM / FSIMc: Zhang et al., IEEE TIP 2011, see :mod:`gradleak.metrics.feature_similarity`.
* Reconstruction rate: the fraction of ground-truth images reconstructed with PSNR above a threshold
  (18 dB by default), the success criterion used by the attack papers this library reproduces.
* Matching: attacks that reconstruct a whole batch return images in arbitrary order; we pair
  reconstructions with ground truths by the optimal one-to-one assignment (Hungarian algorithm,
  Kuhn 1955 / Munkres 1957, via ``scipy.optimize.linear_sum_assignment``) maximising the summed pairwise PSNR.
* LPIPS (Zhang et al., CVPR 2018) needs pretrained backbone weights that are not available offline; it is
  reported as ``None`` with the reason, never as an invented number.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

from gradleak.metrics.feature_similarity import fsim

logger = logging.getLogger(__name__)

__all__ = [
    "PSNR_CAP_DB",
    "LPIPS_UNAVAILABLE_NOTE",
    "ImageScores",
    "LPIPSUnavailableError",
    "lpips",
    "lpips_available",
    "lpips_unavailable_reason",
    "match_reconstructions",
    "pairwise_psnr",
    "psnr",
    "reconstruction_rate",
    "score_images",
    "ssim",
]

PSNR_CAP_DB = 100.0
"""Cap applied to PSNR values (identical images give +inf) before any mean, variance or cost matrix."""

LPIPS_UNAVAILABLE_NOTE = "unavailable: no local backbone weights"

SSIM_KERNEL_SIZE = 11
SSIM_SIGMA = 1.5


def _check_pair(x: torch.Tensor, y: torch.Tensor, name: str) -> None:
    if x.dim() != 4 or y.dim() != 4 or x.shape != y.shape:
        raise ValueError(
            f"{name} expects two (N, C, H, W) tensors of equal shape, got {tuple(x.shape)} "
            f"and {tuple(y.shape)}"
        )


def _as_float(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(x.dtype, y.dtype)
    if not dtype.is_floating_point:
        dtype = torch.float32
    return x.to(dtype), y.to(dtype)


def psnr(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR in dB, ``(N,)``, data range 1. Identical images give ``+inf`` (not capped here)."""
    _check_pair(x, y, "psnr")
    x, y = _as_float(x, y)
    return peak_signal_noise_ratio(x, y, data_range=1.0, reduction="none", dim=(1, 2, 3))


def ssim(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-image SSIM, ``(N,)``: Gaussian window 11 / sigma 1.5, data range 1 (Wang et al. 2004, eq. 13).

    The SSIM map is averaged over the windows lying entirely inside the image, as in Wang's reference
    ``ssim_index.m`` (``filter2(..., 'valid')``) and scikit-image. torchmetrics >= 1.x averages over a
    reflect-padded full-size map instead, which for 28x28 images changes the score by up to ~0.25; we
    take its full map and crop the 5-pixel border. Channels are averaged. Images must be at least 11x11.
    """
    _check_pair(x, y, "ssim")
    if min(x.shape[-2:]) < SSIM_KERNEL_SIZE:
        raise ValueError(
            f"ssim needs images of at least {SSIM_KERNEL_SIZE}x{SSIM_KERNEL_SIZE}, got {tuple(x.shape)}"
        )
    x, y = _as_float(x, y)
    out = structural_similarity_index_measure(
        x,
        y,
        gaussian_kernel=True,
        sigma=SSIM_SIGMA,
        kernel_size=SSIM_KERNEL_SIZE,
        data_range=1.0,
        reduction="none",
        return_full_image=True,
    )
    assert isinstance(out, tuple)
    pad = (SSIM_KERNEL_SIZE - 1) // 2
    return out[1][..., pad:-pad, pad:-pad].mean(dim=(1, 2, 3))


def reconstruction_rate(
    psnr_values: Sequence[float] | torch.Tensor | np.ndarray,
    threshold_db: float = 18.0,
    *,
    n_total: int | None = None,
) -> float:
    """Fraction of images with PSNR strictly above ``threshold_db`` (``inf`` counts, NaN does not).

    ``n_total`` is the denominator when some ground-truth images have no reconstruction at all (they count
    as failures); it defaults to ``len(psnr_values)``.
    """
    values = np.asarray(
        psnr_values.detach().cpu().numpy() if isinstance(psnr_values, torch.Tensor) else psnr_values,
        dtype=np.float64,
    ).reshape(-1)
    total = values.size if n_total is None else n_total
    if total <= 0:
        raise ValueError("reconstruction_rate needs at least one image")
    if total < values.size:
        raise ValueError(f"n_total={total} is smaller than the number of PSNR values ({values.size})")
    return float(np.count_nonzero(values > threshold_db)) / total


def pairwise_psnr(recon: torch.Tensor, truth: torch.Tensor, *, cap_db: float = PSNR_CAP_DB) -> torch.Tensor:
    """PSNR of every (reconstruction, truth) pair, ``(N_recon, N_truth)`` float64, capped at ``cap_db``.

    MSE via ``(|r|^2 + |t|^2 - 2 r.t) / D`` in float64 (one matrix product instead of N^2 image pairs).
    """
    if recon.dim() != 4 or truth.dim() != 4 or recon.shape[1:] != truth.shape[1:]:
        raise ValueError(
            f"pairwise_psnr: shapes {tuple(recon.shape)} and {tuple(truth.shape)} differ in (C, H, W)"
        )
    r = recon.reshape(recon.shape[0], -1).to(torch.float64)
    t = truth.reshape(truth.shape[0], -1).to(torch.float64)
    sq = (r**2).sum(dim=1)[:, None] + (t**2).sum(dim=1)[None, :] - 2.0 * (r @ t.T)
    mse = (sq / r.shape[1]).clamp(min=0.0)
    floor = 10.0 ** (-cap_db / 10.0)
    return (10.0 * torch.log10(1.0 / mse.clamp(min=floor))).clamp(max=cap_db)


def match_reconstructions(recon: torch.Tensor, truth: torch.Tensor, metric: str = "psnr") -> torch.Tensor:
    """Optimal one-to-one pairing of reconstructions with ground truths (Hungarian algorithm).

    Returns a long tensor ``perm`` of shape ``(N_truth,)``: ``perm[j]`` is the index of the reconstruction
    paired with ``truth[j]``, or ``-1`` when ``truth[j]`` is left unmatched (only when
    ``N_recon < N_truth``; :func:`score_images` counts those as failed reconstructions). With
    ``N_recon > N_truth`` the surplus reconstructions are ignored. The pairing maximises the summed
    pairwise PSNR (capped at ``PSNR_CAP_DB``); ``metric`` must be ``"psnr"``.
    """
    if metric != "psnr":
        raise ValueError(f"unsupported matching metric {metric!r}; supported: 'psnr'")
    scores = pairwise_psnr(recon, truth).cpu().numpy()
    rows, cols = linear_sum_assignment(scores, maximize=True)
    perm = torch.full((truth.shape[0],), -1, dtype=torch.long)
    perm[torch.as_tensor(cols, dtype=torch.long)] = torch.as_tensor(rows, dtype=torch.long)
    return perm


class LPIPSUnavailableError(RuntimeError):
    """LPIPS cannot be computed offline in this environment."""


def lpips_unavailable_reason(weights_path: str | None = None) -> str | None:
    """Why LPIPS cannot be computed, or ``None`` if it can.

    This version never computes LPIPS: its torchmetrics implementation needs torchvision plus ImageNet
    backbone weights, which are not available offline. The reason names the first missing piece.
    """
    if weights_path is None or not os.path.isfile(weights_path):
        return LPIPS_UNAVAILABLE_NOTE
    if importlib.util.find_spec("torchvision") is None:
        return "unavailable: torchvision (needed by the LPIPS backbone) is not installed"
    return "unavailable: loading LPIPS from local backbone weights is not implemented in this version"


def lpips_available(weights_path: str | None = None) -> bool:
    """Whether :func:`lpips` can run; always ``False`` in this version (see ``lpips_unavailable_reason``)."""
    return lpips_unavailable_reason(weights_path) is None


def lpips(x: torch.Tensor, y: torch.Tensor, *, weights_path: str | None = None) -> torch.Tensor:
    """LPIPS per image. Raises :class:`LPIPSUnavailableError` with the reason when it cannot be computed."""
    _check_pair(x, y, "lpips")
    reason = lpips_unavailable_reason(weights_path)
    raise LPIPSUnavailableError(reason or "unavailable")


@dataclass(frozen=True)
class ImageScores:
    """Scores of a batch of reconstructions against ground truths.

    Per-image tuples hold one value per *matched* pair, in ground-truth order; ``psnr`` keeps ``inf`` for
    exact reconstructions. ``matching[j]`` is the reconstruction index paired with truth ``j`` (-1: none).
    Means are over matched pairs; ``psnr_mean`` / ``psnr_var`` (population variance) use PSNR capped at
    ``PSNR_CAP_DB`` = 100 dB. ``reconstruction_rate`` divides by ``n_images`` (all ground truths), so
    unmatched truths count as failures. ``psnr_mean_successful`` / ``ssim_mean_successful`` average over the
    pairs above ``threshold_db`` only (paper 000's "successful subset"; None when there are none).
    ``lpips`` is ``None`` with the reason in ``lpips_note``.
    """

    psnr: tuple[float, ...]
    ssim: tuple[float, ...]
    fsim: tuple[float, ...]  # empty when not computed (``with_fsim=False``)
    matching: tuple[int, ...]
    psnr_mean: float
    psnr_var: float
    ssim_mean: float
    fsim_mean: float | None
    reconstruction_rate: float
    psnr_mean_successful: float | None
    ssim_mean_successful: float | None
    n_images: int
    n_matched: int
    threshold_db: float
    lpips: float | None = None
    lpips_note: str = LPIPS_UNAVAILABLE_NOTE
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe plain dict: per-image PSNR capped at ``PSNR_CAP_DB`` (no inf), tuples become lists."""
        out = asdict(self)
        out["psnr"] = [min(v, PSNR_CAP_DB) for v in self.psnr]
        out["psnr_cap_db"] = PSNR_CAP_DB
        for key in ("ssim", "fsim", "matching", "notes"):
            out[key] = list(out[key])
        return out


def _validate_batch(recon: torch.Tensor, truth: torch.Tensor, match: bool) -> None:
    if recon.dim() != 4 or truth.dim() != 4 or recon.shape[1:] != truth.shape[1:]:
        raise ValueError(
            f"recon shape {tuple(recon.shape)} and truth shape {tuple(truth.shape)} must be "
            "(N, C, H, W) with equal (C, H, W)"
        )
    if recon.shape[0] == 0 or truth.shape[0] == 0:
        raise ValueError(f"empty batch: recon shape {tuple(recon.shape)}, truth shape {tuple(truth.shape)}")
    if not match and recon.shape[0] != truth.shape[0]:
        raise ValueError(
            f"match=False needs as many reconstructions as truths, got recon shape "
            f"{tuple(recon.shape)} and truth shape {tuple(truth.shape)}"
        )
    if torch.isnan(recon).any():
        raise ValueError("recon contains NaN")
    if torch.isnan(truth).any() or truth.min() < 0 or truth.max() > 1:
        raise ValueError("truth must be free of NaN and within [0, 1]")


def score_images(
    recon: torch.Tensor,
    truth: torch.Tensor,
    *,
    match: bool = True,
    threshold_db: float = 18.0,
    lpips_weights: str | None = None,
    with_fsim: bool = True,
) -> ImageScores:
    """Score reconstructions ``recon`` (N_recon, C, H, W) against ``truth`` (N_truth, C, H, W).

    ``with_fsim=False`` skips FSIM (the costliest score; ``fsim`` empty, ``fsim_mean`` None), for guesses
    that are reported by PSNR, SSIM and reconstruction rate only (the null floors).

    ``recon`` is clamped to [0, 1] (attacks optimise unconstrained pixels; the number of clamped values is
    recorded in ``notes``); NaN in ``recon`` raises ``ValueError``. With ``match=True`` reconstructions are
    paired with truths by :func:`match_reconstructions`; otherwise pair ``i`` with ``i`` (equal N required).
    """
    _validate_batch(recon, truth, match)
    recon, truth = _as_float(recon.detach(), truth.detach())
    notes: list[str] = []
    n_out = int(((recon < 0) | (recon > 1)).sum())
    if n_out:
        notes.append(f"recon clamped to [0, 1]: {n_out} of {recon.numel()} values were outside")
        logger.debug("score_images: clamped %d recon values to [0, 1]", n_out)
    recon = recon.clamp(0.0, 1.0)

    if match:
        perm = match_reconstructions(recon, truth)
    else:
        perm = torch.arange(truth.shape[0])
    matched = torch.nonzero(perm >= 0).reshape(-1)
    if matched.numel() < truth.shape[0]:
        notes.append(f"{truth.shape[0] - matched.numel()} truth image(s) unmatched; counted as failures")
    r, t = recon[perm[matched]], truth[matched]

    psnr_vals = psnr(r, t).to(torch.float64)
    capped = psnr_vals.clamp(max=PSNR_CAP_DB)
    ssim_vals = ssim(r, t).to(torch.float64)
    ok = psnr_vals > threshold_db  # paper 000 also reports means over the successful subset
    fsim_vals = fsim(r, t).to(torch.float64) if with_fsim else None
    reason = lpips_unavailable_reason(lpips_weights)
    return ImageScores(
        psnr=tuple(psnr_vals.tolist()),
        ssim=tuple(ssim_vals.tolist()),
        fsim=() if fsim_vals is None else tuple(fsim_vals.tolist()),
        matching=tuple(perm.tolist()),
        psnr_mean=float(capped.mean()),
        psnr_var=float(capped.var(correction=0)),
        ssim_mean=float(ssim_vals.mean()),
        fsim_mean=None if fsim_vals is None else float(fsim_vals.mean()),
        reconstruction_rate=reconstruction_rate(psnr_vals, threshold_db, n_total=truth.shape[0]),
        psnr_mean_successful=float(capped[ok].mean()) if ok.any() else None,
        ssim_mean_successful=float(ssim_vals[ok].mean()) if ok.any() else None,
        n_images=int(truth.shape[0]),
        n_matched=int(matched.numel()),
        threshold_db=float(threshold_db),
        lpips=None,
        lpips_note=reason or LPIPS_UNAVAILABLE_NOTE,
        notes=tuple(notes),
    )
