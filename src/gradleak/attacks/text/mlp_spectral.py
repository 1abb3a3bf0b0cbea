"""MLP-SVD that knows the MLP gradient was flooded with noise: the span above the noise's bulk edge.

What it knows of the defense: that each entry of the MLP gradients carries i.i.d. Gaussian noise, and its
standard deviation s when a defense states it (DP: ``<defense>/noise_std``, or ``noise_std`` by hand).
AEGIS's MLP flood (paper 002, Eq. 4; :mod:`gradleak.defenses.aegis_llm`) adds N(0, (lambda_fc m_bar)^2)
per entry with m_bar the mean norm of the client's active rows, which is not sent; there the attack
estimates s from the matrix itself: a row of the retained signal, of norm about rho_fc m_bar, spreads
over k entries against noise lambda_fc m_bar in each, so nearly every entry is noise and the normal
median absolute deviation, median |g_ij| / 0.6745, estimates s (a robust scale, Hampel 1974).

Then, as :mod:`gradleak.attacks.text.dager.spectral` does for attention: the top singular vectors of
block 1's MLP-expansion gradient above the bulk edge e = s (sqrt(d) + sqrt(k) + ``tail``) (pure noise
passes it with probability at most exp(-tail^2 / 2)) are the span, and the vocabulary tokens whose
context-free MLP input lies closest to it are returned, as many as the span's rank (MLP-SVD's rule,
:mod:`gradleak.attacks.text.mlp_svd`).

What it reports beside: ``snr`` = the largest singular value over the edge for block 1, and ``snr_max``
and ``snr_block{i}`` for every block's MLP-expansion gradient (a later block's input depends on the
context, so only block 1 is probed for tokens; its SNR still says whether a channel is open). With
nothing above the edge it returns nothing and says so. Under AEGIS's default ``rho_fc = 0`` the MLP
gradient holds no signal at all: every SNR is pure noise's, (sqrt(d) + sqrt(k)) / (sqrt(d) + sqrt(k) +
tail) < 1.

Where no noise is stated or configured the attack estimates s even from a clean gradient (whose entries
are all signal): there the edge sits at the signal's own scale and the attack reads less than exact
MLP-SVD. It is the column for flooded or noised updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from gradleak.attacks.noise import check_noise_options, entry_noise_std
from gradleak.attacks.text.dager.spectral import bulk_edge
from gradleak.attacks.text.family import Span, family_of, input_side_gradient
from gradleak.attacks.text.mlp_svd import MLPSVD, MLPSVDConfig
from gradleak.registry import ATTACKS
from gradleak.types import Observation


@dataclass(frozen=True)
class MLPSpectralConfig(MLPSVDConfig):
    """MLP-SVD's options plus what the attack knows of the noise: ``noise_std`` (None: the update's stated
    scale, else estimated from each matrix, :func:`~gradleak.attacks.noise.robust_noise_std`) and the
    edge's ``tail`` (in noise standard deviations)."""

    noise_std: float | None = None
    tail: float = 6.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_noise_options(self.noise_std, self.tail)


class MLPSpectral(MLPSVD):
    """MLP-SVD on the span above the noise's bulk edge (module docstring); reads ``obs.model``,
    ``obs.update`` and the update's stated noise scale, if any."""

    config: MLPSpectralConfig

    def __init__(self, config: MLPSpectralConfig | None = None) -> None:
        super().__init__(config or MLPSpectralConfig())

    def noise_std(self, obs: Observation, grad: torch.Tensor) -> tuple[float, bool]:
        """The noise scale of ``grad``'s entries and whether it was estimated (not stated or configured)."""
        return entry_noise_std(obs, grad, self.config.noise_std, "mlp_spectral")

    def edge(self, obs: Observation, grad: torch.Tensor) -> tuple[float, bool, float]:
        """``grad``'s noise scale, whether it was estimated, and the bulk edge at that scale."""
        std, estimated = self.noise_std(obs, grad)
        return std, estimated, bulk_edge(tuple(grad.shape), std, self.config.tail)

    def span(self, obs: Observation, model: nn.Module, grad: torch.Tensor) -> tuple[Span, dict[str, float]]:
        std, estimated, edge = self.edge(obs, grad)
        u, s, _ = torch.linalg.svd(grad.to(torch.float64), full_matrices=False)
        stats = {"noise_std": std, "noise_estimated": float(estimated), "edge": edge,
                 "snr_block1": _ratio(float(s[0]), edge)}  # fmt: skip
        spec = family_of(model)
        blocks = int(getattr(getattr(model, "config", None), "num_hidden_layers", 1))
        for i in range(1, blocks):  # the later blocks' channels: open or not (not probed for tokens)
            later = input_side_gradient(obs, model, spec.mlp_inputs, i)
            top = float(torch.linalg.svdvals(later.to(torch.float64))[0])
            stats[f"snr_block{i + 1}"] = _ratio(top, self.edge(obs, later)[2])
        stats["snr"] = stats["snr_block1"]
        stats["snr_max"] = max(v for k, v in stats.items() if k.startswith("snr_block"))
        return Span(u[:, : int((s > edge).sum())], s), stats


def _ratio(top: float, edge: float) -> float:
    """A spectrum's largest singular value over its bulk edge (inf for an edge of 0)."""
    return top / edge if edge > 0 else math.inf


ATTACKS.register(
    "mlp_spectral",
    MLPSpectral,
    config_cls=MLPSpectralConfig,
    summary="MLP-SVD knowing the MLP gradient was noised or flooded (AEGIS): span above the noise bulk edge "
    "(adaptive)",
    modality="text",
)
