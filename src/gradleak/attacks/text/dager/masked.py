"""DAGER that knows the update was sparsified: low-rank completion of the kept entries before the span tests.

What it knows of the defense: that the zeros it receives are dropped entries (magnitude pruning, top-k
compression), not zero gradient; nothing else (not the ratio, not the kept entries' threshold).

Why exact DAGER stops: the input-side gradient G = sum_t delta_t x_t^T (d x k) has rank n, the number of the
batch's token inputs (:mod:`gradleak.attacks.text.dager.core`, step 1), but the server sees M * G, M the 0/1
mask of the kept entries, and zeroing entries of a low-rank matrix makes it full rank: the rank test calls the
span full and nothing is recovered.

What this attack does instead: it looks for the lowest-rank matrix that agrees with the kept entries
(low-rank matrix completion, Candes & Recht 2009, eq. 1.5 with the rank itself in place of its convex
surrogate):

- **Alternating least squares** (Jain, Netrapalli & Sanghavi 2013, Alg. 1). For a rank r, L = A B^T with
  A (d x r) and B (k x r) started at the top-r SVD of M * G; each row a_i of A is then the least-squares fit
  to row i's kept entries, a_i = argmin sum_{j kept} (G_ij - a_i . b_j)^2, and likewise each row of B,
  for up to ``max_iters`` rounds. The fit is ||M * (G - L)|| / ||M * G||.
- **Rank.** A rank below n leaves the weakest signal direction's share of the kept entries unexplained;
  a rank of n fits them to rounding. A rank fits when its fit falls below ``rank_fit`` within ``max_iters``
  rounds; the rank is found by bisection over [1, r_max], which assumes that a rank above one that fits
  fits too: the rank returned was checked to fit, though an ALS run that stalled could make it larger
  than the smallest that does (``fit_below_l1``, the fit one rank lower when it was probed, is the margin).
  The rank found is then refined towards ``fit_tol``; in practice the refinement stops where the kept
  entries' float32 rounding leaves it, ~1e-7.
- **Identifiability.** A rank-r d x k matrix has r (d + k - r) degrees of freedom; ranks whose count exceeds
  the kept entries over ``oversampling`` are not tried, nor ranks that leave no room for a span test
  (:data:`~gradleak.attacks.text.family.FULL_SPAN_FRACTION`), nor ranks above the batch's token count
  (sequences x padded length, which the server knows): r_max. When even r_max does not fit, the attack
  returns nothing and says so: ``completion_rank_l1 = 0`` with ``max_rank_l1`` and ``kept_l1`` (the share
  of entries kept) in the stats are the measured limit. The count is necessary, not sufficient: a row or
  column with fewer than r kept entries is not determined by them, and magnitude pruning empties the rows
  of weak features first; such a completion fits the kept entries and still has the wrong span there.

The span is the column space of the completed A; the span tests on a completed span use looser thresholds
(``completed_l1_threshold`` 0.01, ``completed_l2_threshold`` 0.05: the completion is accurate to the
float32 rounding of the kept entries, ~1e-7, and weak directions amplify it; see the config). A gradient
that was not sparsified gets exact DAGER's span and thresholds.

What it cannot do: magnitude pruning keeps the large entries, so a token whose input and error are both
small can lose every entry of its direction, which no completion restores (it would be recovered under
random sparsification of the same rate); and at high ratios r (d + k - r) exceeds the kept entries for the
batch's rank (GPT-2 small, k = 3 d = 2,304: 90 % pruning leaves room for 48 token inputs).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from gradleak.attacks.text.dager.core import Dager, DagerConfig
from gradleak.attacks.text.family import FULL_SPAN_FRACTION, FamilySpec, Span, estimate_span, with_thresholds
from gradleak.progress import bar
from gradleak.registry import ATTACKS
from gradleak.types import Observation

log = logging.getLogger(__name__)

Factors = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class DagerMaskedConfig(DagerConfig):
    """DAGER's options (its thresholds apply to a gradient that was not sparsified) plus the completion's:
    ``rank_fit`` (relative residual on the kept entries at which a rank fits, within ``max_iters``
    alternating least-squares rounds), ``fit_tol`` (the residual the found rank's completion is refined
    towards, within ``refine_iters`` rounds), ``oversampling`` (kept entries per degree of freedom a tried
    rank must have), ``min_dropped`` (the share of zero entries from which a gradient counts as sparsified;
    below it the exact span: a dense float32 draw can hold an exact zero), ``ridge`` (Tikhonov term of each
    least-squares fit, relative to the mean diagonal of that row's Gram matrix), ``row_chunk`` (rows solved
    at once: memory), and the span tests' thresholds on a completed span, ``completed_l1_threshold`` 0.01
    and ``completed_l2_threshold`` 0.05: the kept entries carry float32 rounding, so the completion fits
    them to ~1e-7 and a token along a weak L2 direction lies 0.005-0.012 off the completed span (GPT-2 arch
    tiny, 50 %, across CPU kernel sets; tokens not in the batch lie at ~0.9)."""

    rank_fit: float = 1e-5
    fit_tol: float = 1e-8
    max_iters: int = 60
    refine_iters: int = 500
    oversampling: float = 1.2
    min_dropped: float = 0.01
    ridge: float = 1e-12
    row_chunk: int = 64
    completed_l1_threshold: float = 0.01
    completed_l2_threshold: float = 0.05

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.fit_tol <= self.rank_fit < 1:
            raise ValueError(
                f"need 0 < fit_tol <= rank_fit < 1, got fit_tol {self.fit_tol} and rank_fit {self.rank_fit}"
            )
        if not 1 <= self.oversampling < math.inf:
            raise ValueError(f"oversampling must be finite and >= 1, got {self.oversampling}")
        for key in ("min_dropped", "ridge", "completed_l1_threshold", "completed_l2_threshold"):
            if not 0 < getattr(self, key) < 1:
                raise ValueError(f"{key} must be in (0, 1), got {getattr(self, key)}")
        for key in ("max_iters", "refine_iters", "row_chunk"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")


def _rows(
    kept: torch.Tensor, values: torch.Tensor, other: torch.Tensor, ridge: float, chunk: int
) -> torch.Tensor | None:
    """Each row's least-squares factor: row i solves (H_i + ridge t_i I) a_i = sum_j m_ij g_ij b_j with
    H_i = sum_j m_ij b_j b_j^T and t_i its mean diagonal (the ridge is relative to each row's own Gram
    matrix; a row with no kept entry gets a_i = 0). None when a system cannot be solved in float64."""
    eye = torch.eye(other.shape[1], dtype=other.dtype)
    out = []
    for lo in range(0, kept.shape[0], chunk):
        m = kept[lo : lo + chunk]
        gram = torch.einsum("ij,jr,js->irs", m, other, other)
        scale = gram.diagonal(dim1=1, dim2=2).mean(-1)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        solved, info = torch.linalg.solve_ex(
            gram + (ridge * scale)[:, None, None] * eye, (values[lo : lo + chunk] * m) @ other
        )
        if bool(info.any()) or not bool(torch.isfinite(solved).all()):
            return None
        out.append(solved)
    return torch.cat(out)


def _balanced(a: torch.Tensor, b: torch.Tensor) -> Factors:
    """The same product a b^T as U sqrt(S), V sqrt(S) (its thin SVD through two QRs): ALS's factors are
    determined only up to an invertible r x r matrix, and without this they can drift apart in scale."""
    qa, ra = torch.linalg.qr(a)
    qb, rb = torch.linalg.qr(b)
    u, s, vh = torch.linalg.svd(ra @ rb.T)
    root = s.sqrt()
    return (qa @ u) * root, (qb @ vh.T) * root


STALL = 0.99  # a completion whose fit fell by less than 1 % over the last 10 rounds has converged


def normalised(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` in float64 over its largest magnitude (the completion's fits are scale-free; this keeps
    their squares away from float64's range limits)."""
    g = grad.to(torch.float64)
    top = float(g.abs().max())
    return g / top if top > 0 else g


