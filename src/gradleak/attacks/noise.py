"""What the noise-aware attacks share: the noise scale they are told or estimate, and the average of
several views.

The scale. A DP configuration is public; ``batch_noise``, ``dp_sgd`` (one FedSGD step) and ``update_noise``
state the per-entry standard deviation of the Gaussian noise they add in the update's metadata
(``<defense>/noise_std``, :func:`gradleak.defenses.base.stated_noise_std`); an attack's ``noise_std`` option
sets it by hand instead (the scale of one view). A flood whose scale is not sent (AEGIS) is estimated from
the noised matrix itself (:func:`robust_noise_std`, :func:`entry_noise_std`).

Several views. A server that broadcasts the same model to the same client K times (``audit.views``; a
server that replays a round, or FedSGD rounds of a client whose local data is one batch while the model barely
moves) receives y_k = c + n_k with independent noise draws n_k ~ N(0, s_k^2 I). Their mean
y = c + (1/K) sum_k n_k keeps the signal and carries noise of standard deviation sqrt(sum_k s_k^2) / K,
s / sqrt(K) for equal scales: K views buy the attacker a K times larger signal-to-noise energy ratio. A
formal guarantee charges for this: each view is a release, and DP-SGD's accountant composes them
(:func:`gradleak.defenses.dp_sgd.epsilon_over_rounds`), whereas a noise scale without an epsilon
(``batch_noise``) silently loses a factor sqrt(K). Under FedAvg with shuffling the views' clean parts also
differ (other batch orders); their mean is then the expected update, still what the attack matches.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from gradleak.defenses.base import noise_stds, stated_noise_std
from gradleak.types import AttackInputError, Observation, Update

VIEWS = "mean_of_views"  # metadata key of an averaged update: the number of views it is the mean of


def mean_of_views(obs: Observation) -> Observation:
    """``obs`` with its update replaced by the mean of the update and its views (``views`` emptied), the
    mean's metadata stating each defense's noise scale of the mean, sqrt(sum_k s_k^2) / K, and ``views``
    = K. The same observation when it has no views. Every view must state the same defenses' noise."""
    updates = (obs.update, *obs.views)
    if len(updates) == 1:
        return obs
    stated = [noise_stds(u.metadata) for u in updates]
    if any(set(s) != set(stated[0]) for s in stated):
        raise AttackInputError(
            f"the views state noise from different defenses ({sorted({k for s in stated for k in s})}): "
            "they are not views of one configuration"
        )
    k = len(updates)
    tensors = {}
    for name, first in obs.update.tensors.items():
        total = torch.zeros_like(first, dtype=torch.float64)
        for u in updates:
            total += u.tensors[name].double()
        tensors[name] = (total / k).to(first.dtype)
    meta = dict(obs.update.metadata)
    for key in stated[0]:
        meta[key] = math.sqrt(sum(s[key] ** 2 for s in stated)) / k
    meta[VIEWS] = k
    mean = Update(tensors, obs.update.num_samples, obs.update.kind, meta)
    return dataclasses.replace(obs, update=mean, views=())


def averaged(obs: Observation, enabled: bool) -> tuple[Observation, float]:
    """What an attack with an ``average_views`` option reads: the mean of ``obs``'s views when
    ``enabled`` (:func:`mean_of_views`), else ``obs`` itself; and how many views that is (its
    ``views_averaged`` stat)."""
    if enabled:
        obs = mean_of_views(obs)
    return obs, float(obs.update.metadata.get(VIEWS, 1))  # type: ignore[arg-type]


def noise_scale(update: Update, configured: float | None, attack: str) -> float:
    """The per-entry noise standard deviation of ``update``: ``configured`` (one view's; divided by
    sqrt(K) for the mean of K views), else the update's stated one; an :class:`AttackInputError` naming
    ``attack`` when neither is known or the stated one is not finite and >= 0."""
    if configured is not None:
        return configured / math.sqrt(int(update.metadata.get(VIEWS, 1)))  # type: ignore[call-overload]
    std = stated_noise_std(update.metadata)
    if std is None:
        raise AttackInputError(
            f"{attack} needs the noise scale: the update states none (no <defense>/noise_std in its "
            "metadata); set noise_std to the defense's per-entry noise standard deviation"
        )
    if not 0 <= std < math.inf:
        raise AttackInputError(f"the update states a noise scale {std!r}; it must be finite and >= 0")
    return std


def check_noise_options(noise_std: float | None, tail: float) -> None:
    """What a noise-aware attack's config knows of the noise, checked on construction: ``noise_std`` (one
    view's per-entry standard deviation; None: the update's stated or an estimated one) finite and > 0,
    and the edge's ``tail`` (in noise standard deviations) finite and >= 0."""
    if noise_std is not None and not 0 < noise_std < math.inf:
        raise ValueError(f"noise_std must be finite and > 0 (or None: the update's), got {noise_std}")
    if not 0 <= tail < math.inf:
        raise ValueError(f"tail must be finite and >= 0, got {tail}")


MAD_TO_STD = 0.6745  # median |x| of N(0, 1): a normal sample's median absolute value over it is its std


def robust_noise_std(grad: torch.Tensor) -> float:
    """median |g_ij| / 0.6745: the standard deviation of i.i.d. Gaussian noise that dominates nearly every
    entry of ``grad`` (the normal median absolute deviation, a robust scale: Hampel 1974). A flood whose
    scale the defense does not send (AEGIS's lambda * m_bar, m_bar the mean norm of the client's rows) is
    estimated so."""
    return float(grad.abs().median()) / MAD_TO_STD


def entry_noise_std(
    obs: Observation, grad: torch.Tensor, configured: float | None, attack: str
) -> tuple[float, bool]:
    """The noise scale of ``grad``'s entries and whether it was estimated: ``configured`` or the update's
    stated scale (:func:`noise_scale`), else :func:`robust_noise_std` of ``grad`` itself. A stated scale
    wins: under DP noise stacked on an unstated flood the edge then sits at the DP scale, too low (set
    ``noise_std`` by hand there)."""
    if configured is None and stated_noise_std(obs.update.metadata) is None:
        return robust_noise_std(grad), True
    return noise_scale(obs.update, configured, attack), False
