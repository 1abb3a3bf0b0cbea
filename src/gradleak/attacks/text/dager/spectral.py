"""DAGER that knows the noise: spectral thresholding at the noise's bulk edge before the span tests.

What it knows of the defense: the standard deviation ``s`` of the Gaussian noise in each sent entry. A DP
configuration is public, and ``batch_noise`` and ``dp_sgd`` (on a FedSGD gradient of one step) and
``update_noise`` state it in the update's metadata (``<defense>/noise_std``,
:func:`gradleak.defenses.base.stated_noise_std`); ``noise_std`` sets it by hand.

Why exact DAGER stops: a noised input-side gradient is G = S + N (d x k), S = sum_t delta_t x_t^T of rank n
(the batch's distinct token inputs), N with i.i.d. N(0, s^2) entries and full rank, so the spectrum of G has
no sharp drop and the rank test (:func:`~gradleak.attacks.text.family.estimate_span`) calls the span full.

What this attack does instead (the signal-plus-noise model of random matrix theory):

- **Bulk edge.** E ||N|| <= s (sqrt(d) + sqrt(k)) (Davidson & Szarek 2001, Thm. II.13), and ||N|| is a
  1-Lipschitz function of the entries, so it exceeds that by more than s t with probability at most
  exp(-t^2 / 2). The edge is e = s (sqrt(d) + sqrt(k) + ``tail``); ``tail = 6`` puts the chance that pure
  noise passes it below 1e-8. By Weyl's inequality s_i(G) <= s_i(S) + ||N||, so a singular value of G
  above e is signal: the span is the top-r singular vectors with s_i(G) > e.
- **Thresholds, per input.** To first order in N (Stewart & Sun 1990, Ch. V) the kept left singular
  vectors U move by (I - U U^T) N V Sigma^-1, so an input z = U a of the batch has residual
  ||P N V Sigma^-1 a|| / ||a|| to the estimated span, P N V being a (d - r) x r matrix of i.i.d.
  N(0, s^2) entries: a Gaussian vector of d - r entries of standard deviation s ||Sigma^-1 a||, whose norm
  exceeds s ||Sigma^-1 a|| (sqrt(d - r) + t) with probability at most exp(-t^2 / 2). Each candidate is
  tested against ``scale`` times s (sqrt(d - r) + ``tail``) ||Sigma^-1 a|| / ||a|| (a = its own
  coordinates in the estimated span; never below the family's exact-arithmetic threshold, at most
  ``max_threshold``): inputs along strong directions get a tight test, inputs along the weakest kept
  direction one of s (sqrt(d - r) + tail) / s_r. Inputs of tokens not in the batch lie at residual
  ~ sqrt(1 - r / d) from an r-dimensional span, far above it while r << d.

- **Outliers.** Signal directions that sink into the bulk are lost, and a batch token's input usually
  leans on some of them, so its residual exceeds its bound although it stays far below the residuals of
  the tokens that are not in the batch (GPT-2 arch, Rotten Tomatoes, B = 8, s = 1e-5 after clipping to 1:
  the batch's tokens at 20-29 standard deviations below the vocabulary's mean residual, the vocabulary's
  best eight at each of the first six positions). A candidate also passes when its plain residual is
  ``outlier_sd`` standard deviations below the mean residual of a reference: at L1 the whole scanned
  vocabulary at that position, at L2 ``reference`` random tokens appended to the same prefix (the official
  DAGER's noise-robust path ranks tokens by distance with a like cut-off).
- **Whitened L1 reference.** That rule assumes the vocabulary's residuals cluster, as they do for inputs
  spread evenly over the space (GPT-2 arch with random weights). A trained model's embeddings are
  anisotropic: a few directions carry much of every token's input, and the batch's span holds them, so the
  vocabulary's residuals spread wide and the cut-off falls to zero (SmolLM2-135M, Rotten Tomatoes, B = 8,
  s = 1e-5, a batch drawn directly, measured by a throwaway script: the other tokens at 0.355 +- 0.070,
  the batch's 141 at a median of 0.271, the whole vocabulary's mean - 5 sd = 0.003, and 1 of the 141
  passed; the adaptive table's SmolLM2 cell recovered nothing). At L1 the outlier rule therefore
  measures residuals in coordinates whitened by the scanned inputs' own second moments,
  W = (M + ``whiten`` lambda_max I)^(-1/2), M = Z^T Z / n: z is in the span S iff W z is in W S, so a
  batch token stays (near) inside while the vocabulary's inputs spread about evenly and their residuals
  cluster again (the same batch: 0.797 +- 0.038; 90 of the 141 batch tokens pass against 107 of the other
  49,011). The shrinkage ``whiten`` (a share of the largest eigenvalue) keeps directions the vocabulary
  barely uses from being blown up (1e-6 / 1e-4 / 1e-2: 87 / 97 / 90 batch tokens against 255 / 257 / 107
  others there). The first-order bound is unchanged, in the model's coordinates.

What it cannot do: signal directions with s_i(S) well below e are lost in the bulk, so tokens whose inputs
lean on them fail the tests; recovery is partial and the stats say how far the spectrum stood above the
edge (``snr_l1`` / ``snr_l2``: the largest singular value over the edge; ``rank_l1`` / ``rank_l2``: how
many stood above it). With nothing above the edge the attack returns nothing and says so with that SNR.

Several views (``average_views``, when the threat model gives the server K views of the same batch,
:mod:`gradleak.attacks.noise`): the spans of their mean, whose bulk edge is sqrt(K) times lower.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from gradleak.attacks.noise import averaged, check_noise_options, noise_scale
from gradleak.attacks.text.dager.core import Dager, DagerConfig
from gradleak.attacks.text.dager.search import L2Search
from gradleak.attacks.text.family import FamilySpec, Span, layer_inputs, vocab_size, with_thresholds
from gradleak.registry import ATTACKS
from gradleak.types import Observation, Reconstruction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DagerSpectralConfig(DagerConfig):
    """DAGER's options plus what the attack knows of the noise: ``noise_std`` (None: the update's stated
    ``<defense>/noise_std``), the ``tail`` of the edge and of the residual bound (in noise standard
    deviations), the threshold rule ``scale`` times the first-order residual bound, capped at
    ``max_threshold``, and the outlier rule: ``outlier_sd`` standard deviations below the mean residual of
    the scanned vocabulary (L1) or of ``reference`` random continuations (L2) (module docstring), at L1 in
    coordinates whitened by the scanned inputs with shrinkage ``whiten`` (0: the model's coordinates);
    ``average_views``: the spans of the mean of the observation's views
    (:func:`gradleak.attacks.noise.mean_of_views`), whose noise is sqrt(K) times smaller. Defaults'
    sources: ``outlier_sd`` 5 is the official DAGER's noise-robust cut-off (``--p1_std_thrs`` /
    ``--l2_std_thrs`` 5); ``tail`` 6 puts the chance that pure noise crosses the edge below exp(-18)
    (module docstring); ``scale`` 1 is the first-order bound itself; ``whiten`` 1e-2 the shrinkage with the
    fewest false passes of the three measured on SmolLM2 (module docstring, "Whitened L1 reference"; chosen
    on the batch it is reported on, the adaptive table's)."""

    noise_std: float | None = None
    tail: float = 6.0
    scale: float = 1.0
    max_threshold: float = 0.5
    outlier_sd: float = 5.0
    whiten: float = 1e-2  # L1's outlier rule in whitened coordinates, this shrinkage; 0: the plain rule
    l2_outlier_sd: float | None = None
    reference: int = 256
    average_views: bool = False  # test the spans of the mean of the observation's views (noise / sqrt(K))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_noise_options(self.noise_std, self.tail)
        if not 0 < self.scale < math.inf:
            raise ValueError(f"scale must be finite and > 0, got {self.scale}")
        if not 0 < self.max_threshold < 1:
            raise ValueError(f"max_threshold must be in (0, 1), got {self.max_threshold}")
        if not 0 < self.outlier_sd < math.inf:
            raise ValueError(f"outlier_sd must be finite and > 0, got {self.outlier_sd}")
        if not 0 <= self.whiten <= 1:
            raise ValueError(f"whiten must be in [0, 1] (0: off), got {self.whiten}")
        if self.l2_outlier_sd is not None and not 0 < self.l2_outlier_sd < math.inf:
            raise ValueError(f"l2_outlier_sd must be finite and > 0 (or None: off), got {self.l2_outlier_sd}")
        if self.reference < 2:
            raise ValueError(f"reference must be >= 2 (a mean and a spread), got {self.reference}")


@dataclass(frozen=True)
class NoisySpan(Span):
    """The span of a noised gradient's singular vectors above the noise bulk edge, whose ``residual`` is
    the relative residual over the threshold of that input: ``scale`` times its first-order bound
    s (sqrt(d - r) + tail) ||Sigma^-1 a|| / ||a||, a = the input's coordinates in the span (module
    docstring), within [``floor``, ``cap``]. An input passes the span test iff this ratio is below 1
    (:data:`PASS`)."""

    edge: float = 0.0
    noise_std: float = 0.0
    tail: float = 0.0
    scale: float = 1.0
    floor: float = 0.0
    cap: float = 1.0

    @property
    def snr(self) -> float:
        """The largest singular value over the edge (> 1: some signal stands out of the noise)."""
        s = self.singular_values
        return float(s[0]) / self.edge if s.numel() else 0.0

    @property
    def weakest_tilt(self) -> float:
        """The bound for an input along the weakest kept direction: s (sqrt(d - r) + tail) / s_r."""
        r, d = self.rank, self.basis.shape[0]
        return (
            self.noise_std * (math.sqrt(d - r) + self.tail) / float(self.singular_values[r - 1]) if r else 1.0
        )

    def thresholds(self, z: torch.Tensor) -> torch.Tensor:
        """Each input's threshold (float64)."""
        r, d = self.rank, self.basis.shape[0]
        a = z.to(torch.float64) @ self.basis
        whitened = (a / self.singular_values[:r]).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-300)
        bound = self.scale * self.noise_std * (math.sqrt(d - r) + self.tail) * whitened
        return bound.clamp(self.floor, self.cap)

    def residual_squared32(self, z: torch.Tensor) -> torch.Tensor:
        return super().residual_squared32(z) / self.thresholds(z).pow(2).to(torch.float32)

    def residual(self, z: torch.Tensor) -> torch.Tensor:
        return super().residual(z) / self.thresholds(z)

    def raw_residual(self, z: torch.Tensor) -> torch.Tensor:
        """The plain relative residual ||z - P z|| / ||z||."""
        return super().residual(z)