Svd = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def svd_start(svd: Svd, rank: int) -> Factors:
    """ALS's starting factors from the top-``rank`` part of the zero-filled matrix's thin SVD."""
    u, s, vh = svd
    root = s[:rank].sqrt()
    return u[:, :rank] * root, vh[:rank].T * root


def complete(
    g: torch.Tensor, rank: int, config: DagerMaskedConfig, *, tol: float, iters: int,
    start: Factors | None = None,
) -> tuple[Factors, float]:  # fmt: skip
    """Rank-``rank`` alternating least squares on the nonzero entries of ``g`` (d, k; see
    :func:`normalised`), from ``start`` (None: :func:`svd_start`) until the fit on the kept entries is below
    ``tol``, stalls (:data:`STALL`) or ``iters`` rounds ran: the factors A (d, rank) and B (k, rank) and the
    fit, inf when a round could not be computed (an ill-posed system or an overflow: the rank does not
    fit; the factors are then the last good ones)."""
    g = normalised(g)  # idempotent: ``start`` was computed on the same scale
    kept = (g != 0).to(torch.float64)
    a, b = start if start is not None else svd_start(torch.linalg.svd(g, full_matrices=False), rank)
    norm, history = float(g.norm()), list[float]()
    for _ in range(iters):
        new_a = _rows(kept, g, b, config.ridge, config.row_chunk)
        new_b = None if new_a is None else _rows(kept.T, g.T, new_a, config.ridge, config.row_chunk)
        if new_a is None or new_b is None:
            log.info("dager_masked: a least-squares system of rank %d could not be solved", rank)
            return (a, b), math.inf
        cand = _balanced(new_a, new_b)
        fit = float((kept * (g - cand[0] @ cand[1].T)).norm()) / norm if norm > 0 else math.inf
        if not math.isfinite(fit):
            return (a, b), math.inf
        a, b = cand
        history.append(fit)
        if fit < tol or (len(history) > 10 and fit > STALL * history[-11]):
            break
    return (a, b), history[-1] if history else math.inf


