"""A class-conditional diffusion generator that trains on CPU, for Aegis' synthetic cache (paper 000).

Paper 000 samples its cache from Stable Diffusion 2.0 (Appendix F.1) and allows generators "adapted on a
sanctioned client-side training split". Neither SD weights nor a GPU can be assumed at a hospital, so this
module trains a small denoising diffusion model (Ho et al. 2020, the epsilon objective
``E ||eps - eps_theta(sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, t, y)||^2``) on the images a client may use:

- the model is diffusers' ``UNet2DModel`` with a class embedding (``num_class_embeds = K + 1``: the extra
  index is the null class of classifier-free guidance, Ho & Salimans 2022; labels are dropped to it with
  probability ``class_dropout`` while training);
- the forward process and its schedule are diffusers' ``DDPMScheduler`` (``add_noise``), the sampler a
  few-step solver (DPM-Solver++ by default, Lu et al. 2022; or DDIM), built from the training schedule's
  config. Guided noise: ``eps_null + w (eps_y - eps_null)`` with guidance scale ``w`` (1: no guidance, one
  forward per step);
- weights are averaged by diffusers' ``EMAModel`` and the average is what samples.

``train_on = "own"`` fits it on the client's own share (it never leaves the client); ``"public"`` on a
sanctioned public split (``public``), where one generator may serve every client. A trained generator is
saved as safetensors under ``store`` (file named by the content of its training data and its options) and
reloaded, bit-identically, by the next run that asks for the same one.

``diffusers`` is an optional dependency (``pip install 'gradleak[diffusion]'``); without it, asking for
this generator is a clear error.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import importlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradleak.data.base import ImageDataset
from gradleak.defenses.aegis.generators.base import PublicSplit, check_labels, data_digest
from gradleak.defenses.aegis.generators.pool import PoolDraws, SamplePool
from gradleak.defenses.aegis.generators.quality import Reference, TrainingGate, split_heldout
from gradleak.device import DEVICE_TYPES, usable_device
from gradleak.fileio import kept
from gradleak.options import repr_without_defaults
from gradleak.progress import bar
from gradleak.registry import GENERATORS
from gradleak.update_io import read_tensors, tensor_digest, write_tensors

log = logging.getLogger(__name__)

FORMAT = "gradleak-diffusion-generator/1"
TRAIN_SOURCES = ("own", "public")

# Images per UNet forward while sampling on the CPU: the sampling batch (``sampling.batch_size``, the noise
# drawn and stepped together) is evaluated in slices of this many. Measured on 2 cores with the 0.76 M
# parameter UNet on 28 x 28 images (benchmarks/results/diffusion_forward_slices_small.json): 32-image
# forwards sample in 0.71 x the time of 256-image ones, whose activations spill out of the CPU's caches.
# The samples do not change: GroupNorm normalises each image on its own. On a GPU the batch is one forward.
CPU_FORWARD_IMAGES = 32


def require_diffusers() -> Any:
    """The ``diffusers`` module, or an ImportError that says how to get it."""
    try:
        return importlib.import_module("diffusers")
    except ImportError as exc:
        raise ImportError(
            "the diffusion generator needs the 'diffusers' package: pip install 'gradleak[diffusion]' "
            "(or pip install diffusers); the built-in 'gaussian' generator needs nothing more"
        ) from exc


def _full_precision() -> contextlib.AbstractContextManager[None]:
    """cuDNN without TF32 (PyTorch allows it for convolutions by default; on a GPU it would train and sample
    at 10-bit mantissas); a no-op on the CPU."""
    cudnn = torch.backends.cudnn
    return cudnn.flags(
        enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic, allow_tf32=False
    )


def diffusers_available() -> bool:
    try:
        require_diffusers()
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class UNetConfig:
    """The denoiser: ``UNet2DModel`` with one resolution level per entry of ``channels`` (each but the last
    halves the image, so H and W must be divisible by ``2 ** (len(channels) - 1)``), ``layers`` ResNet
    blocks per level, GroupNorm with ``norm_groups`` groups; the middle block has diffusers' self-attention
    at the lowest resolution, ``attention`` adds it to the lowest down and up blocks. The default (0.76 M
    parameters) trains 1,500 steps on 28 x 28 images in about 25 minutes on 2 cores (docs/defenses.md)."""

    channels: tuple[int, ...] = (32, 32, 64)
    layers: int = 1
    norm_groups: int = 8
    attention: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.channels, list):  # TOML and JSON give arrays; the config stays hashable
            object.__setattr__(self, "channels", tuple(self.channels))
        if not self.channels or any(not isinstance(c, int) or c < 1 for c in self.channels):
            raise ValueError(f"unet channels must be positive ints, got {self.channels!r}")
        if not isinstance(self.norm_groups, int) or self.norm_groups < 1:
            raise ValueError(f"unet norm_groups must be an int >= 1, got {self.norm_groups!r}")
        if any(c % self.norm_groups for c in self.channels):
            raise ValueError(
                f"unet channels {self.channels} must be multiples of norm_groups {self.norm_groups}"
            )
        if not isinstance(self.layers, int) or self.layers < 1:
            raise ValueError(f"unet layers must be an int >= 1, got {self.layers!r}")


@dataclass(frozen=True, repr=False)
class DiffusionTrainingConfig:
    """``steps`` AdamW steps of ``batch_size`` images at learning rate ``lr`` (cosine decay after
    ``warmup`` steps), an EMA of the weights whose decay warms up as ``1 - (1 + step)^(-3/4)`` (diffusers'
    EMAModel) and is capped at ``ema_decay`` (0.996 at step 1,500; the default cap 0.999 binds past 10,000
    steps), labels dropped to the null class with probability ``class_dropout``, a ``timesteps``-step
    cosine noise schedule (Nichol & Dhariwal 2021). ``gate``: stop when the samples pass a quality gate
    (:class:`~gradleak.defenses.aegis.generators.quality.TrainingGate`; ``steps`` is then the cap), e.g.
    ``gate = { every = 500, fidelity = 0.9 }``; None: train exactly ``steps``."""

    steps: int = 1500  # measured on OrganAMNIST val (docs/defenses.md): class-faithful samples
    batch_size: int = 64
    lr: float = 2e-3
    warmup: int = 100
    ema_decay: float = 0.999
    class_dropout: float = 0.1
    timesteps: int = 1000
    gate: TrainingGate | None = None

    def __repr__(self) -> str:
        return repr_without_defaults(self, "gate")  # the repr keys stored generators and caches

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "timesteps"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"diffusion training {key} must be an int >= 1, got {v!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"diffusion training warmup must be an int >= 0, got {self.warmup!r}")
        if not self.lr > 0:
            raise ValueError(f"diffusion training lr must be > 0, got {self.lr}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if not 0 <= self.class_dropout < 1:
            raise ValueError(f"class_dropout must be in [0, 1), got {self.class_dropout}")
        if self.gate is not None and max(self.gate.every, self.gate.min_steps) > self.steps:
            raise ValueError(
                f"the gate's every ({self.gate.every}) and min_steps ({self.gate.min_steps}) must not exceed "
                f"steps ({self.steps}), the cap: no check would run before it"
            )


def _dpm_solver(diffusers: Any, config: Any, spacing: str) -> Any:
    # the predicted x0 thresholded to the pixel range [-1, 1] (Lu et al. 2022, Sec. 5, for pixel-space
    # models): without it the cosine schedule's first step (alpha_bar ~ 0) divides by ~0 and every sample
    # saturates (measured: 99.9 % of pixels at 0 or 1 on OrganAMNIST); "leading" starts at t = 900, not 999
    return diffusers.DPMSolverMultistepScheduler.from_config(
        config,
        algorithm_type="dpmsolver++",
        thresholding=True,
        sample_max_value=1.0,
        timestep_spacing=spacing,
    )


def _ddim(diffusers: Any, config: Any, spacing: str) -> Any:
    # clips the predicted x0 to [-1, 1] (clip_sample)
    return diffusers.DDIMScheduler.from_config(config, timestep_spacing=spacing)


# sampler name -> the diffusers scheduler built from the training schedule's config and a timestep spacing
SAMPLERS: dict[str, Callable[[Any, Any, str], Any]] = {"dpm_solver": _dpm_solver, "ddim": _ddim}
# diffusers' timestep spacings (Lin et al. 2024, Table 2): where the few sampling steps sit in [0, T)
SPACINGS = ("leading", "trailing", "linspace")


@dataclass(frozen=True)
class DiffusionSamplingConfig:
    """``sampler`` (``dpm_solver``: DPM-Solver++ multistep; ``ddim``: DDIM, eta 0) in ``steps`` steps placed
    by ``spacing`` (diffusers' ``timestep_spacing``), classifier-free ``guidance`` scale w (1: none, half the
    forwards), ``batch_size`` images per forward."""

    sampler: str = "dpm_solver"
    steps: int = 10
    guidance: float = 1.5
    spacing: str = "leading"
    batch_size: int = 256

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {sorted(SAMPLERS)}, got {self.sampler!r}")
        if self.spacing not in SPACINGS:
            raise ValueError(f"spacing must be one of {list(SPACINGS)}, got {self.spacing!r}")
        for key in ("steps", "batch_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"diffusion sampling {key} must be an int >= 1, got {v!r}")
        if (
            isinstance(self.guidance, bool)
            or not isinstance(self.guidance, int | float)
            or not self.guidance >= 1
        ):
            raise ValueError(f"guidance must be a number >= 1 (1: no guidance), got {self.guidance!r}")
        object.__setattr__(self, "guidance", float(self.guidance))  # 1 and 1.0: one config, one pool key


@dataclass(frozen=True)
class DiffusionGeneratorConfig:
    """``train_on``: ``"own"`` (the client's share) or ``"public"`` (the split named by ``public``);
    ``unet``, ``training``, ``sampling``: nested tables; ``seed`` for the weights' initialisation and the
    training draws (mixed with a hash of the training data); ``store``: folder of the saved generators
    (safetensors, reused by content; None: not saved); ``pool``: with ``train_on = "public"``, sample that
    many images per class once and let every client draw its candidates from them
    (:mod:`gradleak.defenses.aegis.generators.pool`; 0: each client samples its own; ``seed`` also seeds the
    pool); ``device``: where the model trains and samples (``"cpu"`` or ``"cuda"``; every random draw still
    comes from a CPU generator and cuDNN runs without TF32, so a GPU differs from the CPU by the kernels'
    rounding; GPU training is not bit-repeatable run to run: some backward kernels add atomically). The device
    is not part of the stored file's name: a generator trained on a GPU is reused by a CPU run of the same
    options, and vice versa (a pool's key holds a hash of the weights it was sampled from)."""

    train_on: str = "own"
    public: PublicSplit = field(default_factory=PublicSplit)
    unet: UNetConfig = field(default_factory=UNetConfig)
    training: DiffusionTrainingConfig = field(default_factory=DiffusionTrainingConfig)
    sampling: DiffusionSamplingConfig = field(default_factory=DiffusionSamplingConfig)
    seed: int = 0
    store: str | None = "gradleak-out/generators"
    pool: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        try:
            device = torch.device(self.device) if isinstance(self.device, str) else None
        except RuntimeError:
            device = None
        if device is None or device.type not in DEVICE_TYPES:
            raise ValueError(
                f"device must be 'cpu' or 'cuda' ('cuda:1': a GPU of several), got {self.device!r}"
            )
        object.__setattr__(self, "device", str(device))  # "cuda:0" and "cuda:0 ": one config
        if self.train_on not in TRAIN_SOURCES:
            raise ValueError(f"train_on must be one of {TRAIN_SOURCES}, got {self.train_on!r}")
        if self.train_on == "public" and not self.public.named:
            raise ValueError("train_on = 'public' needs public = { dataset = ..., split = ... }")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if isinstance(self.pool, bool) or not isinstance(self.pool, int) or self.pool < 0:
            raise ValueError(f"pool must be an int >= 0 (images per class; 0: none), got {self.pool!r}")
        if self.pool and self.train_on != "public":
            raise ValueError(
                "a shared sample pool needs train_on = 'public' (a client's own generator never leaves it)"
            )
        if self.sampling.guidance != 1 and self.training.class_dropout == 0:
            raise ValueError(
                "guidance > 1 needs training.class_dropout > 0 (the null class is never trained)"
            )
        if self.sampling.steps >= self.training.timesteps:
            raise ValueError(
                f"sampling.steps ({self.sampling.steps}) must be below training.timesteps "
                f"({self.training.timesteps})"
            )


def _unet(diffusers: Any, cfg: UNetConfig, image_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    c, h, w = image_shape
    factor = 2 ** (len(cfg.channels) - 1)
    if h % factor or w % factor:
        raise ValueError(
            f"{h} x {w} images do not halve {len(cfg.channels) - 1} times; use fewer unet channels"
        )
    levels = len(cfg.channels)
    low = "AttnDownBlock2D" if cfg.attention else "DownBlock2D"
    up_low = "AttnUpBlock2D" if cfg.attention else "UpBlock2D"
    return diffusers.UNet2DModel(
        sample_size=(h, w),
        in_channels=c,
        out_channels=c,
        block_out_channels=tuple(cfg.channels),
        layers_per_block=cfg.layers,
        norm_num_groups=cfg.norm_groups,
        down_block_types=("DownBlock2D",) * (levels - 1) + (low,),
        up_block_types=(up_low,) + ("UpBlock2D",) * (levels - 1),
        num_class_embeds=num_classes + 1,  # the last index: the null class of classifier-free guidance
    )


def _schedule(diffusers: Any, cfg: DiffusionTrainingConfig) -> Any:
    return diffusers.DDPMScheduler(
        num_train_timesteps=cfg.timesteps, beta_schedule="squaredcos_cap_v2", prediction_type="epsilon"
    )


class _Gate:
    """A training run's quality gate (:class:`~gradleak.defenses.aegis.generators.quality.TrainingGate`):
    when to check, each check's scores, and whether one passed."""

    def __init__(self, config: TrainingGate, reference: Reference, train: ImageDataset) -> None:
        self.config, self.reference, self.train = config, reference, train
        self.history: list[dict[str, Any]] = []
        self.passed_at: int | None = None
        self.classes = sorted(reference.class_accuracy)  # the held-out classes, scored and in the ceiling
        self.ceiling = sum(reference.class_accuracy.values()) / len(self.classes)  # weighted as the fidelity

    def check(self, step: int, probe: DiffusionGenerator) -> bool:
        """Score ``probe`` (the EMA weights at ``step``) on the held-out classes; True when it passes
        (training stops)."""
        report = self.reference.score(f"gate, step {step}", probe, self.train, classes=self.classes)
        ceiling = self.ceiling
        self.history.append({"step": step, "fidelity": report.accuracy, "frechet": report.frechet,
                             "copy_rate": report.copy_rate, "weights": probe.weights_digest()})  # fmt: skip
        passed = self.config.passed(report, ceiling)
        log.info(
            "diffusion generator gate at step %d: class fidelity %.3f (needs %.3f = %.2f x the held-out "
            "ceiling %.3f), Frechet %.3g%s: %s",
            step,
            report.accuracy,
            self.config.fidelity * ceiling,
            self.config.fidelity,
            ceiling,
            report.frechet,
            "" if self.config.frechet is None else f" (needs <= {self.config.frechet:.3g})",
            "passed" if passed else "not yet",
        )
        if passed:
            self.passed_at = step
        return passed

    def summary(self) -> dict[str, Any]:
        if self.passed_at is None:
            log.warning(
                "diffusion generator: the quality gate did not pass within the cap of training steps "
                "(last check: %s); raise training.steps or lower the gate",
                self.history[-1] if self.history else "none ran",
            )
        return {
            "passed": self.passed_at is not None,
            "passed_at": self.passed_at,
            "ceiling": self.ceiling,
            "history": self.history,
        }


class DiffusionGenerator:
    """A trained class-conditional diffusion model; a
    :class:`~gradleak.defenses.aegis.generators.ConditionalGenerator`.
    Build it with :meth:`fit` (or :func:`fit_diffusion`, which also saves and reuses it) or :meth:`load`."""

    def __init__(
        self,
        unet: nn.Module,
        config: DiffusionGeneratorConfig,
        image_shape: tuple[int, int, int],
        num_classes: int,
        classes: list[int],
        info: dict[str, Any] | None = None,
    ) -> None:
        self.unet = unet.eval().requires_grad_(False)
        self.config = config
        self.image_shape = image_shape
        self.num_classes = num_classes
        self.classes = sorted(classes)
        self.info: dict[str, Any] = dict(info or {})  # train_on, images, seconds, parameters, digest
        self.cpu_forward_images = CPU_FORWARD_IMAGES

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.unet.parameters())

    @classmethod
    def fit(
        cls, data: ImageDataset, config: DiffusionGeneratorConfig, *, generator: torch.Generator
    ) -> DiffusionGenerator:
        """Train on every image of ``data`` (eq. above; with a quality ``gate``, on all but its held-out
        share); a class with no image cannot be sampled later."""
        diffusers = require_diffusers()
        if len(data) == 0:
            raise ValueError("cannot fit a diffusion generator on no images")
        device = usable_device(config.device, "diffusion generator device")
        tc = config.training
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        g = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):  # diffusers initialises from the global RNG: seed it here
            torch.manual_seed(seed)
            unet = _unet(diffusers, config.unet, data.input_shape, data.num_classes).to(device)
        schedule = _schedule(diffusers, tc)
        ema = importlib.import_module("diffusers.training_utils").EMAModel(
            unet.parameters(), decay=tc.ema_decay, use_ema_warmup=True, power=3 / 4
        )
        optimizer = torch.optim.AdamW(unet.parameters(), lr=tc.lr, weight_decay=0.0)
        lr_at = importlib.import_module("diffusers.optimization").get_cosine_schedule_with_warmup(
            optimizer, num_warmup_steps=min(tc.warmup, tc.steps - 1), num_training_steps=tc.steps
        )
        start, cpu_start = time.perf_counter(), time.process_time()
        gate: _Gate | None = None
        if tc.gate is not None:  # the held-out split and its reference classifier, from the training seed
            data, heldout = split_heldout(data, tc.gate.heldout, g)
            gate = _Gate(tc.gate, Reference(data, heldout, tc.gate.quality(seed % 2**31)), data)
        x_all = data.images * 2 - 1  # (N, C, H, W) in [-1, 1]
        y_all = data.labels
        null = data.num_classes
        classes = sorted(int(v) for v in data.labels.unique())
        unet.train()
        loss_sum, loss_n, last_loss, steps = 0.0, 0, math.nan, 0
        with _full_precision(), bar(desc="diffusion generator", total=tc.steps, unit="step") as progress:
            for steps in range(1, tc.steps + 1):
                idx = torch.randint(0, len(data), (tc.batch_size,), generator=g)
                x0, y = x_all[idx], y_all[idx].clone()
                y[torch.rand(len(y), generator=g) < tc.class_dropout] = null
                noise = torch.randn(x0.shape, generator=g)
                t = torch.randint(0, tc.timesteps, (len(x0),), generator=g)
                x0, noise, t, y = x0.to(device), noise.to(device), t.to(device), y.to(device)
                xt = schedule.add_noise(x0, noise, t)
                loss = nn.functional.mse_loss(unet(xt, t, class_labels=y).sample, noise)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if not torch.isfinite(loss):
                    raise FloatingPointError("diffusion generator training diverged (non-finite loss)")
                optimizer.step()
                lr_at.step()
                ema.step(unet.parameters())
                loss_sum, loss_n = loss_sum + float(loss.detach()), loss_n + 1
                if loss_n == 50:  # the mean loss over the last 50 steps
                    last_loss = loss_sum / loss_n
                    progress.set_postfix(loss=f"{last_loss:.4f}")
                    loss_sum, loss_n = 0.0, 0
                progress.update(1)
                if gate is not None and gate.config.due(steps, tc.steps):
                    snapshot = copy.deepcopy(unet)  # the EMA weights, as the finished generator has them
                    ema.copy_to(snapshot.parameters())
                    probe = cls(snapshot, config, data.input_shape, data.num_classes, classes)
                    if gate.check(steps, probe):
                        break
        ema.copy_to(unet.parameters())
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        info = {
            "train_on": config.train_on,
            "train_images": len(data),
            "train_seconds": seconds,
            "train_cpu_seconds": cpu_seconds,  # summed over torch's threads: the CPU-minutes budget
            "device": str(device),
            "train_loss": last_loss if not math.isnan(last_loss) else loss_sum / max(loss_n, 1),
            "data": data.name,
            "digest": data_digest(data).hex(),
            "train_steps": steps,
        }
        if gate is not None:
            info["gate"] = gate.summary()
        made = cls(unet, config, data.input_shape, data.num_classes, classes, info)
        log.info(
            "diffusion generator: %d parameters trained %d steps on %d images (%s) in %.1fs",
            made.parameters,
            steps,
            len(data),
            config.train_on,
            seconds,
        )
        return made

    def weights_digest(self) -> str:
        """A hash of the UNet's weights (20 hex digits)."""
        return tensor_digest(*self.unet.state_dict().values(), digest_size=10)

    def fingerprint(self) -> str:
        """Its weights and sampling options
        (:class:`~gradleak.defenses.aegis.generators.base.Fingerprinted`)."""
        return repr((self.weights_digest(), self.config.sampling, self.config.device))

    @torch.no_grad()
    def sample(self, labels: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
        """``labels (N,)`` -> images ``(N, C, H, W)`` in [0, 1]: the sampler's steps from N(0, I) noise
        drawn from ``generator``, with classifier-free guidance."""
        diffusers = require_diffusers()
        check_labels(labels, self.num_classes)
        missing = sorted({int(y) for y in labels} - set(self.classes))
        if missing:
            raise ValueError(
                f"diffusion generator was not trained on classes {missing}; it knows {self.classes}"
            )
        sc = self.config.sampling
        device = usable_device(self.config.device, "diffusion generator device")
        self.unet.to(device)
        out = torch.empty(len(labels), *self.image_shape)
        with _full_precision():
            for start in range(0, len(labels), sc.batch_size):
                y = labels[start : start + sc.batch_size]
                x = torch.randn((len(y), *self.image_shape), generator=generator)  # on the CPU: any device
                out[start : start + len(y)] = self._denoise(diffusers, x.to(device), y.to(device)).cpu()
        return ((out + 1) / 2).clamp(0.0, 1.0)

    def _denoise(self, diffusers: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        sc = self.config.sampling
        scheduler = SAMPLERS[sc.sampler](
            diffusers, _schedule(diffusers, self.config.training).config, sc.spacing
        )
        scheduler.set_timesteps(sc.steps)
        x = x * scheduler.init_noise_sigma
        guided = sc.guidance != 1
        labels = torch.cat([y, torch.full_like(y, self.num_classes)]) if guided else y
        for t in scheduler.timesteps:
            inp = scheduler.scale_model_input(x, t)
            eps = self._eps(torch.cat([inp, inp]) if guided else inp, t, labels)
            if guided:
                cond, null = eps.chunk(2)
                eps = null + sc.guidance * (cond - null)
            x = scheduler.step(eps, t, x).prev_sample
        return x

    def _eps(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The UNet's noise prediction for ``x`` at step ``t``, in slices of ``cpu_forward_images`` on the
        CPU (:data:`CPU_FORWARD_IMAGES`), in one forward elsewhere."""
        step = self.cpu_forward_images if x.device.type == "cpu" else len(x)
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"cpu_forward_images must be an int >= 1, got {step!r}")
        parts = [
            self.unet(x[i : i + step], t, class_labels=labels[i : i + step]).sample
            for i in range(0, len(x), step)
        ]
        return torch.cat(parts)

    # ---- persistence (safetensors: the weights, and the options and provenance as metadata)

    def save(self, path: str | Path) -> Path:
        """Write the weights and, as metadata, the options and provenance (atomically: a unique temporary
        file renamed over ``path``, so a killed run or a concurrent writer leaves no half-written file)."""
        meta = {
            "format": FORMAT,
            "config": json.dumps(dataclasses.asdict(self.config)),
            "image_shape": json.dumps(list(self.image_shape)),
            "num_classes": str(self.num_classes),
            "classes": json.dumps(self.classes),
            "info": json.dumps(self.info),
        }
        return write_tensors(path, {k: v.cpu() for k, v in self.unet.state_dict().items()}, meta)

    @classmethod
    def load(
        cls, path: str | Path, *, sampling: DiffusionSamplingConfig | None = None, device: str = "cpu"
    ) -> DiffusionGenerator:
        """Read a generator written by :meth:`save`; ``sampling`` replaces its sampling options; it samples on
        ``device`` (where it was trained is ``info["device"]``)."""
        from gradleak.options import build_dataclass

        diffusers = require_diffusers()
        state, meta = read_tensors(Path(path), f"diffusion generator {path}")
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a gradleak diffusion generator (format {meta.get('format')!r})")
        config: DiffusionGeneratorConfig = build_dataclass(
            DiffusionGeneratorConfig, json.loads(meta["config"]), where=str(path)
        )
        if sampling is not None:
            config = dataclasses.replace(config, sampling=sampling)
        config = dataclasses.replace(config, device=device)
        c, h, w = (int(v) for v in json.loads(meta["image_shape"]))
        image_shape = (c, h, w)
        num_classes = int(meta["num_classes"])
        unet = _unet(diffusers, config.unet, image_shape, num_classes)
        unet.load_state_dict(state, strict=True)
        return cls(
            unet,
            config,
            image_shape,
            num_classes,
            json.loads(meta["classes"]),
            json.loads(meta["info"]),
        )


def stored_name(digest: bytes, config: DiffusionGeneratorConfig) -> str:
    """The file of a trained generator: its training data's content and every option that changes the
    weights (not sampling, not the store folder)."""
    key = repr((FORMAT, config.train_on, config.unet, config.training, config.seed)).encode()
    return f"diffusion-{hashlib.blake2b(digest + key, digest_size=10).hexdigest()}.safetensors"


def diffusion_source(
    data: ImageDataset,
    config: DiffusionGeneratorConfig,
    *,
    generator: torch.Generator | None = None,
    root: str | os.PathLike[str] | None = None,
) -> DiffusionGenerator | PoolDraws:
    """The registered factory: the generator of :func:`fit_diffusion` or, with ``pool``, the client's draws
    from the public generator's shared pool, in an order from ``generator`` (required: the client's seed).
    A public split is read under ``root``."""
    made, name = _trained(data, config, root)
    if not config.pool:
        return made
    if generator is None:
        raise ValueError("drawing from a shared sample pool needs the client's generator (its own order)")
    pool = _shared_pool(made, name, config)
    return PoolDraws(pool, generator=generator, info=made.info)


def fit_diffusion(
    data: ImageDataset, config: DiffusionGeneratorConfig, root: str | os.PathLike[str] | None = None
) -> DiffusionGenerator:
    """Train on ``data`` (``train_on = "own"``) or on the public split (under ``root``), or reload the
    generator a previous run trained on the same data with the same options from ``store``."""
    return _trained(data, config, root)[0]


def _trained(
    data: ImageDataset, config: DiffusionGeneratorConfig, root: str | os.PathLike[str] | None = None
) -> tuple[DiffusionGenerator, str]:
    require_diffusers()
    usable_device(config.device, "diffusion generator device")  # before loading or training
    source = data if config.train_on == "own" else config.public.load_for(data, root)
    # the weights are a function of (training data, options), like the file that keeps them: the seed comes
    # from the options and the data's content, not from the caller's generator
    digest = data_digest(source)
    seed_gen = torch.Generator().manual_seed(config.seed ^ int.from_bytes(digest[:7]))
    name = stored_name(digest, config)
    public = config.train_on == "public"
    memo = (name, config.sampling, config.device)
    if public and memo in _PUBLIC:  # one public generator serves every client
        return _PUBLIC[memo], name

    def load(path: Path) -> DiffusionGenerator:
        made = DiffusionGenerator.load(path, sampling=config.sampling, device=config.device)
        made.info["reused"] = str(path)
        return made

    def save(made: DiffusionGenerator, path: Path) -> None:
        made.save(path)
        made.info["saved"] = str(path)

    path = Path(config.store) / name if config.store else None
    made = kept(path, load, lambda: DiffusionGenerator.fit(source, config, generator=seed_gen), save)
    if public:
        _PUBLIC[memo] = made
    return made, name


def _shared_pool(made: DiffusionGenerator, name: str, config: DiffusionGeneratorConfig) -> SamplePool:
    """The public generator's pool of ``config.pool`` images per class: this process's, the stored one, or
    sampled now and stored. Its key (and file name) holds the generator's file name and a hash of its
    weights (a generator trained again elsewhere gets its own pool), the sampling options, size and seed."""
    # what seeds the draws, and the process memo's key: in one process a generator file name holds one set
    # of weights (_PUBLIC, cleared with _POOLS), so the weights are hashed only for the stored file
    drawn = repr((name, config.sampling, config.pool, config.seed))
    if drawn in _POOLS:
        return _POOLS[drawn]
    key = repr((name, made.weights_digest(), config.sampling, config.pool, config.seed))
    file = f"diffusion-pool-{hashlib.blake2b(key.encode(), digest_size=10).hexdigest()}.safetensors"
    path = Path(config.store) / file if config.store else None
    labels = SamplePool.layout(made.classes, config.pool)
    seed = int.from_bytes(hashlib.blake2b(drawn.encode(), digest_size=7).digest())

    def draw() -> SamplePool:
        return SamplePool.draw(made, made.classes, config.pool, generator=torch.Generator().manual_seed(seed),
                               chunk=config.sampling.batch_size)  # fmt: skip

    pool = kept(path, lambda p: SamplePool.load(p, key, labels), draw, lambda pool, p: pool.save(p, key))
    _POOLS[drawn] = pool
    return pool


def clear_public_generators() -> None:
    """Drop the public-split generators and sample pools this process holds."""
    _PUBLIC.clear()
    _POOLS.clear()


# public-split generators trained or loaded in this process, by file name (a client's own are memoised with
# its cache by Aegis, and never shared)
_PUBLIC: dict[tuple[str, DiffusionSamplingConfig, str], DiffusionGenerator] = {}
# their sample pools, by what seeds their draws (generator file, sampling, size, seed)
_POOLS: dict[str, SamplePool] = {}


GENERATORS.register(
    "diffusion",
    diffusion_source,
    config_cls=DiffusionGeneratorConfig,
    summary="class-conditional diffusion UNet (diffusers) trained on CPU on the client's or a public split",
)
