"""Aegis (paper 000): per-epoch large logical-batch masking with a task-relevant synthetic cache.

Algorithm 1 of paper 000: after the real mini-batches of every local epoch, the client takes **one** extra
optimiser step on the mean gradient over its whole synthetic cache ``D_i'`` (``M_i = 2048`` by default),
computed at the current parameters; after ``E`` epochs it sends the ordinary delta ``w_T - w_0``
("Protocol-Compatible Accumulated Update": nothing new crosses the wire, the cache stays local).

Logical batch: the cache is split into micro-batches; each adds ``sum_n loss_n / M`` to the gradients, all at
fixed parameters, and the optimiser steps once afterwards, so the step uses exactly the full-batch mean
gradient (up to float rounding) for a sample-decomposable loss. Layers whose training-mode output depends
on the batch (BatchNorm) break that equivalence; they are refused unless ``micro_batch >= M``.

Normalisation (paper 000 uses two descriptions and does not reconcile them):

- ``"same_lr"`` (Algorithm 1 read literally): the synthetic step applies the cache's *mean* gradient with the
  client's optimiser and learning rate, like a real mini-batch step. A synthetic sample then weighs
  ``1/M`` against a real sample's ``1/B``.
- ``"lambda"`` (the analysis, Appendix G: ``g~ = (1 - lambda) g + lambda g'``, ``lambda = M / (B + M)``): the
  synthetic gradient is weighted ``lambda / (1 - lambda) = M / B`` relative to a real step's gradient, so
  every real and synthetic sample carries the same weight, as in one batch of ``B + M``. Real steps are
  left unchanged. **Default**: it is the reading under which synthetic samples actually mix with real ones
  in a linear-leakage bin (docs/defenses.md gives the measurements for both).

Optimiser state of the synthetic step (``optimizer_state``; Algorithm 1 says "one extra optimiser step" and
leaves the state open):

- ``"shared"`` (default, Algorithm 1 read literally): the step runs on the client's optimiser and its state.
  With Adam and lambda weighting the synthetic gradient is ``M / B`` = 32x a real step's, so it enters
  Adam's second moment (``v <- beta2 v + (1 - beta2) g^2``, Kingma & Ba 2015, Alg. 1) about 1,000x a real
  gradient's square and its first moment 32x: the real steps after it follow the synthetic direction.
- ``"separate"``: the step runs on an optimiser state of its own, kept across the epochs of one local
  training run (the synthetic stream's moments); the real steps keep theirs, as without the defense. With
  Adam the synthetic step is then scale-free (the first one is ``lr * g / (|g| + eps)`` per coordinate), so
  the lambda weight no longer sets its size. For a stateless optimiser (SGD without momentum) the two are
  the same.

Cache: bound explicitly (:meth:`AegisSynthetic.bind`, :func:`aegis_for_client`), or, when none is bound,
built in ``setup`` from the client's private data in its setup context
(:class:`~gradleak.defenses.base.SetupContext`: ``data``, and ``data_root`` for a public split): the
configured class-conditional generator (``generator``: built-in PCA Gaussian by default, diffusion, oracle)
fit on that data,
candidates accepted by the feature-space budget H (:mod:`gradleak.defenses.aegis.cache`), drawn from a
seed derived from ``cache_seed`` and a hash of the data. That makes the cache a deterministic function of
(data, options), so it is memoised per client by content (the data's hash and the options, not
a client id: two clients never share a cache, and a client gets the same cache every round); ``memo_size``
caches are kept (least recently used dropped; ``M * C*H*W * 4`` bytes each, 6.4 MB for M = 2048 grey 28x28),
0 disables. This is what makes ``[[defenses]] name = "aegis"`` work from a TOML config.

Fail closed: a missing cache (none bound and no data), a cache that cannot be built from the data, a
cache whose image shape differs from the real batches' (recorded by a forward pre-hook during the first
epoch), or a non-finite gradient raises, and :class:`~gradleak.defenses.base.DefenseChain` withholds the
update.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gradleak.data.base import ImageDataset
from gradleak.defenses.aegis.cache import CACHE_FORMAT, CacheConfig, SyntheticCache, build_cache
from gradleak.defenses.aegis.generators.base import ConditionalGenerator, data_digest, fingerprint
from gradleak.defenses.aegis.generators.diffusion import DiffusionGeneratorConfig, clear_public_generators
from gradleak.defenses.aegis.generators.gaussian import GaussianGeneratorConfig
from gradleak.defenses.aegis.generators.oracle import OracleGeneratorConfig
from gradleak.defenses.base import Defense, SetupContext
from gradleak.device import module_device
from gradleak.fileio import kept
from gradleak.registry import DEFENSES, GENERATORS
from gradleak.types import Update

log = logging.getLogger(__name__)

NORMALISATIONS = ("lambda", "same_lr")
OPTIMIZER_STATES = ("shared", "separate")  # the synthetic step's optimiser state (module docstring)
GENERATOR_TABLES = ("gaussian", "diffusion", "oracle")  # built-in generators whose options are a field below


@dataclass(frozen=True)
class AegisConfig:
    """``cache.size`` M (the cache must hold at least M images; the first M are used); ``micro_batch``
    images per forward/backward; ``normalization`` ``"lambda"`` | ``"same_lr"``; ``real_batch_size`` B in
    ``lambda = M / (B + M)``; ``optimizer_state`` ``"shared"`` | ``"separate"``: the synthetic step's
    optimiser state (module docstring).

    Building the cache from the client's data in ``setup`` (when none is bound): ``generator``, a name of
    :data:`~gradleak.registry.GENERATORS`, configured by the nested table of its name: ``"gaussian"``
    (default, :class:`~gradleak.defenses.aegis.generators.ClassGaussianGenerator`: ``components``,
    ``temperature``),
    ``"diffusion"`` (:mod:`gradleak.defenses.aegis.generators.diffusion`: ``train_on``, ``public``, ``unet``,
    ``training``, ``sampling``, ``seed``, ``store``, ``pool``), ``"oracle"`` (diagnostic: real images of a
    ``public`` split); a plugin's generator with the ``options`` table (validated against the config
    dataclass it registered; its defaults when empty). The nested ``cache`` table is the
    acceptance filter (:class:`~gradleak.defenses.aegis.cache.CacheConfig`: ``size`` M, ``budget`` H (None:
    calibrated), ``budget_quantile``, ``budget_scale``, ``match_k``, ``max_candidates_factor``, ``pilot``,
    ``normalize``);
    ``cache_seed``; ``memo_size`` caches memoised; ``store``: a folder where each built cache is kept
    (safetensors named by its content: the client's data, these options and the generator's
    :func:`~gradleak.defenses.aegis.generators.base.fingerprint`) and reloaded by a later run or process that
    builds the same one; it holds the client's synthetic images, so in a deployment it is the client's own
    disk. In TOML: ``cache = { size = 512 }``.
    """

    micro_batch: int = 256
    normalization: str = "lambda"
    real_batch_size: int = 64
    optimizer_state: str = "shared"
    cache: CacheConfig = field(default_factory=CacheConfig)
    generator: str = "gaussian"
    gaussian: GaussianGeneratorConfig = field(default_factory=GaussianGeneratorConfig)
    diffusion: DiffusionGeneratorConfig = field(default_factory=DiffusionGeneratorConfig)
    oracle: OracleGeneratorConfig = field(default_factory=OracleGeneratorConfig)
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)  # a plugin generator's options
    cache_seed: int = 0
    memo_size: int = 100
    store: str | None = None

    def __post_init__(self) -> None:
        for key in ("micro_batch", "real_batch_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} must be an int >= 1, got {v!r}")
        if self.normalization not in NORMALISATIONS:
            raise ValueError(f"normalization must be one of {NORMALISATIONS}, got {self.normalization!r}")
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(
                f"optimizer_state must be one of {OPTIMIZER_STATES}, got {self.optimizer_state!r}"
            )
        if not isinstance(self.generator, str) or self.generator not in GENERATORS:
            raise ValueError(f"generator must be one of {GENERATORS.names()}, got {self.generator!r}")
        object.__setattr__(self, "generator", self.generator.lower())  # the registry's names are lower-case
        if not isinstance(self.options, Mapping):
            raise ValueError(
                f"options must be a table of the plugin generator's options, got {self.options!r}"
            )
        if self.options and self.generator in GENERATOR_TABLES:
            raise ValueError(
                f"options is for a plugin's generator; {self.generator!r} takes its own table: "
                f"{self.generator} = {{ ... }}"
            )
        if self.generator not in GENERATOR_TABLES:  # a plugin's: its options checked now, not in setup
            GENERATORS.make_config(self.generator, self.options)
        if self.generator == "oracle" and not self.oracle.public.named:
            raise ValueError("generator 'oracle' needs oracle = { public = { dataset = ..., split = ... } }")
        if self.store is not None and (not isinstance(self.store, str) or not self.store):
            raise ValueError(f"store must be a folder name or None, got {self.store!r}")
        for key in ("cache_seed", "memo_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{key} must be an int >= 0, got {v!r}")

    @property
    def generator_options(self) -> object:
        """The chosen generator's options: the nested table of its name (a plugin's: its defaults)."""
        if self.generator in GENERATOR_TABLES:
            return getattr(self, self.generator)
        return GENERATORS.make_config(self.generator, self.options)

    @property
    def cache_size(self) -> int:
        """M, the cache images per synthetic step (``cache.size``)."""
        return self.cache.size

    @property
    def lam(self) -> float:
        return self.cache_size / (self.real_batch_size + self.cache_size)

    @property
    def synthetic_weight(self) -> float:
        """Factor on the cache's mean gradient: ``M / B`` (lambda) or 1 (same_lr)."""
        return self.lam / (1 - self.lam) if self.normalization == "lambda" else 1.0


