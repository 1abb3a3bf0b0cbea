"""Inverting Gradients that knows the noise: the prior's weight set by the maximum a posteriori balance
under the defense's Gaussian noise.

What it knows of the defense: the standard deviation ``s`` of the Gaussian noise in each sent entry (a DP
configuration is public; ``batch_noise``, ``dp_sgd`` on a FedSGD step and ``update_noise`` state it in the
update's metadata, :func:`gradleak.defenses.base.stated_noise_std`; ``noise_std`` sets it by hand). Nothing
else: not the noise draw, not the clipping bound, not the clean gradient.

Why plain IG loses under noise: its matching term (Eq. 4) is the same at every noise level, so the TV prior
weighs as much against a gradient that is mostly noise as against a clean one, and the dummy image bends
towards noise it can reproduce (held-out tuning run below, s = 0.01: IG at the TV weight that is best
without noise, 1e-2, 13.1 dB, at the class-mean floor; a ten times stronger prior 17.1 dB).

The balance it uses instead. The update is y = c + n, with c the (possibly clipped) gradient of the batch
and n ~ N(0, s^2 I_D). Model the candidate's sent gradient as a g(X) / ||g(X)||, with its norm a = ||c||
estimated from the energies, a^2 = S = ||y||^2 - s^2 D (the noise's expected energy N = s^2 D removed;
clipping rescales c, which a absorbs). The negative log-likelihood is then

    ||a g / ||g|| - y||^2 / (2 s^2) = (a ||y|| / s^2) (1 - cos(g, y)) + const,

and with a TV prior p(X) ~ exp(-TV(X) / beta) the maximum a posteriori image minimises

    1 - cos(g(X), y)  +  (s^2 / (beta sqrt(S ||y||^2))) TV(X):

plain IG's Eq. 4 with the TV weight grown by ``prior_strength`` (1 / beta) x s^2 / sqrt(S E), E = ||y||^2.
It is scale-free (clip and noise scaled together leave it unchanged) and vanishes without noise, where the
attack is plain IG with ``tv_weight`` (which stays, as in IG, for what the prior does beyond the noise).
D counts the entries that carry noise (the nonzero ones). The TV term is a per-pixel mean
(:func:`~gradleak.attacks.image.ig.total_variation`), so ``prior_strength`` is tied to the image size and
batch it was tuned at (one 32 x 32 image).
``prior_strength`` is the one setting the model does not give; its default, 1e4, is the best of 3e3 / 1e4 /
3e4 / 1e5, or within 0.05 dB of it, at every noise level of a tuning run on held-out images
(``benchmarks/configs/ig_noise_tuning.toml``: paper 001's victim, six CIFAR-10 images other than the audited
ones, 200 iterations, base TV 1e-2, s = 0.001 / 0.003 / 0.01: 25.0 / 21.3 / 17.4 dB, as good as plain IG at
the best fixed TV weight of each noise level, 24.9 / 21.5 / 17.1 dB, which the noise alone now sets).

Where the update's energy does not stand above the noise's (||y||^2 <= N (1 + tail sqrt(2 / D)); ||n||^2 /
s^2 is chi-square with D degrees of freedom) there is no signal to match and the attack refuses, stating the
estimated signal-to-noise energy ratio S / N. Stats: ``noise_std``, ``snr`` (S / N), ``tv_noise`` (the TV
weight the noise added), ``views_averaged`` (how many views it matched the mean of).

Several views (``average_views``, when the threat model gives the server K views of the same data,
:mod:`gradleak.attacks.noise`): the attack matches their mean, whose noise is s / sqrt(K), with everything
above computed at that scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from gradleak.attacks.image.ig import IGConfig, InvertingGradients
from gradleak.attacks.noise import averaged, noise_scale
from gradleak.device import DEVICE_TYPES
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation, Reconstruction


@dataclass(frozen=True)
class NoiseAwareIGConfig(IGConfig):
    """IG's options plus what the attack knows of the noise: ``noise_std`` (None: the update's stated
    ``<defense>/noise_std``), ``prior_strength`` (1 / beta of the TV prior, module docstring; default from
    the held-out tuning run ``benchmarks/configs/ig_noise_tuning.toml``) and the ``tail`` (in standard
    deviations of a pure-noise update's energy) the update must stand above its noise; ``average_views``:
    match the mean of the observation's views (:func:`gradleak.attacks.noise.mean_of_views`), whose noise
    is sqrt(K) times smaller."""

    noise_std: float | None = None
    prior_strength: float = 1e4
    tail: float = 3.0
    average_views: bool = False  # match the mean of the observation's views (noise / sqrt(K))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.noise_std is not None and not 0 <= self.noise_std < math.inf:
            raise ValueError(
                f"noise_std must be finite and >= 0 (or None: the update's), got {self.noise_std}"
            )
        if not 0 <= self.prior_strength < math.inf:
            raise ValueError(f"prior_strength must be finite and >= 0, got {self.prior_strength}")
        if not 0 <= self.tail < math.inf:
            raise ValueError(f"tail must be finite and >= 0, got {self.tail}")


@dataclass(frozen=True)
class NoiseBalance:
    """An update's energy against its noise's: E = ||y||^2, N = s^2 D, D the entries that carry noise (the
    nonzero ones: a Gaussian draw is never exactly 0, so a zero entry was sent without noise, e.g. a
    parameter without a gradient or an entry pruned after the noise)."""

    energy: float
    noise: float
    numel: int

    @classmethod
    def of(cls, tensors: list[torch.Tensor], noise_std: float) -> NoiseBalance:
        energy = sum(float(t.double().pow(2).sum()) for t in tensors)
        numel = sum(int(torch.count_nonzero(t)) for t in tensors)
        return cls(energy, noise_std**2 * numel, numel)

    @property
    def signal(self) -> float:
        """S = E - N, the estimated energy of the sent gradient without its noise (0 when N covers E)."""
        return max(self.energy - self.noise, 0.0)

    def stands_out(self, tail: float) -> bool:
        """E > N (1 + tail sqrt(2 / D)): the energy lies ``tail`` standard deviations of a pure-noise
        update's energy above the noise (never for an update of zeros)."""
        return self.numel > 0 and self.energy > self.noise * (1 + tail * math.sqrt(2 / self.numel))

    def tv_weight(self, noise_std: float, prior_strength: float) -> float:
        """The TV weight the noise adds at the MAP balance: prior_strength x s^2 / sqrt(S E); for an update
        that stands out (S > 0)."""
        if self.noise == 0:
            return 0.0
        return prior_strength * noise_std**2 / math.sqrt(self.signal * self.energy)


class NoiseAwareInvertingGradients:
    """IG whose TV weight follows the noise scale (module docstring): plain IG at the weight of the MAP
    balance; reads the update, the model, the labels and the update's stated noise scale."""

    def __init__(self, config: NoiseAwareIGConfig | None = None) -> None:
        self.config = config or NoiseAwareIGConfig()

    def noise_std(self, obs: Observation) -> float:
        """The configured noise scale, else the update's stated one (checked: finite and >= 0)."""
        return noise_scale(obs.update, self.config.noise_std, "ig_noise")

    def balance(self, obs: Observation, std: float) -> NoiseBalance:
        """The energy of the update's tensors that IG matches (those of the model's parameters) against
        the noise's; refuses an update whose energy does not stand above its noise (nothing to match)."""
        names = {n for n, _ in obs.model.named_parameters()}
        balance = NoiseBalance.of([t for n, t in obs.update.tensors.items() if n in names], std)
        if balance.numel == 0:
            raise AttackInputError("the update is all zeros: nothing to match")
        if not balance.stands_out(self.config.tail):
            raise AttackInputError(
                f"the update's energy does not stand above the noise (s = {std:.3g}: estimated signal / "
                f"noise energy {balance.signal / balance.noise:.3g} over {balance.numel} entries): nothing "
                "to match"
            )
        return balance

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        obs, views = averaged(obs, self.config.average_views)
        std = self.noise_std(obs)
        balance = self.balance(obs, std)  # refuses before any work
        added = balance.tv_weight(std, self.config.prior_strength)
        plain = InvertingGradients(replace(self.config, tv_weight=self.config.tv_weight + added))
        rec = plain.reconstruct(obs, generator=generator)
        stats = {
            "noise_std": std,
            "snr": balance.signal / balance.noise if balance.noise > 0 else math.inf,
            "tv_noise": added,
            "views_averaged": views,
        }
        return Reconstruction(images=rec.images, labels=rec.labels, stats={**rec.stats, **stats})


ATTACKS.register(
    "ig_noise",
    NoiseAwareInvertingGradients,
    config_cls=NoiseAwareIGConfig,
    summary="adaptive IG vs DP noise: TV prior weighted at the MAP balance for the stated noise scale",
    modality="image",
    devices=DEVICE_TYPES,
)