def max_identifiable_rank(shape: tuple[int, int], kept: int, oversampling: float) -> int:
    """The largest r with r (d + k - r) <= kept / oversampling and r < FULL_SPAN_FRACTION * d."""
    d, k = shape
    budget = kept / oversampling
    # r (d + k - r) grows with r up to (d + k) / 2, and the cap keeps r below min(d, k) <= (d + k) / 2
    top = min(d, k, math.ceil(FULL_SPAN_FRACTION * d) - 1)
    r = 0
    while r < top and (r + 1) * (d + k - r - 1) <= budget:
        r += 1
    return r


def _basis(a: torch.Tensor) -> Span:
    """An orthonormal basis of the column space of ``a`` (left singular vectors above 1e-12 of the
    largest: a column that collapsed to zero adds no direction)."""
    u, s, _ = torch.linalg.svd(a, full_matrices=False)
    keep = int((s > 1e-12 * s[0]).sum()) if s.numel() and float(s[0]) > 0 else 0
    return Span(u[:, :keep], s)


def completed_span(
    grad: torch.Tensor, config: DagerMaskedConfig, label: str, tokens: int
) -> tuple[Span, dict[str, float]]:
    """The span of the lowest-rank completion of ``grad``'s kept entries that fits them (module docstring),
    of rank at most ``tokens`` (the batch's token count: sequences x padded length), and stats: the share
    of entries kept, the largest rank tried, the rank found (0: none fits), its fit and the fit one rank
    lower when that was probed."""
    g = normalised(grad)
    kept = int((g != 0).sum())
    r_max = min(tokens, max_identifiable_rank((g.shape[0], g.shape[1]), kept, config.oversampling))
    stats = {f"kept_{label}": kept / g.numel(), f"max_rank_{label}": float(r_max)}
    empty = Span(g.new_zeros(g.shape[0], 0), g.new_zeros(0))
    if r_max == 0:
        return empty, {**stats, f"completion_rank_{label}": 0.0}
    svd = torch.linalg.svd(g, full_matrices=False)  # one SVD starts every probe
    fits: dict[int, tuple[Factors, float]] = {}
    with bar(desc=f"completion ({label} rank)") as progress:

        def probe(r: int) -> bool:
            fits[r] = complete(
                g, r, config, tol=config.rank_fit, iters=config.max_iters, start=svd_start(svd, r)
            )
            progress.update(1)
            progress.set_postfix(rank=r, fit=f"{fits[r][1]:.1e}")
            return fits[r][1] < config.rank_fit

        lo, hi = 0, r_max  # rank lo does not fit; rank hi is the smallest that may
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if probe(mid) else (mid, hi)
        if hi not in fits:  # r_max itself: the bisection only probes below it
            probe(hi)
    if fits[hi][1] >= config.rank_fit:
        log.warning(
            "dager_masked: no completion of rank <= %d fits the %s gradient's kept entries "
            "(%.0f %% kept, fit %.1e at rank %d): the batch's rank is beyond what they determine",
            r_max, label, 100 * stats[f"kept_{label}"], fits[hi][1], r_max,
        )  # fmt: skip
        return empty, {**stats, f"completion_rank_{label}": 0.0, f"fit_{label}": fits[hi][1]}
    refined = complete(g, hi, config, tol=config.fit_tol, iters=config.refine_iters, start=fits[hi][0])
    (a, _), fit = refined if refined[1] <= fits[hi][1] else fits[hi]
    stats.update({f"completion_rank_{label}": float(hi), f"fit_{label}": fit})
    if hi - 1 in fits:
        stats[f"fit_below_{label}"] = fits[hi - 1][1]
    return _basis(a), stats


