"""Row-norm side channels of paper 002: embedding row norms (Channel 2) and the untied LM-head probe.

Channel 2 (paper 002, Sec. III-C, Def. 2): the input-embedding gradient dL/dE has non-zero rows exactly at
the tokens of the batch (the union over its B sequences); with a tied LM head the output projection adds a
dense but much smaller term. The LM-head probe (Sec. VI-C, stress test) reads the rows of an *untied* head,
dL/dW_LM = (1/N) sum_t (p_t - e_{y_t}) h_t^T, whose large rows are the target tokens.

:mod:`embedding_norm` and :mod:`lm_head` register the two attacks. Both rank rows by norm and keep the
top k, k where the sorted norms drop the most (``select="gap"``; a zero row is an infinite drop) or the
rows above ``threshold`` times the largest (``select="threshold"``). The result is an unordered token
set, returned as one sequence in decreasing-norm order.

The noise-aware probes (``embedding_norm_noise``, ``lm_head_noise``; issue 21, item 2) know that every
entry of the rows carries i.i.d. Gaussian noise N(0, s^2), as AEGIS's flood adds to the embedding and an
untied head (paper 002, Eq. 2) and DP noise to everything: s stated by the defense, set by hand, or
estimated from the matrix (:func:`gradleak.attacks.noise.robust_noise_std`: nearly every entry of a
flooded V x d table is noise). A row of pure noise has norm s chi_d, and the norm is 1-Lipschitz, so
Gaussian concentration bounds P(norm > s (sqrt(d) + t)) by exp(-t^2 / 2); the probes keep the rows above
the edge s (sqrt(d) + ``tail``) (``tail`` 6: at most 1.5e-8 per row, 8e-4 over a 50k vocabulary) and
report ``snr`` = the largest row norm over the edge. Pure noise's is about (sqrt(d) + sqrt(2 ln V) / sqrt(2))
/ (sqrt(d) + tail), 0.92 at d = 768 and V = 50k; with nothing above the edge they return nothing and say
so. A retained row rho g_v stands above it only when ||rho g_v||^2 >~ (2 sqrt(d) tail + tail^2) s^2.
Without noise the estimate is the table's own typical entry: exact zeros elsewhere (an untied embedding)
give an edge of 0 and exactly the nonzero rows; a dense table (an untied head, a tied embedding) puts the
edge at its own scale, and ``snr`` is then no noise ratio.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from gradleak.attacks.noise import check_noise_options, entry_noise_std
from gradleak.attacks.text.family import update_tensor
from gradleak.types import Observation, Reconstruction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowNormConfig:
    """``select`` ``"gap"`` (the largest ratio between consecutive sorted row norms among the top
    ``max_tokens``: no threshold to tune, the default) or ``"threshold"`` (rows above ``threshold`` times
    the largest; paper 002 states no value, 1e-3 is our choice)."""

    select: str = "gap"  # "gap" or "threshold"
    threshold: float = 1e-3  # relative to the largest row norm (select="threshold")
    max_tokens: int = 4096  # the gap is searched among the top max_tokens rows

    def __post_init__(self) -> None:
        if self.select not in ("gap", "threshold"):
            raise ValueError(f"select must be 'gap' or 'threshold', got {self.select!r}")
        if not 0 < self.threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


def select_rows(grad: torch.Tensor, cfg: RowNormConfig) -> tuple[list[int], torch.Tensor]:
    """Token ids of the selected rows (largest norm first) and all row norms."""
    norms = grad.to(torch.float64).norm(dim=1)
    top = norms.argsort(descending=True)[: cfg.max_tokens + 1]
    vals = norms[top]
    if float(vals[0]) == 0.0:
        return [], norms
    if cfg.select == "threshold":
        k = int((vals > cfg.threshold * vals[0]).sum())
    else:
        ratios = vals[:-1] / vals[1:].clamp_min(1e-300)
        k = int(ratios.argmax()) + 1
    return top[:k].tolist(), norms


class RowProbe:
    """A row-norm probe: reads the rows of one parameter's update (``param``, named by a subclass with its
    ``channel``) and keeps the rows ``select`` picks, as one unordered token set with its stats."""

    channel = ""

    def param(self, obs: Observation) -> str:
        raise NotImplementedError

    def select(self, obs: Observation, grad: torch.Tensor) -> tuple[list[int], dict[str, float]]:
        """The selected rows of ``grad`` (float64), largest norm first, and the probe's stats."""
        raise NotImplementedError

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        start = time.perf_counter()
        grad = update_tensor(obs, self.param(obs)).to(torch.float64)
        tokens, stats = self.select(obs, grad)
        log.info("%s: %d tokens selected", self.channel, len(tokens))
        stats = {"tokens": float(len(tokens)), **stats, "seconds": time.perf_counter() - start}
        return Reconstruction(token_ids=[tokens], stats=stats, ordered=False)


class RowNormAttack(RowProbe):
    """The rows ``select_rows`` keeps (module docstring)."""

    def __init__(self, config: RowNormConfig | None = None) -> None:
        self.config = config or RowNormConfig()

    def select(self, obs: Observation, grad: torch.Tensor) -> tuple[list[int], dict[str, float]]:
        tokens, norms = select_rows(grad, self.config)
        return tokens, {"nonzero_rows": float((norms > 0).sum())}


@dataclass(frozen=True)
class NoisyRowNormConfig:
    """What the noise-aware probes know (module docstring): ``noise_std`` (None: the update's stated scale,
    else estimated from the matrix) and the edge's ``tail`` (6, as the spectral attacks')."""

    noise_std: float | None = None
    tail: float = 6.0

    def __post_init__(self) -> None:
        check_noise_options(self.noise_std, self.tail)


def noise_edge(width: int, std: float, tail: float) -> float:
    """``s (sqrt(width) + tail)``: a row of ``width`` i.i.d. N(0, s^2) entries has a larger norm with
    probability at most exp(-tail^2 / 2) (module docstring)."""
    return std * (math.sqrt(width) + tail)


class NoisyRowNormAttack(RowProbe):
    """The rows whose norm stands above the noise edge (module docstring)."""

    def __init__(self, config: NoisyRowNormConfig | None = None) -> None:
        self.config = config or NoisyRowNormConfig()

    def select(self, obs: Observation, grad: torch.Tensor) -> tuple[list[int], dict[str, float]]:
        std, estimated = entry_noise_std(obs, grad, self.config.noise_std, self.channel)
        norms = grad.norm(dim=1)
        edge = noise_edge(grad.shape[1], std, self.config.tail)
        tokens = [int(v) for v in norms.argsort(descending=True)[: int((norms > edge).sum())]]
        top = float(norms.max()) if norms.numel() else 0.0
        snr = top / edge if edge > 0 else (math.inf if top > 0 else 0.0)
        if not tokens:
            log.info("%s: no row above the noise edge (SNR %.3f)", self.channel, snr)
        return tokens, {"noise_std": std, "noise_estimated": float(estimated), "edge": edge, "snr": snr}