def whitened_residual(span: Span, z: torch.Tensor, shrinkage: float) -> torch.Tensor:
    """Each row of ``z``'s relative residual ||W z - P_WS W z|| / ||W z|| to the span's image W S, W the
    inverse square root of the rows' second-moment matrix plus ``shrinkage`` times its largest eigenvalue
    (module docstring, "Whitened L1 reference"). The (n, d) products in float32 (a ranking against a cut-off
    some standard deviations wide: :meth:`Span.residual_squared32` of W S), the (d, d) algebra in float64.
    """
    zf = z.to(torch.float32)
    values, vectors = torch.linalg.eigh((zf.T @ zf).to(torch.float64) / zf.shape[0])
    values = values.clamp_min(0)
    w = (vectors * (values + shrinkage * values.max()).rsqrt()) @ vectors.T  # symmetric
    basis, _ = torch.linalg.qr(w @ span.basis.to(torch.float64))
    image = Span(basis, span.singular_values)  # W S
    return image.residual_squared32(zf @ w.to(torch.float32)).clamp_min(0).sqrt().to(torch.float64)


def outlier_scores(
    span: NoisySpan, z: torch.Tensor, sd: float, reference: torch.Tensor | None = None,
    whiten: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """Each input's score under the two tests, lower is better and below :data:`PASS` passes: the smaller
    of its residual over its first-order bound and its plain residual over the cut-off mean - ``sd`` x
    standard deviation of the ``reference`` inputs' plain residuals (inputs of tokens that are not the
    batch's, for the most part; None: ``z`` is its own reference, as the scanned vocabulary is at L1). With
    ``whiten`` > 0 and ``z`` its own reference, the second test's residuals are
    :func:`whitened_residual`'s."""
    raw = span.raw_residual(z)
    bound = raw / span.thresholds(z)
    if reference is None and whiten > 0 and span.rank:
        raw = whitened_residual(span, z, whiten)
    ref = raw if reference is None else span.raw_residual(reference)
    cut = float((ref.mean() - sd * ref.std()).clamp_min(1e-12))
    return torch.minimum(bound, raw / cut)


PASS = 1.0  # the span tests' threshold on NoisySpan.residual


def bulk_edge(shape: tuple[int, ...], noise_std: float, tail: float) -> float:
    """e = s (sqrt(d) + sqrt(k) + tail): the top singular value of a d x k matrix of i.i.d. N(0, s^2)
    entries exceeds it with probability at most exp(-tail^2 / 2) (module docstring)."""
    d, k = shape
    return noise_std * (math.sqrt(d) + math.sqrt(k) + tail)


def span_above_edge(
    grad: torch.Tensor, config: DagerSpectralConfig, noise_std: float, floor: float
) -> NoisySpan:
    """The left singular vectors of ``grad`` (d, k) whose singular values lie above the bulk edge."""
    edge = bulk_edge(tuple(grad.shape), noise_std, config.tail)
    u, s, _ = torch.linalg.svd(grad.to(torch.float64), full_matrices=False)
    r = int((s > edge).sum())
    return NoisySpan(
        u[:, :r], s, edge, noise_std, config.tail, config.scale, min(floor, config.max_threshold),
        config.max_threshold,
    )  # fmt: skip


@dataclass
class OutlierL2Search(L2Search):
    """The decoder search with the L2 test of :func:`outlier_scores`: each prefix's extensions are compared
    with ``reference_ids`` (random vocabulary tokens) appended to the same prefix."""

    reference_ids: list[int] = field(default_factory=list)
    outlier_sd: float = 5.0

    def _scores(self, z: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        assert isinstance(self.span, NoisySpan)
        return outlier_scores(self.span, z, self.outlier_sd, reference)

    def residual(self, seqs: torch.Tensor, last_only: bool, reduce: str = "max") -> torch.Tensor:
        if not last_only:
            return super().residual(seqs, last_only, reduce)
        ref = torch.tensor(self.reference_ids).unsqueeze(1)
        ref = torch.cat([seqs[:1, :-1].expand(len(ref), -1), ref], dim=1)  # the first prefix + random tokens
        both = torch.cat([seqs, ref])
        z = layer_inputs(self.model, self.module, both, chunk=max(1, self.chunk // both.shape[1]))[:, -1]
        return self._scores(z[: len(seqs)], z[len(seqs) :])

    def extension_residuals(self, prefixes: list[list[int]], cands: list[int]) -> torch.Tensor:
        n, c = len(prefixes), len(cands)
        z, prev = self.extension_inputs(prefixes, cands + self.reference_ids)
        z, prev = (
            z.reshape(n, c + len(self.reference_ids), -1),
            prev.reshape(n, c + len(self.reference_ids), -1),
        )
        scores = torch.cat([self._scores(z[i, :c], z[i, c:]) for i in range(n)])
        repeat = self.repeats(z[:, :c].reshape(n * c, -1), prev[:, :c].reshape(n * c, -1))
        return torch.where(repeat, torch.full_like(scores, float("inf")), scores)


class DagerSpectral(Dager):
    """DAGER whose span tests know the noise scale (module docstring); reads ``obs.model``, ``obs.update``
    and the update's stated noise scale."""

    config: DagerSpectralConfig
    exact_spans = False  # no feed-forward screen (``Dager.feed_forward_span``): the gradient is not exact

    def __init__(self, config: DagerSpectralConfig | None = None) -> None:
        super().__init__(config or DagerSpectralConfig())

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        obs, views = averaged(obs, self.config.average_views)
        rec = super().reconstruct(obs, generator=generator)
        rec.stats["views_averaged"] = views
        return rec

    def noise_std(self, obs: Observation) -> float:
        return noise_scale(obs.update, self.config.noise_std, "dager_spectral")

    def spans(
        self, obs: Observation, spec: FamilySpec, grad1: torch.Tensor, grad2: torch.Tensor
    ) -> tuple[Span, Span, FamilySpec, dict[str, float]]:
        c, std = self.config, self.noise_std(obs)
        if std == 0.0:  # a defense stated no noise (dp_sgd clipping only): the spans are exact
            span1, span2, spec, stats = super().spans(obs, spec, grad1, grad2)
            return span1, span2, spec, {**stats, "noise_std": 0.0}
        e1 = span_above_edge(grad1, c, std, spec.l1_threshold)
        e2 = span_above_edge(grad2, c, std, spec.l2_threshold)
        stats = {
            "noise_std": std,
            "edge_l1": e1.edge,
            "edge_l2": e2.edge,
            "snr_l1": e1.snr,
            "snr_l2": e2.snr,
            "weakest_tilt_l1": e1.weakest_tilt,
            "weakest_tilt_l2": e2.weakest_tilt,
        }
        for name, e in (("L1", e1), ("L2", e2)):
            if e.rank == 0:
                log.warning(
                    "dager_spectral: no %s singular value above the noise bulk edge %.3g (the largest is "
                    "%.2f x the edge): the noise hides the batch",
                    name, e.edge, e.snr,
                )  # fmt: skip
        return e1, e2, with_thresholds(spec, l1_threshold=PASS, l2_threshold=PASS), stats

    def l1_test(self, span: Span, z: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The scanned vocabulary at this position is its own reference (module docstring); exact spans
        (no noise) get exact DAGER's test."""
        if not isinstance(span, NoisySpan):
            return super().l1_test(span, z, threshold)
        scores = outlier_scores(span, z, self.config.outlier_sd, whiten=self.config.whiten)
        ok = torch.nonzero(scores < threshold).flatten()
        return ok, scores[ok]

    def l2_search(
        self, model: nn.Module, m2: nn.Module, span2: Span, threshold: float, m1: nn.Module,
        generator: torch.Generator,
    ) -> L2Search:  # fmt: skip
        c = self.config
        if c.l2_outlier_sd is None or not isinstance(span2, NoisySpan):
            return super().l2_search(model, m2, span2, threshold, m1, generator)
        ref = torch.randperm(vocab_size(model), generator=generator)[: c.reference].tolist()
        return OutlierL2Search(
            model, m2, span2, threshold, c.chunk, c.repeat_tol, m1,
            novelty=c.encoder.novelty, reference_ids=ref, outlier_sd=c.l2_outlier_sd,
        )  # fmt: skip


ATTACKS.register(
    "dager_spectral",
    DagerSpectral,
    config_cls=DagerSpectralConfig,
    summary="DAGER knowing the noise scale: spans above the noise bulk edge (adaptive, vs DP noise)",
    modality="text",
)
