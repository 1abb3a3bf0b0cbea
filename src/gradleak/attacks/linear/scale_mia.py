"""Scale-MIA (Shi, Wei, Yang, Zhou, Chen, Li, Wu, Liu; arXiv 2311.05808): imprint bins in a latent space.

The server trains an autoencoder on its *public* auxiliary images, places the encoder in front of an
imprint layer (k cumulative bins on a random direction of the centred latent, cuts at the public latents'
quantiles, the same back-connection as :mod:`~gradleak.attacks.linear.robbing_the_fed`) and keeps the
decoder. The analytic recovery (difference of consecutive bins, weight update over bias update) returns
*latent codes* z_n = E(x_n) exactly for isolated samples; the decoder maps them to images, so the image
quality is the autoencoder's (the paper's two stages: recover the latent representations, then
decode them). Binning in a low-dimensional latent makes the layer small (k x d instead of k x C*H*W).

Autoencoder: Scale-MIA trains a convolutional autoencoder on public data. Here the default is the optimal
*linear* autoencoder of the public images (PCA, closed form, d = 256): on 2 CPU cores an MLP autoencoder
trained on 1000 public OrganAMNIST images reached only ~15 dB on client images, PCA-256 ~20 dB
(PneumoniaMNIST ~37 dB, PathMNIST ~27 dB). ``autoencoder = "mlp"`` keeps the trained nonlinear option.

No step reads client activations: the encoder is part of the broadcast model the client trains, the latent
codes come out of the update, and the decoder is the server's own (``Observation.secrets["decoder"]``).
The public demo code of Scale-MIA takes ground-truth activations as a shortcut; this implementation does not.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from gradleak.attacks.checks import require_image_input
from gradleak.attacks.linear.imprint import (
    ImprintSecrets,
    calibrate_back_weight,
    invert_bins,
    local_step_count,
    place_bins,
    program_bins,
)
from gradleak.attacks.linear.robbing_the_fed import (
    ADAM_EPS,
    TUNINGS,
    output_classes,
    require_public,
    scale_for,
)
from gradleak.models.malicious import ImprintBlock, imprint_parameter_names, insert_imprint
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation, Reconstruction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScaleMIAConfig:
    """``autoencoder``: ``pca`` (the optimal linear autoencoder of the public images, closed form) or ``mlp``
    (one hidden layer of ``hidden``, trained ``ae_epochs`` with Adam ``ae_lr`` on MSE in batches of
    ``ae_batch``); ``latent_dim`` d; the imprint options as in ``robbing_the_fed``; ``calibrate_encoder``:
    with ``tuned_for = "adam"``, keep the encoder's gradients below Adam's eps too (Adam barely moves it)."""

    num_bins: int = 1024
    autoencoder: str = "pca"
    latent_dim: int = 256
    hidden: int = 512
    ae_epochs: int = 150
    ae_lr: float = 2e-3
    ae_batch: int = 64
    scale: float | None = None
    back_weight: float = 10.0
    tuned_for: str = "sgd"
    adam_margin: float = 1e-4
    calibrate_encoder: bool = True
    max_images: int | None = None
    rel_tol: float = 1e-6

    def __post_init__(self) -> None:
        for key in ("num_bins", "latent_dim", "hidden", "ae_epochs", "ae_batch"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < (2 if key == "num_bins" else 1):
                raise ValueError(f"{key} must be a positive int (num_bins >= 2), got {v!r}")
        if self.autoencoder not in ("pca", "mlp"):
            raise ValueError(f"autoencoder must be 'pca' or 'mlp', got {self.autoencoder!r}")
        if self.tuned_for not in TUNINGS:
            raise ValueError(f"tuned_for must be one of {TUNINGS}, got {self.tuned_for!r}")
        for key in ("ae_lr", "back_weight", "adam_margin"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)!r}")
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale!r}")
        if self.max_images is not None and self.max_images < 1:
            raise ValueError(f"max_images must be >= 1, got {self.max_images}")
        if not 0 <= self.rel_tol < 1:
            raise ValueError(f"rel_tol must be in [0, 1), got {self.rel_tol}")


class Decoder(nn.Module):
    """Latent -> image in [0, 1], reshaped to ``image_shape``: an MLP with a sigmoid output, or (``linear``)
    one affine map clamped to [0, 1] (the decoder of the PCA autoencoder)."""

    def __init__(self, latent_dim: int, hidden: int, image_shape: tuple[int, ...], linear: bool = False):
        super().__init__()
        self.image_shape = tuple(image_shape)
        self.linear = linear
        dim = int(torch.tensor(image_shape).prod())
        self.net: nn.Module = (
            nn.Linear(latent_dim, dim)
            if linear
            else nn.Sequential(nn.Linear(latent_dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        out = self.net(z)
        out = out.clamp(0, 1) if self.linear else torch.sigmoid(out)
        return out.view(-1, *self.image_shape)


def encoder(dim: int, hidden: int, latent_dim: int, linear: bool = False) -> nn.Sequential:
    if linear:
        return nn.Sequential(nn.Flatten(), nn.Linear(dim, latent_dim))
    return nn.Sequential(nn.Flatten(), nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, latent_dim))


@torch.no_grad()
def pca_autoencoder(public: torch.Tensor, latent_dim: int) -> tuple[nn.Sequential, Decoder, float]:
    """The optimal *linear* autoencoder of the public images (Baldi & Hornik 1989): the top principal
    directions P (D, d); encoder z = P^T (x - mu), decoder x = P z + mu (clamped). ``d`` is capped at
    ``N - 1`` public images."""
    shape = tuple(int(d) for d in public.shape[1:])
    x = public.flatten(1).to(torch.float64)
    mu = x.mean(dim=0)
    d = min(latent_dim, len(x) - 1, x.shape[1])
    _, _, vh = torch.linalg.svd(x - mu, full_matrices=False)
    p = vh[:d]  # (d, D)
    enc = encoder(x.shape[1], 1, d, linear=True)
    lin = enc[1]
    assert isinstance(lin, nn.Linear)
    lin.weight.copy_(p)
    lin.bias.copy_(-(p @ mu))
    dec = Decoder(d, 1, shape, linear=True)
    assert isinstance(dec.net, nn.Linear)
    dec.net.weight.copy_(p.T)
    dec.net.bias.copy_(mu)
    mse = float(F.mse_loss(dec(enc(public)), public))
    return enc, dec, mse


def train_autoencoder(
    public: torch.Tensor, cfg: ScaleMIAConfig, generator: torch.Generator
) -> tuple[nn.Sequential, Decoder, float]:
    """The server's autoencoder: PCA (``autoencoder = "pca"``) or an MLP fitted with Adam on MSE."""
    if cfg.autoencoder == "pca":
        return pca_autoencoder(public, cfg.latent_dim)
    shape = tuple(int(d) for d in public.shape[1:])
    dim = int(public[0].numel())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        enc, dec = encoder(dim, cfg.hidden, cfg.latent_dim), Decoder(cfg.latent_dim, cfg.hidden, shape)
    params = [*enc.parameters(), *dec.parameters()]
    opt = torch.optim.Adam(params, lr=cfg.ae_lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.ae_epochs)
    for _ in range(cfg.ae_epochs):
        for idx in torch.randperm(len(public), generator=generator).split(cfg.ae_batch):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(dec(enc(public[idx])), public[idx]).backward()
            opt.step()
        sched.step()
    with torch.no_grad():
        mse = float(F.mse_loss(dec(enc(public)), public))
    for p in params:
        p.requires_grad_(True)
    return enc, dec, mse