class DagerMasked(Dager):
    """DAGER whose spans come from a low-rank completion of a sparsified gradient (module docstring); reads
    ``obs.model`` and ``obs.update``. A gradient with fewer than ``min_dropped`` zero entries gets exact
    DAGER's span and thresholds."""

    config: DagerMaskedConfig
    exact_spans = False  # no feed-forward screen (``Dager.feed_forward_span``): the gradient is not exact

    def __init__(self, config: DagerMaskedConfig | None = None) -> None:
        super().__init__(config or DagerMaskedConfig())

    def spans(
        self, obs: Observation, spec: FamilySpec, grad1: torch.Tensor, grad2: torch.Tensor
    ) -> tuple[Span, Span, FamilySpec, dict[str, float]]:
        c = self.config
        tokens = max(1, obs.update.num_samples) * int(obs.input_shape[0])
        out: list[Span] = []
        stats: dict[str, float] = {}
        thresholds: dict[str, float] = {}
        for grad, label, loose in (
            (grad1, "l1", c.completed_l1_threshold),
            (grad2, "l2", c.completed_l2_threshold),
        ):
            kept = float((grad != 0).to(torch.float64).mean())
            if 1 - kept < c.min_dropped:  # not sparsified: the exact span and threshold
                out.append(estimate_span(grad, spec.rank_tol))
                stats.update({f"kept_{label}": kept, f"completion_rank_{label}": float(out[-1].rank)})
            else:
                span, s = completed_span(grad, c, label, tokens)
                out.append(span)
                stats.update(s)
                thresholds[f"{label}_threshold"] = loose
        return out[0], out[1], with_thresholds(spec, **thresholds), stats


ATTACKS.register(
    "dager_masked",
    DagerMasked,
    config_cls=DagerMaskedConfig,
    summary="DAGER knowing the update was pruned: low-rank completion of the kept entries (adaptive)",
    modality="text",
)
