"""Reconstruction-quality metrics (images: PSNR, SSIM, FSIM/FSIMc, reconstruction rate, matching)."""

from gradleak.metrics.feature_similarity import fsim
from gradleak.metrics.image import (
    LPIPS_UNAVAILABLE_NOTE,
    PSNR_CAP_DB,
    ImageScores,
    LPIPSUnavailableError,
    lpips,
    lpips_available,
    lpips_unavailable_reason,
    match_reconstructions,
    pairwise_psnr,
    psnr,
    reconstruction_rate,
    score_images,
    ssim,
)

__all__ = [
    "LPIPS_UNAVAILABLE_NOTE",
    "PSNR_CAP_DB",
    "ImageScores",
    "LPIPSUnavailableError",
    "fsim",
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
