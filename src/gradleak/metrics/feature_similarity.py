"""Feature SIMilarity index (FSIM / FSIMc), written in torch.

Reference: L. Zhang, L. Zhang, X. Mou, D. Zhang, "FSIM: A Feature Similarity Index for Image Quality
Assessment", IEEE Trans. Image Processing 20(8):2378-2386, 2011, and the authors' reference MATLAB code
``FeatureSIM.m`` (which embeds P. Kovesi's ``phasecong2``; Kovesi, "Image Features From Phase Congruency",
Videre 1(3), 1999). Equation numbers below are those of the TIP paper.

Pipeline, following the reference implementation step by step:

* Inputs in [0, 1] are rescaled to the 0..255 range the constants T1..T4 were tuned for.
* RGB -> YIQ (paper eq. 9); grayscale images use Y = the image and I = Q = 1 (so the chromatic term is 1).
* Downsampling by ``F = max(1, round(min(H, W) / 256))`` with an F x F box filter (MATLAB ``conv2 'same'``,
  zero padding) then keeping every F-th pixel. F is 1 for images smaller than 384 pixels.
* Phase congruency PC (eq. 1-3): log-Gabor filters built in the frequency domain, 4 scales
  (minimum wavelength 6, multiplier 2, sigma_on_f 0.55) x 4 orientations (angular sigma
  pi / 4 / 1.2), multiplied by a Butterworth low-pass (cutoff 0.45, order 15). Noise compensation is
  Kovesi's: the noise power is estimated from the median squared response at the smallest scale
  (Rayleigh model), the threshold is ``mean + k * sigma`` with k = 2, divided by the empirical 1.7.
* Gradient magnitude G (eq. 4) with the Scharr operator ``[3 0 -3; 10 0 -10; 3 0 -3] / 16``, zero padding.
* S_PC = (2 PC1 PC2 + T1) / (PC1^2 + PC2^2 + T1), T1 = 0.85 (eq. 5);
  S_G = (2 G1 G2 + T2) / (G1^2 + G2^2 + T2), T2 = 160 (eq. 6); S_L = S_PC * S_G (eq. 7).
* FSIM = sum(S_L * PC_m) / sum(PC_m), PC_m = max(PC1, PC2) (eq. 8).
* FSIMc (eq. 10-11): S_I, S_Q with T3 = T4 = 200 and
  FSIMc = sum(S_L * Re[(S_I S_Q)^lambda] * PC_m) / sum(PC_m), lambda = 0.03.

Deviations from the reference, both only for degenerate inputs where MATLAB returns NaN:

* where the summed filter amplitude is exactly 0 (a perfectly flat image), PC is set to 0 instead of 0/0;
* when sum(PC_m) == 0 (both images have no phase-congruent structure, e.g. two constant images) the
  weighted mean of eq. 8 is undefined; we return the unweighted mean of the local similarity map instead.

All arithmetic is in float64 (float32 on devices without float64 support); the result has the input dtype.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

__all__ = ["fsim", "phase_congruency", "gradient_magnitude", "rgb_to_yiq"]

# phasecong2 parameters (reference implementation defaults).
N_SCALE = 4
N_ORIENT = 4
MIN_WAVELENGTH = 6.0
MULT = 2.0
SIGMA_ON_F = 0.55
D_THETA_ON_SIGMA = 1.2
K_NOISE = 2.0
EPSILON = 1e-4
LOWPASS_CUTOFF = 0.45
LOWPASS_ORDER = 15
NOISE_RESCALE = 1.7
# FSIM constants, on the 0..255 scale (paper section III and FeatureSIM.m).
T1 = 0.85
T2 = 160.0
T3 = 200.0
T4 = 200.0
LAMBDA = 0.03
MIN_SIZE = 4
# Upper bound on complex elements of the filter-response tensor processed at once (memory cap).
_MAX_RESPONSE_ELEMENTS = 1 << 23

_SCHARR = torch.tensor([[3.0, 0.0, -3.0], [10.0, 0.0, -10.0], [3.0, 0.0, -3.0]], dtype=torch.float64) / 16.0


def _work_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _matlab_range(n: int) -> torch.Tensor:
    """Normalised frequency coordinates exactly as ``phasecong2`` builds them (odd and even n differ)."""
    idx = torch.arange(n, dtype=torch.float64)
    if n % 2:
        return (idx - (n - 1) / 2) / (n - 1)
    return (idx - n // 2) / n


@functools.lru_cache(maxsize=32)
def _filter_bank(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-Gabor filter bank for an image of ``rows x cols`` (float64, CPU; treat as read-only).

    Returns ``(filters, em_n, noise_sum)``: ``filters`` (N_SCALE, N_ORIENT, rows, cols) in unshifted FFT
    layout; ``em_n`` (N_ORIENT,) the summed squared smallest-scale filter; ``noise_sum`` (N_ORIENT,)
    ``2 * sum(ifftFilt_s^2) + 4 * sum_{si<sj} ifftFilt_si * ifftFilt_sj`` so that the expected squared noise
    energy is ``noise_power * noise_sum`` (Kovesi's estimate).
    """
    y, x = torch.meshgrid(_matlab_range(rows), _matlab_range(cols), indexing="ij")
    radius = torch.sqrt(x**2 + y**2)
    theta = torch.atan2(-y, x)
    lowpass = torch.fft.ifftshift(1.0 / (1.0 + (radius / LOWPASS_CUTOFF) ** (2 * LOWPASS_ORDER)))
    radius = torch.fft.ifftshift(radius)
    theta = torch.fft.ifftshift(theta)
    radius[0, 0] = 1.0  # avoid log(0); the DC value of every filter is zeroed below
    sin_t, cos_t = torch.sin(theta), torch.cos(theta)

    log_gabor = []
    for s in range(N_SCALE):
        fo = 1.0 / (MIN_WAVELENGTH * MULT**s)
        lg = torch.exp(-(torch.log(radius / fo) ** 2) / (2 * math.log(SIGMA_ON_F) ** 2)) * lowpass
        lg[0, 0] = 0.0
        log_gabor.append(lg)

    theta_sigma = math.pi / N_ORIENT / D_THETA_ON_SIGMA
    spread = []
    for o in range(N_ORIENT):
        angle = o * math.pi / N_ORIENT
        ds = sin_t * math.cos(angle) - cos_t * math.sin(angle)
        dc = cos_t * math.cos(angle) + sin_t * math.sin(angle)
        dtheta = torch.abs(torch.atan2(ds, dc))
        spread.append(torch.exp(-(dtheta**2) / (2 * theta_sigma**2)))

    filters = torch.stack([torch.stack([lg * sp for sp in spread]) for lg in log_gabor])  # (S, O, H, W)
    em_n = (filters[0] ** 2).sum(dim=(-2, -1))
    ifft_filt = torch.fft.ifft2(filters).real * math.sqrt(rows * cols)
    sum_an2 = (ifft_filt**2).sum(dim=(0, -2, -1))
    sum_aiaj = torch.zeros(N_ORIENT, dtype=torch.float64)
    for si in range(N_SCALE - 1):
        for sj in range(si + 1, N_SCALE):
            sum_aiaj += (ifft_filt[si] * ifft_filt[sj]).sum(dim=(-2, -1))
    noise_sum = 2 * sum_an2 + 4 * sum_aiaj
    return filters, em_n, noise_sum


