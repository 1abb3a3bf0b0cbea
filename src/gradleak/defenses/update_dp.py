"""Update-level clipping and Gaussian noise: the outgoing update, not each step's gradient.

The client clips its whole update (all tensors jointly) to L2 norm ``clip`` and adds Gaussian noise to every
entry: ``u' = u * min(1, C / ||u||_2) + N(0, s^2 I)`` (the Gaussian mechanism on the update, as in
DP-FedAvg, McMahan et al. 2018, Alg. 1, with the noise added on the client). It acts only on the outgoing
update, so it also runs as a Flower mod (:mod:`gradleak.integrations.flower`).

The noise scale ``s`` is given one of two ways:

- ``sigma`` (a noise multiplier): ``s = sigma * C``; no epsilon is claimed;
- ``epsilon`` and ``delta``, Flower's ``LocalDpMod`` semantics: ``s = Delta * sqrt(2 ln(1.25 / delta)) /
  epsilon``, the classic Gaussian mechanism (Dwork & Roth 2014, Thm. A.1, valid for epsilon < 1), with
  ``Delta`` the L2 sensitivity of the clipped update. By default ``Delta = 2 C``: any two clipped updates
  lie within 2C of each other, so the guarantee covers the client's whole data set in one update (local
  DP of the update). A smaller ``sensitivity`` is the user's claim (Flower takes it as given).

The update carries ``update_noise/noise_std`` (and, with epsilon, ``update_noise/epsilon``, ``/delta``,
``/sensitivity``). Each update is one release: R rounds compose (basic composition: R epsilon, R delta).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gradleak.defenses.base import COMPOSITIONS, NOISE_STD, Defense, SetupContext
from gradleak.registry import DEFENSES
from gradleak.types import Update

DEFAULT_SIGMA = 1.0  # the noise multiplier when neither sigma nor epsilon is given
META = "update_noise/"  # prefix of the Update.metadata keys this defense writes


@dataclass(frozen=True)
class UpdateNoiseConfig:
    clip: float = 1.0  # C: the L2 bound of the whole update
    sigma: float | None = None  # noise multiplier: s = sigma * C; None: from epsilon, else DEFAULT_SIGMA
    epsilon: float | None = None  # the classic Gaussian mechanism's epsilon (< 1), with delta
    delta: float | None = None
    sensitivity: float | None = None  # L2 sensitivity Delta; None: 2 C (any two clipped updates)

    def __post_init__(self) -> None:
        if not 0 < self.clip < math.inf:
            raise ValueError(f"update_noise needs a finite clip > 0; got clip={self.clip}")
        if self.sigma is not None and not 0 <= self.sigma < math.inf:
            raise ValueError(f"update_noise needs a finite sigma >= 0; got sigma={self.sigma}")
        if self.epsilon is None:
            if self.delta is not None or self.sensitivity is not None:
                raise ValueError("update_noise delta and sensitivity state an epsilon: give epsilon too")
            return
        if self.sigma is not None:
            raise ValueError("update_noise takes sigma or (epsilon, delta), not both")
        if not 0 < self.epsilon < 1:
            raise ValueError(
                f"update_noise epsilon must be in (0, 1), the range of the classic Gaussian mechanism's "
                f"bound (Dwork & Roth 2014, Thm. A.1); got {self.epsilon}. For larger budgets use sigma (no "
                "claim) or dp_sgd (Opacus' accountant)"
            )
        if self.delta is None or not 0 < self.delta < 1:
            raise ValueError(f"update_noise epsilon needs delta in (0, 1); got delta={self.delta}")
        if self.sensitivity is not None and not 0 < self.sensitivity < math.inf:
            raise ValueError(f"update_noise sensitivity must be finite and > 0; got {self.sensitivity}")

    @property
    def std(self) -> float:
        """The per-entry noise standard deviation ``s``."""
        if self.epsilon is None:
            return (DEFAULT_SIGMA if self.sigma is None else self.sigma) * self.clip
        assert self.delta is not None
        return self.stated_sensitivity * math.sqrt(2 * math.log(1.25 / self.delta)) / self.epsilon

    @property
    def stated_sensitivity(self) -> float:
        return 2 * self.clip if self.sensitivity is None else self.sensitivity


class UpdateNoise(Defense):
    name = "update_noise"
    differential_privacy = True

    def __init__(self, config: UpdateNoiseConfig) -> None:
        self.config = config
        self._generator: torch.Generator | None = None

    def setup(self, model: nn.Module, context: SetupContext) -> None:
        generator = context.generator
        self._generator = generator

    def on_update(self, update: Update) -> Update:
        if self._generator is None:
            raise RuntimeError(
                "update_noise needs setup() first (it draws its noise from the client's generator)"
            )
        c, std = self.config.clip, self.config.std
        norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in update.tensors.values()))
        scale = min(1.0, c / norm) if norm > 0 else 1.0
        out = {}
        for name, t in update.tensors.items():
            noise = torch.randn(t.shape, generator=self._generator, dtype=torch.float64,
                                device=self._generator.device) * std  # fmt: skip
            out[name] = (t.double() * scale + noise.to(t.device)).to(t.dtype)
        meta: dict[str, object] = {f"{META}{NOISE_STD}": std, f"{META}clip": c}
        if self.config.epsilon is not None:
            meta |= {f"{META}epsilon": self.config.epsilon, f"{META}delta": self.config.delta,
                     f"{META}sensitivity": self.config.stated_sensitivity}  # fmt: skip
        return Update(out, update.num_samples, update.kind, {**update.metadata, **meta})


def _compose(metadatas: Sequence[Mapping[str, object]]) -> tuple[float, float]:
    """Releases of one client's data under update_noise: basic composition (epsilons and deltas add; Dwork
    & Roth 2014, Thm. 3.16)."""
    stated = [m for m in metadatas if f"{META}epsilon" in m]
    if len(stated) != len(metadatas):
        raise ValueError("update_noise states epsilon for some releases only: nothing can be composed")
    eps = [float(m[f"{META}epsilon"]) for m in stated]  # type: ignore[arg-type]
    deltas = [float(m[f"{META}delta"]) for m in stated]  # type: ignore[arg-type]
    return sum(eps), sum(deltas)


COMPOSITIONS[META.rstrip("/")] = _compose

DEFENSES.register(
    "update_noise",
    UpdateNoise,
    config_cls=UpdateNoiseConfig,
    summary="clip the whole update to L2 norm C, add N(0, s^2) per entry: s = sigma C, or (epsilon, delta) "
    "of the Gaussian mechanism at sensitivity 2C (Flower's LocalDpMod)",
)
