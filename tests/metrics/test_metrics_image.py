"""Tests for gradleak.metrics image metrics: PSNR, SSIM, FSIM/FSIMc, reconstruction rate, matching, scores.

Reference values come from hand computation or from independent numpy implementations written here:
SSIM after Wang et al. (IEEE TIP 2004, valid-window Gaussian ``ssim_index``), FSIM as a loop-by-loop
transcription of the authors' ``FeatureSIM.m`` / Kovesi's ``phasecong2`` (Zhang et al., IEEE TIP 2011).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from numpy.lib.stride_tricks import sliding_window_view
from scipy.signal import convolve2d

from gradleak.metrics import (
    LPIPS_UNAVAILABLE_NOTE,
    PSNR_CAP_DB,
    LPIPSUnavailableError,
    fsim,
    lpips,
    lpips_available,
    match_reconstructions,
    pairwise_psnr,
    psnr,
    reconstruction_rate,
    score_images,
    ssim,
)
from gradleak.metrics.feature_similarity import _downsample

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
ORGAN = DATA / "medmnist" / "organamnist.npz"
CIFAR = DATA / "cifar10-test-jpeg" / "airplane"


@pytest.fixture(scope="module")
def gray() -> torch.Tensor:
    """16 real 28x28 CT slices, (16, 1, 28, 28) float64 in [0, 1]."""
    if not ORGAN.exists():
        pytest.skip(f"missing {ORGAN}")
    with np.load(ORGAN) as data:
        images = data["test_images"][:16]
    return torch.from_numpy(images).to(torch.float64).div(255.0)[:, None]


@pytest.fixture(scope="module")
def rgb() -> torch.Tensor:
    """8 real 32x32 CIFAR-10 images, (8, 3, 32, 32) float64 in [0, 1]."""
    pil = pytest.importorskip("PIL.Image")
    paths = [CIFAR / f"{i:04d}.jpg" for i in range(8)]
    if not all(p.exists() for p in paths):
        pytest.skip(f"missing CIFAR-10 JPEGs under {CIFAR}")
    arrays = [np.asarray(pil.open(p).convert("RGB")) for p in paths]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).to(torch.float64).div(255.0)


def _noisy(x: torch.Tensor, sigma: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (x + sigma * torch.randn(x.shape, generator=gen, dtype=x.dtype)).clamp(0.0, 1.0)


# ----------------------------------------------------------------------------------------------- PSNR


def test_psnr_constant_images_differing_by_0_1_is_20_db() -> None:
    x = torch.full((3, 1, 28, 28), 0.5, dtype=torch.float64)
    out = psnr(x, x + 0.1)
    assert out.shape == (3,)
    assert torch.allclose(out, torch.full((3,), 20.0, dtype=torch.float64), atol=1e-9)


def test_psnr_matches_hand_computed_mse() -> None:
    x = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    y = torch.tensor([[[[0.1, 0.2], [0.3, 0.4]]]], dtype=torch.float64)
    mse = (0.01 + 0.04 + 0.09 + 0.16) / 4
    assert psnr(x, y).item() == pytest.approx(
        10 * math.log10(1 / mse), abs=1e-5
    )  # torchmetrics: float32 log(10)


def test_psnr_identical_images_is_inf_per_image() -> None:
    x = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[1] = 1 - y[1]
    out = psnr(x, y)
    assert math.isinf(out[0].item()) and out[0] > 0
    assert math.isfinite(out[1].item())


def test_pairwise_psnr_agrees_with_psnr_and_caps_identical(gray: torch.Tensor) -> None:
    noisy = _noisy(gray[:5], 0.05, seed=1)
    table = pairwise_psnr(noisy, gray[:5])
    assert table.shape == (5, 5)
    assert torch.allclose(table.diagonal(), psnr(noisy, gray[:5]), atol=1e-6)
    assert torch.allclose(
        pairwise_psnr(gray[:3], gray[:3]).diagonal(), torch.full((3,), PSNR_CAP_DB).double()
    )


# ----------------------------------------------------------------------------------------------- SSIM


def _ssim_reference(a: np.ndarray, b: np.ndarray) -> float:
    """Wang et al. 2004 SSIM (eq. 13), 11x11 Gaussian sigma 1.5, valid windows only, data range 1."""
    ax = np.arange(11) - 5.0
    g = np.exp(-(ax**2) / (2 * 1.5**2))
    g /= g.sum()
    window = np.outer(g, g)
    c1, c2 = 0.01**2, 0.03**2

    def filt(img: np.ndarray) -> np.ndarray:
        return np.einsum("ijkl,kl->ij", sliding_window_view(img, window.shape), window)

    maps = []
    for ac, bc in zip(a, b, strict=True):  # per channel
        mu_a, mu_b = filt(ac), filt(bc)
        s_aa = filt(ac * ac) - mu_a**2
        s_bb = filt(bc * bc) - mu_b**2
        s_ab = filt(ac * bc) - mu_a * mu_b
        num = (2 * mu_a * mu_b + c1) * (2 * s_ab + c2)
        den = (mu_a**2 + mu_b**2 + c1) * (s_aa + s_bb + c2)
        maps.append(num / den)
    return float(np.mean(maps))


def test_ssim_of_identical_images_is_one(gray: torch.Tensor) -> None:
    assert torch.allclose(ssim(gray, gray), torch.ones(len(gray), dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("kind", ["gray", "rgb"])
def test_ssim_matches_independent_numpy_reference(kind: str, request: pytest.FixtureRequest) -> None:
    x = request.getfixturevalue(kind)[:4]
    y = _noisy(x, 0.1, seed=2)
    got = ssim(x, y)
    want = [_ssim_reference(a.numpy(), b.numpy()) for a, b in zip(x, y, strict=True)]
    assert got.tolist() == pytest.approx(want, abs=1e-4)
    assert all(v < 0.95 for v in want)  # the case is not trivially near 1


# ----------------------------------------------------------------------------------------------- FSIM


def _np_phasecong2(im: np.ndarray) -> np.ndarray:
    """Loop-by-loop numpy transcription of ``phasecong2`` in FeatureSIM.m (Kovesi)."""
    nscale, norient, min_wl, mult, sigma_onf, dtheta_on_sigma, k, eps = 4, 4, 6, 2, 0.55, 1.2, 2.0, 1e-4
    theta_sigma = np.pi / norient / dtheta_on_sigma
    rows, cols = im.shape
    imagefft = np.fft.fft2(im)

    def frange(n: int) -> np.ndarray:
        if n % 2:
            return np.arange(-(n - 1) / 2, (n - 1) / 2 + 1) / (n - 1)
        return np.arange(-n / 2, n / 2) / n

    x, y = np.meshgrid(frange(cols), frange(rows))
    radius = np.sqrt(x**2 + y**2)
    theta = np.arctan2(-y, x)
    lp = np.fft.ifftshift(1.0 / (1.0 + (radius / 0.45) ** (2 * 15)))
    radius = np.fft.ifftshift(radius)
    theta = np.fft.ifftshift(theta)
    radius[0, 0] = 1
    sintheta, costheta = np.sin(theta), np.cos(theta)
    log_gabor = []
    for s in range(nscale):
        fo = 1.0 / (min_wl * mult**s)
        lg = np.exp(-(np.log(radius / fo) ** 2) / (2 * np.log(sigma_onf) ** 2)) * lp
        lg[0, 0] = 0
        log_gabor.append(lg)
    energy_all = np.zeros((rows, cols))
    an_all = np.zeros((rows, cols))
    for o in range(norient):
        angl = o * np.pi / norient
        ds = sintheta * np.cos(angl) - costheta * np.sin(angl)
        dc = costheta * np.cos(angl) + sintheta * np.sin(angl)
        spread = np.exp(-(np.abs(np.arctan2(ds, dc)) ** 2) / (2 * theta_sigma**2))
        sum_e = np.zeros((rows, cols))
        sum_o = np.zeros((rows, cols))
        sum_an = np.zeros((rows, cols))
        eo, ifft_filters = [], []
        em_n = 0.0
        for s in range(nscale):
            filt = log_gabor[s] * spread
            ifft_filters.append(np.real(np.fft.ifft2(filt)) * np.sqrt(rows * cols))
            eo.append(np.fft.ifft2(imagefft * filt))
            sum_an += np.abs(eo[s])
            sum_e += np.real(eo[s])
            sum_o += np.imag(eo[s])
            if s == 0:
                em_n = float(np.sum(filt**2))
        x_energy = np.sqrt(sum_e**2 + sum_o**2) + eps
        mean_e, mean_o = sum_e / x_energy, sum_o / x_energy
        energy = np.zeros((rows, cols))
        for s in range(nscale):
            e, od = np.real(eo[s]), np.imag(eo[s])
            energy += e * mean_e + od * mean_o - np.abs(e * mean_o - od * mean_e)
        mean_e2n = -np.median(np.abs(eo[0]) ** 2) / np.log(0.5)
        noise_power = mean_e2n / em_n
        est_an2 = sum(np.sum(f**2) for f in ifft_filters)
        est_aiaj = sum(
            np.sum(ifft_filters[i] * ifft_filters[j]) for i in range(nscale - 1) for j in range(i + 1, nscale)
        )
        tau = np.sqrt((2 * noise_power * est_an2 + 4 * noise_power * est_aiaj) / 2)
        t = (tau * np.sqrt(np.pi / 2) + k * np.sqrt((2 - np.pi / 2) * tau**2)) / 1.7
        energy_all += np.maximum(energy - t, 0)
        an_all += sum_an
    return energy_all / an_all


def _np_feature_sim(ref: np.ndarray, dis: np.ndarray) -> tuple[float, float]:
    """Transcription of FeatureSIM.m for small images (F = 1); inputs (C, H, W) on the 0..255 scale."""
    ones = np.ones(ref.shape[1:])
    if ref.shape[0] == 3:
        y1 = 0.299 * ref[0] + 0.587 * ref[1] + 0.114 * ref[2]
        y2 = 0.299 * dis[0] + 0.587 * dis[1] + 0.114 * dis[2]
        i1 = 0.596 * ref[0] - 0.274 * ref[1] - 0.322 * ref[2]
        i2 = 0.596 * dis[0] - 0.274 * dis[1] - 0.322 * dis[2]
        q1 = 0.211 * ref[0] - 0.523 * ref[1] + 0.312 * ref[2]
        q2 = 0.211 * dis[0] - 0.523 * dis[1] + 0.312 * dis[2]
    else:
        y1, y2, i1, i2, q1, q2 = ref[0], dis[0], ones, ones, ones, ones
    pc1, pc2 = _np_phasecong2(y1), _np_phasecong2(y2)
    dx = np.array([[3, 0, -3], [10, 0, -10], [3, 0, -3]]) / 16
    dy = np.array([[3, 10, 3], [0, 0, 0], [-3, -10, -3]]) / 16
    g1 = np.sqrt(convolve2d(y1, dx, mode="same") ** 2 + convolve2d(y1, dy, mode="same") ** 2)
    g2 = np.sqrt(convolve2d(y2, dx, mode="same") ** 2 + convolve2d(y2, dy, mode="same") ** 2)
    s_pc = (2 * pc1 * pc2 + 0.85) / (pc1**2 + pc2**2 + 0.85)
    s_g = (2 * g1 * g2 + 160) / (g1**2 + g2**2 + 160)
    pcm = np.maximum(pc1, pc2)
    fsim_value = np.sum(s_g * s_pc * pcm) / np.sum(pcm)
    s_i = (2 * i1 * i2 + 200) / (i1**2 + i2**2 + 200)
    s_q = (2 * q1 * q2 + 200) / (q1**2 + q2**2 + 200)
    s_c = np.real(np.power((s_i * s_q).astype(complex), 0.03))
    fsimc_value = np.sum(s_g * s_pc * s_c * pcm) / np.sum(pcm)
    return float(fsim_value), float(fsimc_value)


@pytest.mark.parametrize("kind", ["gray", "rgb"])
def test_fsim_matches_transcribed_reference_implementation(kind: str, request: pytest.FixtureRequest) -> None:
    x = request.getfixturevalue(kind)[:3, :, :27, :31]  # odd sizes exercise the odd-length frequency grid
    y = _noisy(x, 0.08, seed=3)
    reference = [_np_feature_sim(a.numpy() * 255, b.numpy() * 255) for a, b in zip(x, y, strict=True)]
    assert fsim(x, y).tolist() == pytest.approx([r[1] for r in reference], abs=1e-8)  # FSIMc
    assert fsim(x, y, chromatic=False).tolist() == pytest.approx([r[0] for r in reference], abs=1e-8)


@pytest.mark.parametrize("kind", ["gray", "rgb"])
def test_fsim_of_identical_images_is_one(kind: str, request: pytest.FixtureRequest) -> None:
    x = request.getfixturevalue(kind)
    assert torch.allclose(fsim(x, x), torch.ones(len(x), dtype=torch.float64), atol=1e-6)
    assert fsim(x.float(), x.float()).dtype == torch.float32


@pytest.mark.parametrize("kind", ["gray", "rgb"])
def test_fsim_decreases_as_gaussian_noise_grows(kind: str, request: pytest.FixtureRequest) -> None:
    x = request.getfixturevalue(kind)[:8]
    means = [fsim(x, _noisy(x, sigma, seed=4)).mean().item() for sigma in (0.02, 0.05, 0.1, 0.2)]
    assert all(a > b for a, b in itertools.pairwise(means)), means
    assert means[0] > 0.95 and means[-1] < 0.85, means


def test_fsim_is_bounded_and_symmetric(gray: torch.Tensor, rgb: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(5)
    for x in (gray, rgb):
        y = torch.rand(x.shape, generator=gen, dtype=x.dtype)
        for a, b in ((x, y), (x, 1 - x), (x, _noisy(x, 0.3, seed=6))):
            values = fsim(a, b)
            assert bool(((values >= 0) & (values <= 1)).all()), values
            assert torch.allclose(values, fsim(b, a), atol=1e-12)


def test_fsim_flat_images_and_structure_loss(gray: torch.Tensor) -> None:
    # Two constant images have no phase congruency (sum PC_m = 0, NaN in the reference): the unweighted
    # mean of S_L is used; only the zero-padded borders carry gradient, so a brightness shift scores ~1.
    flat = torch.full((1, 1, 28, 28), 0.5, dtype=torch.float64)
    value = fsim(flat, flat + 0.2).item()
    assert 0.95 < value < 1.0
    assert fsim(flat, flat).item() == pytest.approx(1.0, abs=1e-12)
    # An image against its own mean grey level loses all structure: far below a mildly noisy copy.
    x = gray[:8]
    mean_image = x.mean(dim=(2, 3), keepdim=True).expand_as(x)
    lost = fsim(x, mean_image)
    assert bool((lost < 0.5).all()), lost
    assert bool((lost < fsim(x, _noisy(x, 0.05, seed=7))).all())


def test_fsim_penalises_larger_spatial_shifts(gray: torch.Tensor) -> None:
    x = gray[:8]
    by_one = fsim(x, torch.roll(x, 1, dims=-1)).mean().item()
    by_three = fsim(x, torch.roll(x, 3, dims=-1)).mean().item()
    assert 1.0 > by_one > by_three


def test_fsim_downsample_matches_matlab_box_filter() -> None:
    x = torch.arange(64, dtype=torch.float64).reshape(1, 1, 8, 8)
    # F = 2: conv2(..., ones(2)/4, 'same') keeps (i, i+1), sampling every 2nd pixel = 2x2 block means.
    assert torch.allclose(_downsample(x, 2), torch.nn.functional.avg_pool2d(x, 2))
    # F = 3: window (i-1, i, i+1), zero padded, divided by 9; first sample sees the padding.
    assert _downsample(x, 3)[0, 0, 0, 0].item() == pytest.approx((0 + 1 + 8 + 9) / 9)


def test_fsim_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="channels"):
        fsim(torch.zeros(1, 2, 16, 16), torch.zeros(1, 2, 16, 16))
    with pytest.raises(ValueError, match="equal shape"):
        fsim(torch.zeros(1, 1, 16, 16), torch.zeros(1, 1, 16, 17))


# ----------------------------------------------------------------------------------- reconstruction rate


def test_reconstruction_rate_on_hand_made_list() -> None:
    values = [10.0, 18.0, 18.01, math.inf, math.nan, 25.0]
    assert reconstruction_rate(values) == pytest.approx(3 / 6)  # 18.0 itself is not "> 18"
    assert reconstruction_rate(values, threshold_db=20.0) == pytest.approx(2 / 6)
    assert reconstruction_rate(torch.tensor(values), n_total=8) == pytest.approx(3 / 8)
    with pytest.raises(ValueError):
        reconstruction_rate([])


# ----------------------------------------------------------------------------------------------- matching


def test_matching_recovers_known_permutation(gray: torch.Tensor) -> None:
    order = torch.randperm(len(gray), generator=torch.Generator().manual_seed(8))
    recon = _noisy(gray[order], 0.05, seed=9)  # recon[i] is a noisy copy of truth[order[i]]
    perm = match_reconstructions(recon, gray)
    assert perm.dtype == torch.long
    assert torch.equal(order[perm], torch.arange(len(gray)))


def _greedy_total(scores: np.ndarray) -> float:
    s = scores.copy()
    total = 0.0
    for _ in range(min(s.shape)):
        i, j = np.unravel_index(np.argmax(s), s.shape)
        total += scores[i, j]
        s[i, :] = -np.inf
        s[:, j] = -np.inf
    return total


def test_matching_beats_greedy_on_crafted_case() -> None:
    # truth 0.50 / 0.60; recon 0.54 is closest to truth 0, recon 0.45 is only close to truth 0.
    truth = torch.tensor([0.50, 0.60], dtype=torch.float64).reshape(2, 1, 1, 1).expand(2, 1, 12, 12)
    recon = torch.tensor([0.54, 0.45], dtype=torch.float64).reshape(2, 1, 1, 1).expand(2, 1, 12, 12)
    perm = match_reconstructions(recon, truth)
    assert perm.tolist() == [1, 0]
    scores = pairwise_psnr(recon, truth).numpy()
    optimal = scores[perm.numpy(), np.arange(2)].sum()
    assert optimal == pytest.approx(-20 * math.log10(0.05) - 20 * math.log10(0.06), abs=1e-6)
    assert optimal > _greedy_total(scores) + 5.0


def test_matching_is_optimal_by_brute_force(gray: torch.Tensor) -> None:
    recon = _noisy(gray[:5].flip(0), 0.25, seed=10) * 0.5 + _noisy(gray[5:10], 0.25, seed=11) * 0.5
    scores = pairwise_psnr(recon, gray[:5]).numpy()
    perm = match_reconstructions(recon, gray[:5]).numpy()
    best = max(sum(scores[p[j], j] for j in range(5)) for p in itertools.permutations(range(5)))
    assert scores[perm, np.arange(5)].sum() == pytest.approx(best, abs=1e-9)


def test_matching_with_unequal_counts(gray: torch.Tensor) -> None:
    fewer = match_reconstructions(gray[[3, 0]], gray[:4])
    assert fewer.tolist() == [1, -1, -1, 0]
    more = match_reconstructions(gray[[5, 1, 0]], gray[:2])
    assert more.tolist() == [2, 1]
    with pytest.raises(ValueError, match="metric"):
        match_reconstructions(gray, gray, metric="ssim")


# ----------------------------------------------------------------------------------------------- scores


def test_score_images_end_to_end(gray: torch.Tensor) -> None:
    truth = gray[:6]
    recon = torch.cat([truth[:2], _noisy(truth[2:4], 0.02, seed=12), _noisy(truth[4:], 0.5, seed=13)])
    order = torch.tensor([5, 3, 0, 4, 1, 2])
    scores = score_images(recon[order] * 1.1 - 0.05, truth)  # pushes values outside [0, 1]
    assert scores.n_images == scores.n_matched == 6
    assert scores.matching == tuple(torch.argsort(order).tolist())
    assert any("clamped" in note for note in scores.notes)
    assert scores.reconstruction_rate == pytest.approx(len([p for p in scores.psnr if p > 18]) / 6)
    assert math.isfinite(scores.psnr_mean) and scores.psnr_mean <= PSNR_CAP_DB
    assert scores.ssim_mean == pytest.approx(float(np.mean(scores.ssim)))
    assert 0 < scores.fsim_mean < 1
    assert scores.lpips is None and scores.lpips_note == LPIPS_UNAVAILABLE_NOTE
    quick = score_images(
        recon[order] * 1.1 - 0.05, truth, with_fsim=False
    )  # the floors' scoring: the same, without FSIM
    assert quick.fsim == () and quick.fsim_mean is None
    assert (quick.psnr, quick.ssim, quick.matching) == (scores.psnr, scores.ssim, scores.matching)
    assert quick.reconstruction_rate == scores.reconstruction_rate


def test_score_images_caps_inf_psnr_in_summary(gray: torch.Tensor) -> None:
    truth = gray[:4]
    scores = score_images(truth.clone(), truth, match=False)
    assert all(math.isinf(p) for p in scores.psnr)
    assert scores.psnr_mean == PSNR_CAP_DB and scores.psnr_var == 0.0
    assert scores.reconstruction_rate == 1.0
    assert scores.ssim_mean == pytest.approx(1.0) and scores.fsim_mean == pytest.approx(1.0)
    as_dict = scores.to_dict()
    json.dumps(as_dict, allow_nan=False)  # JSON-safe: no inf
    assert as_dict["psnr"] == [PSNR_CAP_DB] * 4 and as_dict["lpips"] is None


def test_score_images_counts_unmatched_truths_as_failures(gray: torch.Tensor) -> None:
    scores = score_images(gray[:2].clone(), gray[:4])
    assert scores.n_images == 4 and scores.n_matched == 2
    assert scores.reconstruction_rate == pytest.approx(0.5)
    assert scores.matching == (0, 1, -1, -1)
    assert len(scores.psnr) == 2


def test_score_images_validation_errors(gray: torch.Tensor, rgb: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"\(2, 1, 28, 28\).*\(2, 3, 28, 28\)"):
        score_images(gray[:2], rgb[:2, :, :28, :28])
    bad = gray[:2].clone()
    bad[0, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        score_images(bad, gray[:2])
    with pytest.raises(ValueError, match="match=False"):
        score_images(gray[:2], gray[:3], match=False)
    with pytest.raises(ValueError, match="truth"):
        score_images(gray[:2], gray[:2] + 1.0)


def test_lpips_reported_unavailable(tmp_path: Path, gray: torch.Tensor) -> None:
    assert not lpips_available()
    assert not lpips_available(str(tmp_path / "missing.pth"))
    with pytest.raises(LPIPSUnavailableError, match="unavailable"):
        lpips(gray[:2], gray[:2])


def test_successful_subset_means():
    """Two exact copies (capped 100 dB, SSIM 1) and two poor ones: the successful subset is the copies."""
    g = torch.Generator().manual_seed(3)
    truth = torch.rand((4, 1, 16, 16), generator=g)
    recon = truth.clone()
    recon[2:] = 0.5  # flat grey: far below 18 dB against uniform noise
    s = score_images(recon, truth, match=False)
    assert s.reconstruction_rate == 0.5
    assert s.psnr_mean_successful == pytest.approx(100.0)
    assert s.ssim_mean_successful == pytest.approx(1.0, abs=1e-6)
    assert s.psnr_mean < 60.0
    none = score_images(torch.full_like(truth, 0.5), truth, match=False)
    assert none.psnr_mean_successful is None and none.ssim_mean_successful is None