def _matlab_median(values: torch.Tensor) -> torch.Tensor:
    """Median over the last dim; averages the two middle values for even counts, like MATLAB."""
    n = values.shape[-1]
    ordered = torch.sort(values, dim=-1).values
    if n % 2:
        return ordered[..., n // 2]
    return 0.5 * (ordered[..., n // 2 - 1] + ordered[..., n // 2])


def phase_congruency(images: torch.Tensor) -> torch.Tensor:
    """Phase congruency map PC2 of Kovesi (``phasecong2``) for a batch ``(B, H, W)``; paper eq. 1-3.

    Input is expected on the 0..255 scale (the noise-stabilising epsilon is absolute). Output in [0, 1].
    """
    if images.dim() != 3:
        raise ValueError(f"phase_congruency expects (B, H, W), got shape {tuple(images.shape)}")
    rows, cols = images.shape[-2:]
    dtype = _work_dtype(images.device)
    filters, em_n, noise_sum = (t.to(images.device, dtype) for t in _filter_bank(rows, cols))
    chunk = max(1, _MAX_RESPONSE_ELEMENTS // (N_SCALE * N_ORIENT * rows * cols))
    outputs = [
        _phase_congruency_chunk(part.to(dtype), filters, em_n, noise_sum) for part in images.split(chunk)
    ]
    return torch.cat(outputs)


def _phase_congruency_chunk(
    images: torch.Tensor, filters: torch.Tensor, em_n: torch.Tensor, noise_sum: torch.Tensor
) -> torch.Tensor:
    spectrum = torch.fft.fft2(images)  # (B, H, W)
    eo = torch.fft.ifft2(spectrum[:, None, None] * filters)  # (B, S, O, H, W)
    even, odd, amplitude = eo.real, eo.imag, eo.abs()
    sum_e, sum_o = even.sum(dim=1), odd.sum(dim=1)  # (B, O, H, W)
    x_energy = torch.sqrt(sum_e**2 + sum_o**2) + EPSILON
    mean_e = (sum_e / x_energy)[:, None]
    mean_o = (sum_o / x_energy)[:, None]
    energy = (even * mean_e + odd * mean_o - torch.abs(even * mean_o - odd * mean_e)).sum(dim=1)

    # Noise compensation (Kovesi): Rayleigh-distributed noise energy from the smallest scale.
    median_e2n = _matlab_median((amplitude[:, 0] ** 2).flatten(-2))  # (B, O)
    mean_e2n = -median_e2n / math.log(0.5)
    noise_power = mean_e2n / em_n
    tau = torch.sqrt(noise_power * noise_sum / 2)
    threshold = (tau * math.sqrt(math.pi / 2) + K_NOISE * tau * math.sqrt(2 - math.pi / 2)) / NOISE_RESCALE
    energy = torch.clamp(energy - threshold[..., None, None], min=0.0)

    energy_all = energy.sum(dim=1)
    amplitude_all = amplitude.sum(dim=(1, 2))
    safe = torch.where(amplitude_all > 0, amplitude_all, torch.ones_like(amplitude_all))
    return torch.where(amplitude_all > 0, energy_all / safe, torch.zeros_like(energy_all))


def gradient_magnitude(images: torch.Tensor) -> torch.Tensor:
    """Scharr gradient magnitude (paper eq. 4) of ``(B, H, W)``, zero padding (MATLAB ``conv2 'same'``)."""
    kernel = torch.stack([_SCHARR, _SCHARR.T])[:, None].to(images.device, images.dtype)
    grads = F.conv2d(images[:, None], kernel, padding=1)
    return torch.sqrt((grads**2).sum(dim=1))


def rgb_to_yiq(rgb: torch.Tensor) -> torch.Tensor:
    """RGB (N, 3, H, W) -> YIQ (N, 3, H, W) with the coefficients of ``FeatureSIM.m`` (paper eq. 9)."""
    matrix = torch.tensor(
        [[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]],
        dtype=rgb.dtype,
        device=rgb.device,
    )
    return torch.einsum("ij,njhw->nihw", matrix, rgb)


def _downsample(images: torch.Tensor, factor: int) -> torch.Tensor:
    """F x F box filter with MATLAB ``conv2(..., 'same')`` alignment and zero padding, then stride F."""
    if factor == 1:
        return images
    before, after = (factor - 1) // 2, factor // 2
    padded = F.pad(images, (before, after, before, after))
    return F.avg_pool2d(padded, factor, stride=1)[..., ::factor, ::factor]


def _similarity(a: torch.Tensor, b: torch.Tensor, constant: float) -> torch.Tensor:
    return (2 * a * b + constant) / (a**2 + b**2 + constant)


def fsim(x: torch.Tensor, y: torch.Tensor, *, chromatic: bool = True) -> torch.Tensor:
    """FSIM per image pair, ``(N,)``: FSIMc (eq. 11) for 3-channel input if ``chromatic``, else FSIM (eq. 8).

    ``x``, ``y``: (N, C, H, W) in [0, 1], C in {1, 3}. FSIM is symmetric in its arguments.
    For grayscale input FSIMc and FSIM coincide (the reference sets I = Q = 1).
    """
    if x.shape != y.shape or x.dim() != 4:
        raise ValueError(
            f"fsim expects two (N, C, H, W) tensors of equal shape, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    n, channels, height, width = x.shape
    if channels not in (1, 3):
        raise ValueError(f"fsim supports 1 or 3 channels, got C={channels}")
    if min(height, width) < MIN_SIZE:
        raise ValueError(f"fsim needs images of at least {MIN_SIZE}x{MIN_SIZE}, got {height}x{width}")
    out_dtype = x.dtype if x.is_floating_point() else torch.float32
    dtype = _work_dtype(x.device)
    both = torch.cat([x, y]).to(dtype) * 255.0
    if channels == 3:
        both = rgb_to_yiq(both)
    factor = max(1, round(min(height, width) / 256))
    both = _downsample(both, factor)

    lum = both[:, 0]
    pc = phase_congruency(lum)
    grad = gradient_magnitude(lum)
    pc1, pc2 = pc[:n], pc[n:]
    s_l = _similarity(pc1, pc2, T1) * _similarity(grad[:n], grad[n:], T2)
    if channels == 3 and chromatic:
        s_iq = _similarity(both[:n, 1], both[n:, 1], T3) * _similarity(both[:n, 2], both[n:, 2], T4)
        # MATLAB's real((S_I S_Q)^lambda): a negative base gives |.|^lambda * cos(lambda * pi).
        s_c = torch.where(
            s_iq >= 0, s_iq.clamp(min=0) ** LAMBDA, s_iq.abs() ** LAMBDA * math.cos(LAMBDA * math.pi)
        )
        s_l = s_l * s_c
    pc_m = torch.maximum(pc1, pc2)
    weight_sum = pc_m.sum(dim=(-2, -1))
    weighted = (s_l * pc_m).sum(dim=(-2, -1)) / torch.where(weight_sum > 0, weight_sum, 1.0)
    degenerate = weight_sum <= 0
    if bool(degenerate.any()):
        logger.debug(
            "fsim: %d pair(s) without phase-congruent structure; using unweighted mean", int(degenerate.sum())
        )
    result = torch.where(degenerate, s_l.mean(dim=(-2, -1)), weighted)
    return result.to(out_dtype)