def batch_dependent(model: nn.Module) -> list[str]:
    return [
        n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]


def accumulate_mean_gradient(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    micro_batch: int,
    weight: float = 1.0,
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Set ``p.grad = weight * d/dw mean_n L(model(x_n), y_n)`` over all ``images``, in micro-batches at
    fixed parameters; returns the mean loss. ``L``: ``criterion`` (a per-batch *mean* loss, the local
    recipe's: :class:`~gradleak.defenses.base.SetupContext`), cross-entropy when None."""
    n = len(images)
    for p in model.parameters():
        p.grad = None
    total, device = 0.0, module_device(model)
    for x, y in zip(images.split(micro_batch), labels.split(micro_batch), strict=True):
        out, target = model(x.to(device)), y.to(device)
        if criterion is None:
            loss = F.cross_entropy(out, target, reduction="sum")
        else:  # a mean over the micro-batch: times its size, the sum
            loss = criterion(out, target) * len(x)
        (loss * (weight / n)).backward()
        total += float(loss.detach())
    return total / n


_MEMO: OrderedDict[tuple[bytes, AegisConfig, str], SyntheticCache] = OrderedDict()


def _memo_key(
    data: ImageDataset, config: AegisConfig, root: str | os.PathLike[str] | None = None
) -> tuple[bytes, AegisConfig, str]:
    # options that do not change the cache (step, weighting, memo size, store) are not part of the key; the
    # data root is (a public split under another root is other images)
    return (
        data_digest(data),
        AegisConfig(
            cache=config.cache,
            generator=config.generator,
            gaussian=config.gaussian,
            diffusion=config.diffusion,
            oracle=config.oracle,
            options=config.options,
            cache_seed=config.cache_seed,
            memo_size=0,
            store=None,
        ),
        str(root),
    )


def cache_from_data(
    data: ImageDataset, config: AegisConfig, *, root: str | os.PathLike[str] | None = None
) -> SyntheticCache:
    """The client's synthetic cache built from its own data: the configured generator fit on ``data`` (or
    on the public split its options name, read under the data ``root``, or reloaded from its store), then
    :func:`~gradleak.defenses.aegis.cache.build_cache` accepting candidates against ``data``, from a seed
    derived from ``cache_seed`` and the data's hash. Memoised by content (``memo_size`` entries)."""
    key = _memo_key(data, config, root)
    if config.memo_size > 0 and key in _MEMO:
        _MEMO.move_to_end(key)
        return _MEMO[key]
    seed = int.from_bytes(hashlib.blake2b(key[0] + config.cache_seed.to_bytes(8), digest_size=8).digest())
    t0 = time.perf_counter()
    fit_seed = torch.Generator().manual_seed(seed >> 2)  # not the cache's draws: those stay as before
    source = GENERATORS.get(config.generator)(data, config.generator_options, generator=fit_seed, root=root)
    fit = time.perf_counter() - t0
    draws = torch.Generator().manual_seed(seed >> 1)
    if config.store is None:
        cache = _build(source, data, config, draws, fit)
    else:
        name = _stored_key(key[0], config, source)
        file = f"aegis-cache-{hashlib.blake2b(name.encode(), digest_size=10).hexdigest()}.safetensors"
        cache = kept(
            Path(config.store) / file,
            lambda p: SyntheticCache.load(p, name),
            lambda: _build(source, data, config, draws, fit),
            lambda c, p: c.save(p, name),
        )
    if config.memo_size > 0:
        _MEMO[key] = cache
        while len(_MEMO) > config.memo_size:
            _MEMO.popitem(last=False)
    return cache


def _build(
    source: ConditionalGenerator, data: ImageDataset, config: AegisConfig, draws: torch.Generator, fit: float
) -> SyntheticCache:
    """:func:`~gradleak.defenses.aegis.cache.build_cache` from ``draws``, with the generator's fit time and
    provenance in the stats."""
    cache = build_cache(source, data, config.cache, generator=draws)
    cache.stats["generator_fit_seconds"] = fit
    info = getattr(source, "info", {})  # a trained generator's provenance (diffusion): into the stats
    cache.stats.update({f"generator_{k}": float(v) for k, v in info.items() if isinstance(v, int | float)})
    log.info(
        "aegis: built a cache of %d from %d client images in %.2fs (rejection rate %.1f%%)",
        len(cache), len(data), fit + cache.stats["seconds"], 100 * cache.stats["rejection_rate"],
    )  # fmt: skip
    return cache


def _stored_key(digest: bytes, config: AegisConfig, source: ConditionalGenerator) -> str:
    """What a stored cache is a function of: the build's format, the client's data, the options that shape
    the cache (the generator, its options without where they are stored, ``cache``, ``cache_seed``) and the
    generator's fingerprint. Options that do not shape it (the step's, the memo's, the stores') stay out,
    so a moved store or another micro-batch finds the same file."""
    options = config.generator_options
    if dataclasses.is_dataclass(options) and "store" in {f.name for f in dataclasses.fields(options)}:
        options = dataclasses.replace(options, store=None)  # type: ignore[type-var]
    return repr(
        (
            CACHE_FORMAT,
            digest.hex(),
            config.generator,
            options,
            config.cache,
            config.cache_seed,
            fingerprint(source),
        )
    )


def memoised_caches() -> list[SyntheticCache]:
    """The caches currently memoised (least recently used first)."""
    return list(_MEMO.values())


def clear_cache_memo() -> None:
    """Drop every memoised cache and public-split generator (e.g. between experiments, to free memory)."""
    _MEMO.clear()
    clear_public_generators()


class AegisSynthetic(Defense):
    """The Aegis defense for one client. Either bind its offline-built cache with :meth:`bind` (or the
    constructor) before local training, or let ``setup`` build it from the client's ``data`` (what a client
    does when the defense comes from a config: ``DEFENSES.create("aegis", ...)`` returns an unbound
    instance). Unbound and without data, ``setup`` fails closed."""

    name = "aegis"

    def __init__(self, config: AegisConfig | None = None, cache: SyntheticCache | None = None) -> None:
        self.config = config or AegisConfig()
        self.cache: SyntheticCache | None = None  # bound by the caller; used for every client
        self.active_cache: SyntheticCache | None = None  # this local training run's cache
        self.steps = 0
        self.last_loss = math.nan
        self._real_shape: tuple[int, ...] | None = None
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._synthetic_state: defaultdict[torch.Tensor, dict[str, object]] = defaultdict(dict)
        self._criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        if cache is not None:
            self.bind(cache)

    def bind(self, cache: SyntheticCache) -> AegisSynthetic:
        if len(cache) < self.config.cache_size:
            raise ValueError(f"cache holds {len(cache)} images, Aegis needs M = {self.config.cache_size}")
        self.cache = cache
        return self

    def setup(self, model: nn.Module, context: SetupContext) -> None:
        """Pick this run's cache: the bound one, else one built from ``context.data`` (the client's private
        data, :func:`cache_from_data`; a public split is read under ``context.data_root``); neither: fail
        closed. ``context.generator`` (the client's training randomness) is not consumed, so real batches
        are drawn as without the defense; ``context.criterion`` (the recipe's loss: Eloul et al.'s MSE, say)
        is the loss the synthetic step descends, as the real steps do."""
        self.active_cache = None
        data = context.data
        if self.cache is not None:
            active = self.cache
        elif isinstance(data, ImageDataset):
            active = cache_from_data(data, self.config, root=context.data_root)
        else:
            raise RuntimeError(
                "aegis has no synthetic cache and got no client data: bind one "
                "(defenses.aegis.cache.build_cache) or pass the client's data to setup"
            )
        if len(active) < self.config.cache_size:
            raise ValueError(f"cache holds {len(active)} images, Aegis needs M = {self.config.cache_size}")
        bad = batch_dependent(model)
        if bad and self.config.micro_batch < self.config.cache_size:
            raise RuntimeError(f"batch-dependent layers {bad[:3]} break micro-batch accumulation")
        self.active_cache = active
        self._criterion = context.criterion  # the synthetic step descends the real steps' loss
        self.steps = 0
        self._synthetic_state = defaultdict(dict)  # a fresh synthetic stream for each local training run
        self._real_shape = None
        self._hook = model.register_forward_pre_hook(self._record_shape)

    def _record_shape(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if self._real_shape is None and args and isinstance(args[0], torch.Tensor):
            self._real_shape = tuple(args[0].shape[1:])

    def on_epoch_end(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        cache = self.active_cache
        if cache is None:
            raise RuntimeError("aegis has no synthetic cache (setup did not run or failed)")
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        m = self.config.cache_size
        images, labels = cache.images[:m], cache.labels[:m]
        if self._real_shape is not None and tuple(images.shape[1:]) != self._real_shape:
            raise ValueError(f"cache images are {tuple(images.shape[1:])}, the task's are {self._real_shape}")
        optimizer.zero_grad(set_to_none=True)
        self.last_loss = accumulate_mean_gradient(
            model, images, labels, self.config.micro_batch, self.config.synthetic_weight, self._criterion
        )
        for n, p in model.named_parameters():
            if p.grad is not None and not torch.isfinite(p.grad).all():
                raise FloatingPointError(f"non-finite synthetic gradient in {n}")
        if self.config.optimizer_state == "separate":
            real_state, optimizer.state = optimizer.state, self._synthetic_state
            try:
                optimizer.step()
            finally:
                self._synthetic_state, optimizer.state = optimizer.state, real_state
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        log.debug("aegis: synthetic step %d, mean loss %.4f", self.steps, self.last_loss)

    def on_update(self, update: Update) -> Update:
        """Fail closed when no synthetic step ran (e.g. FedSGD, which has no local epochs): the update
        would leave unmasked. Otherwise the ordinary delta goes out unchanged."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.steps == 0:
            raise RuntimeError("aegis took no synthetic step (FedSGD has no epochs); update withheld")
        return update


def aegis_for_client(synthetic: SyntheticCache, /, **options: object) -> AegisSynthetic:
    """A client's Aegis defense from config options (as ``DEFENSES.create``, e.g. ``cache={"size": 512}``)
    and its own synthetic cache."""
    defense = DEFENSES.create("aegis", **options)
    if not isinstance(defense, AegisSynthetic):
        raise TypeError(f"defense 'aegis' is a {type(defense).__name__}, not gradleak's Aegis")
    return defense.bind(synthetic)


DEFENSES.register(
    "aegis",
    AegisSynthetic,
    config_cls=AegisConfig,
    summary="Aegis (paper 000): per-epoch synthetic logical-batch step; needs a client-built cache",
    modality="image",
)