class ScaleMIA:
    """The attack; see the module docstring."""

    def __init__(self, config: ScaleMIAConfig | None = None) -> None:
        self.config = config or ScaleMIAConfig()

    def prepare(
        self, model: nn.Module, public_images: torch.Tensor | None, *, generator: torch.Generator
    ) -> tuple[nn.Module, Mapping[str, object]]:
        cfg = self.config
        public = require_public(public_images, "scale_mia")
        t0 = time.perf_counter()
        enc, dec, mse = train_autoencoder(public, cfg, generator)
        log.info("scale_mia: autoencoder public MSE %.4g in %.1fs", mse, time.perf_counter() - t0)
        with torch.no_grad():
            latents = enc(public).to(torch.float64)
        d = int(latents.shape[1])
        mean, direction, cuts = place_bins(latents, "random", cfg.num_bins, generator)
        block = ImprintBlock(
            d, cfg.num_bins, front=copy.deepcopy(enc), back_weight=cfg.back_weight, offset=mean
        )
        program_bins(block.linear, direction, cuts, scale_for(cfg.scale, cfg.tuned_for))
        malicious = insert_imprint(model, block)
        if cfg.tuned_for == "adam":
            calibrate_back_weight(
                malicious, block, public, output_classes(malicious, public), cfg.adam_margin * ADAM_EPS,
                generator, include_front=cfg.calibrate_encoder,
            )  # fmt: skip
        weight_name, bias_name = imprint_parameter_names()
        secrets = ImprintSecrets(
            weight_name, bias_name, cfg.num_bins, (d,), block.linear.bias.detach(),
            mean.to(torch.float32),
        )  # fmt: skip
        return malicious, {"attack": "scale_mia", "decoder": dec.eval(), "autoencoder_public_mse": mse,
                           **secrets.to_mapping()}  # fmt: skip

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        require_image_input(obs)
        cfg = self.config
        start = time.perf_counter()
        decoder = obs.secrets.get("decoder")
        if not isinstance(decoder, Decoder):
            raise AttackInputError("scale_mia needs its decoder in Observation.secrets['decoder']")
        if decoder.image_shape != tuple(obs.input_shape):
            raise AttackInputError(f"decoder yields {decoder.image_shape}, the input is {obs.input_shape}")
        secrets = ImprintSecrets.from_observation(obs)
        limit = cfg.max_images or max(1, obs.update.num_samples)
        rec = invert_bins(
            obs.update.tensors[secrets.weight_name], obs.update.tensors[secrets.bias_name],
            max_items=limit, rel_tol=cfg.rel_tol,
        )  # fmt: skip
        if len(rec.bins):
            with torch.no_grad():
                z = secrets.restore(rec.features).to(torch.float32)
                images = decoder(z).clamp(0, 1)
        else:
            log.warning("scale_mia: no bin carries any update mass")
            images = torch.full((1, *obs.input_shape), 0.5)
        stats = {
            "seconds": time.perf_counter() - start,
            "bins": float(secrets.num_bins),
            "bins_recovered": float(len(rec.bins)),
        }
        steps = local_step_count(obs)
        if steps is not None:
            stats["local_steps"] = float(steps)
        return Reconstruction(images=images, labels=None, stats=stats)


ATTACKS.register(
    "scale_mia",
    ScaleMIA,
    config_cls=ScaleMIAConfig,
    summary="malicious server: imprint in an autoencoder's latent space, decoded recovery (Scale-MIA)",
    modality="image",
)
