"""DP-SGD through Opacus: per-sample clipping, Gaussian noise and a privacy accountant (Abadi et al. 2016).

Each local step computes every sample's gradient ``g_i`` with Opacus' per-sample hooks
(:class:`opacus.GradSampleModule`), clips it to L2 norm ``C`` and sends the noised mean (Abadi et al.,
Alg. 1)::

    g~ = (1 / B) * ( sum_i g_i * min(1, C / ||g_i||_2)  +  N(0, sigma^2 C^2 I) )

with Opacus' :class:`opacus.optimizers.DPOptimizer` doing the clipping, the noise (from the client's
generator; ``secure_mode`` for Opacus' floating-point-safe noise) and the scaling; the clipped gradient then
reaches the client's own optimizer. Nothing here computes a per-sample gradient by hand.

Accounting: every step is recorded in an Opacus accountant (``rdp`` by default; ``prv``, ``gdp``) at
sampling rate ``q = B / N``, with ``N`` the number of samples local training draws from. The update carries
``dp_sgd/epsilon`` at ``dp_sgd/delta`` for this local training run, with the steps, ``q`` and ``sigma``
that produced it (the accountant's epsilon, as for Poisson sampling; the loop draws shuffled fixed-size
batches, the approximation Opacus makes with ``poisson_sampling=False``). A client that takes part in R
rounds composes R such runs: :func:`epsilon_over_rounds`. ``target_epsilon`` picks ``sigma`` with Opacus'
``get_noise_multiplier`` so that ``budget_steps`` steps at ``q`` spend exactly that budget; a run that goes
past ``budget_steps`` fails closed.

Supported models: those Opacus supports (``ModuleValidator``: no BatchNorm, whose batch statistics mix
samples; use GroupNorm), with Opacus' own per-sample rules for Linear, Conv, Embedding, LayerNorm,
GroupNorm and its functorch fallback for other parametrised layers (transformers' GPT-2 ``Conv1D``, Llama's
RMSNorm). Opacus' per-sample hooks fire only in train mode: on a model trained in eval mode (the text
tasks' default, for no dropout) the parametrised modules are switched to train mode for each forward pass
and back after it, which changes none of their outputs (only dropout and BatchNorm read the flag, and
neither is among them). The loss must be a mean over samples (image and text classification); for causal
LM it is the mean over the batch's tokens, so a sample's gradient is weighted by its share of tokens: each
clipped vector is still bounded by ``C``, but the add/remove-one sensitivity then holds only for
equal-length samples.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradleak.defenses.base import COMPOSITIONS, NOISE_STD, Defense, SetupContext
from gradleak.device import generator_on, module_device
from gradleak.registry import DEFENSES
from gradleak.types import Update

DEFAULT_NOISE_MULTIPLIER = 1.0  # sigma when neither it nor a target epsilon is given (Opacus' tutorials)
ACCOUNTANTS = ("rdp", "prv", "gdp")  # opacus.accountants.create_accountant's mechanisms
META = "dp_sgd/"  # prefix of the Update.metadata keys this defense writes
# torch warns on every backward through Opacus' full backward hooks when the input needs no gradient (an
# image batch never does): expected here, and said once in this comment rather than on every step
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                        "respect to module outputs", category=UserWarning)  # fmt: skip


def _get_epsilon(accountant: object, delta: float) -> float:
    with warnings.catch_warnings():  # RDP: "optimal order is the largest alpha" (a looser bound, still valid)
        warnings.simplefilter("ignore", UserWarning)
        return float(accountant.get_epsilon(delta=delta))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class DPSGDConfig:
    clip: float = 1.0  # C: each sample's gradient is clipped to this L2 norm (Opacus max_grad_norm)
    noise_multiplier: float | None = None  # sigma; None: from target_epsilon, else DEFAULT_NOISE_MULTIPLIER
    target_epsilon: float | None = None  # spend exactly this over budget_steps steps (sigma from Opacus)
    budget_steps: int | None = None  # the steps a target epsilon covers (local steps x rounds joined)
    delta: float = 1e-5  # the delta epsilon is stated at
    accountant: str = "rdp"
    sample_rate: float | None = None  # q; None: B / N with N the samples local training draws from
    secure_mode: bool = False  # Opacus' noise robust to floating-point attacks (slower)

    def __post_init__(self) -> None:
        if not 0 < self.clip < math.inf:
            raise ValueError(f"dp_sgd clip must be finite and > 0, got {self.clip}")
        if self.noise_multiplier is not None and not 0 <= self.noise_multiplier < math.inf:
            raise ValueError(f"dp_sgd noise_multiplier must be finite and >= 0, got {self.noise_multiplier}")
        if self.target_epsilon is not None:
            if self.noise_multiplier is not None:
                raise ValueError("dp_sgd takes noise_multiplier or target_epsilon, not both")
            if not 0 < self.target_epsilon < math.inf:
                raise ValueError(f"dp_sgd target_epsilon must be finite and > 0, got {self.target_epsilon}")
            if self.budget_steps is None:
                raise ValueError("dp_sgd target_epsilon needs budget_steps (the steps the budget covers)")
        if self.budget_steps is not None and self.budget_steps < 1:
            raise ValueError(f"dp_sgd budget_steps must be >= 1, got {self.budget_steps}")
        if not 0 < self.delta < 1:
            raise ValueError(f"dp_sgd delta must be in (0, 1), got {self.delta}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"dp_sgd accountant must be one of {ACCOUNTANTS}, got {self.accountant!r}")
        if self.sample_rate is not None and not 0 < self.sample_rate <= 1:
            raise ValueError(f"dp_sgd sample_rate must be in (0, 1], got {self.sample_rate}")
        if self.secure_mode and importlib.util.find_spec("torchcsprng") is None:
            raise ValueError(
                "dp_sgd secure_mode=True needs torchcsprng (Opacus draws its floating-point-safe noise from "
                "it), which is not installed and whose last release (2021) predates this torch; refused "
                "rather than run as if secure. Without it the noise comes from a torch generator seeded "
                "from the operating system (deployment) or from the experiment's seed (simulation)"
            )


@functools.lru_cache(maxsize=256)
def noise_multiplier_for(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp"
) -> float:
    """Opacus' ``get_noise_multiplier``: the sigma that spends ``target_epsilon`` at ``delta`` over ``steps``
    steps at ``sample_rate``. Cached: every client's every local run asks the same question, and Opacus'
    search takes about a second at epsilon 8 (0.25 s at 1), which made a round of 20 clients 4x slower."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate, steps=steps,
            accountant=accountant,
        )
    )  # fmt: skip


def epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp"
) -> float:
    """Opacus' epsilon at ``delta`` after ``steps`` DP-SGD steps at ``(sigma, q)``; inf without noise."""
    return _accounted([(noise_multiplier, sample_rate, steps)], delta, accountant)


def _accounted(history: list[tuple[float, float, int]], delta: float, accountant: str) -> float:
    """Opacus' epsilon at ``delta`` of the ``(sigma, q, steps)`` runs composed; inf when one has no noise."""
    history = [h for h in history if h[2] > 0]
    if not history:
        return 0.0
    if any(sigma == 0 for sigma, _, _ in history):
        return math.inf
    from opacus.accountants import create_accountant

    acc = create_accountant(accountant)
    acc.history = history
    return _get_epsilon(acc, delta)


def epsilon_over_rounds(updates: Iterable[Update], accountant: str = "rdp") -> float:
    """The epsilon of one client's data over the DP-SGD updates it sent (one per round it joined): the
    accountant's composition of every recorded step (all at the same delta)."""
    return epsilon_of_releases([u.metadata for u in updates], accountant)


def epsilon_of_releases(metadatas: Iterable[Mapping[str, object]], accountant: str = "rdp") -> float:
    """:func:`epsilon_over_rounds` from the releases' metadata."""
    history: list[tuple[float, float, int]] = []
    deltas = set()
    for m in metadatas:
        if f"{META}steps" not in m:
            raise ValueError("an update without dp_sgd metadata: it was not trained under dp_sgd")
        sigma = float(m[f"{META}noise_multiplier"])  # type: ignore[arg-type]
        history.append((sigma, float(m[f"{META}sample_rate"]), int(m[f"{META}steps"])))  # type: ignore[arg-type, call-overload]
        deltas.add(float(m[f"{META}delta"]))  # type: ignore[arg-type]
    if len(deltas) > 1:
        raise ValueError(f"the updates state epsilon at different deltas {sorted(deltas)}")
    return _accounted(history, deltas.pop() if deltas else 1.0, accountant)


def _compose(metadatas: Sequence[Mapping[str, object]]) -> tuple[float, float]:
    """Releases of one client's data under dp_sgd: the composition of all their steps by the accountant
    that stated each release's epsilon."""
    accountants = {str(m.get(f"{META}accountant", "rdp")) for m in metadatas}
    if len(accountants) > 1:
        raise ValueError(f"the releases state epsilon by different accountants {sorted(accountants)}")
    eps = epsilon_of_releases(metadatas, accountants.pop())
    return eps, float(metadatas[0][f"{META}delta"])  # type: ignore[arg-type]


COMPOSITIONS[META.rstrip("/")] = _compose


def _parametrised(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]


class DPSGD(Defense):
    """Opacus DP-SGD in the client's loop: see the module docstring."""

    name = "dp_sgd"
    differential_privacy = True

    def __init__(self, config: DPSGDConfig | None = None) -> None:
        self.config = config or DPSGDConfig()
        self._gsm: Any = None
        self._optimizer: Any = None
        self._params: list[nn.Parameter] = []
        self._modes: list[tuple[nn.Module, bool]] = []
        self._handles: list[Any] = []
        self._batch: int | None = None
        self._train_size: int | None = None
        self.sigma: float | None = None
        self.sample_rate: float | None = None
        self.steps = 0
        self._batch_of_step = 1  # the batch size of the last step (the FedSGD noise scale sigma C / B)

    def setup(self, model: nn.Module, context: SetupContext) -> None:
        generator, train_data = context.generator, context.train_data
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer
        from opacus.validators import ModuleValidator

        self.close()
        modes = [(m, m.training) for m in model.modules()]
        model.train()  # Opacus validates a model in train mode (the mode its hooks record in)
        try:
            errors = ModuleValidator.validate(model, strict=False)
        finally:
            for m, mode in modes:
                m.train(mode)
        if errors:
            raise ValueError(
                "Opacus cannot compute per-sample gradients of this model: "
                + "; ".join(dict.fromkeys(str(e) for e in errors))  # one per kind, not one per layer
                + " (opacus.validators.ModuleValidator.fix replaces BatchNorm with GroupNorm)"
            )
        self._train_size = len(train_data) if train_data is not None else None  # type: ignore[arg-type]
        if self.config.sample_rate is None and self._train_size is None:
            raise ValueError(
                "dp_sgd needs the number of samples local training draws from to account (q = B / N): "
                "pass the training data (train_data) or set sample_rate"
            )
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("dp_sgd: the model has no trainable parameter")
        layers = _parametrised(model)
        self._handles = [model.register_forward_pre_hook(self._before_forward(layers), with_kwargs=True)]
        self._handles += [
            m.register_forward_pre_hook(self._per_sample_input) for m in layers if isinstance(m, nn.Embedding)
        ]
        self._gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=True)
        self._handles.append(model.register_forward_hook(lambda *_: self._restore()))  # after Opacus' hooks
        self._optimizer = DPOptimizer(
            torch.optim.SGD(self._params, lr=0.0),  # holds the parameters; the client's optimizer steps
            noise_multiplier=0.0,  # set at the first step, when q is known
            max_grad_norm=self.config.clip,
            expected_batch_size=1,
            loss_reduction="mean",
            generator=generator_on(module_device(model), generator),  # Opacus draws where the grads are
            secure_mode=self.config.secure_mode,
        )
        self.sigma, self.sample_rate, self.steps, self._batch_of_step = None, None, 0, 1

    def _first_step(self, batch: int) -> None:
        cfg = self.config
        n = self._train_size
        self.sample_rate = cfg.sample_rate if cfg.sample_rate is not None else min(1.0, batch / n)  # type: ignore[operator]
        if cfg.target_epsilon is not None:
            assert cfg.budget_steps is not None  # DPSGDConfig requires it with a target
            self.sigma = noise_multiplier_for(
                cfg.target_epsilon, cfg.delta, self.sample_rate, cfg.budget_steps, cfg.accountant
            )
        else:
            self.sigma = (
                cfg.noise_multiplier if cfg.noise_multiplier is not None else DEFAULT_NOISE_MULTIPLIER
            )
        self._optimizer.noise_multiplier = self.sigma

    def _before_forward(self, layers: list[nn.Module]) -> Any:
        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            """Before a forward pass: the batch size, and the parametrised layers in train mode, so that
            Opacus' hooks record them."""
            first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
            self._batch = None if first is None else int(first.shape[0])
            self._modes = [(m, m.training) for m in layers]
            for m in layers:
                m.train()

        return hook

    def _per_sample_input(self, _: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """An embedding looked up with one index row for the whole batch (transformers' position ids,
        shape [1, T]) gets it repeated per sample, so that its per-sample gradients are per sample (the
        output broadcasts as before, so the forward pass is unchanged)."""
        ids, b = args[0], self._batch
        if isinstance(ids, torch.Tensor) and ids.dim() > 1 and ids.shape[0] == 1 and b is not None and b > 1:
            return (ids.expand(b, *ids.shape[1:]), *args[1:])
        return None

    def _restore(self) -> None:
        for m, mode in self._modes:
            m.train(mode)
        self._modes = []

    @torch.no_grad()
    def on_gradients(self, model: nn.Module, step: int) -> None:
        if self._optimizer is None:
            raise RuntimeError("dp_sgd needs setup() before on_gradients()")
        samples: list[Any] = [g for p in self._params if (g := getattr(p, "grad_sample", None)) is not None]
        if not samples:
            raise RuntimeError(
                "no per-sample gradient was recorded: the backward pass did not run through the model's "
                "modules in train mode"
            )
        batch = len(samples[0] if isinstance(samples[0], torch.Tensor) else samples[0][0])
        for p in self._params:  # a parameter the batch did not reach: its per-sample gradients are zero
            if getattr(p, "grad_sample", None) is None:
                p.grad_sample = torch.zeros((batch, *p.shape), dtype=p.dtype, device=p.device)  # type: ignore[attr-defined]
        if self.sigma is None:
            self._first_step(batch)
        budget = self.config.budget_steps
        if budget is not None and self.steps >= budget:
            raise RuntimeError(
                f"dp_sgd: step {self.steps + 1} goes past budget_steps={budget}: the privacy budget is spent"
            )
        self._optimizer.expected_batch_size = batch  # the mean over this batch (post-processing)
        self._batch_of_step = batch
        self._optimizer.pre_step()  # Opacus: per-sample clip, sum, noise sigma*C, divide by B -> p.grad
        for p in self._params:  # Opacus' per-step buffers, consumed
            p.grad_sample = None  # type: ignore[attr-defined]
            p.summed_grad = None  # type: ignore[attr-defined]
        self.steps += 1

    def spent(self) -> float:
        """Epsilon at ``config.delta`` of this local training run so far."""
        if self.sigma is None or self.sample_rate is None:
            return 0.0
        return epsilon(self.sigma, self.sample_rate, self.steps, self.config.delta, self.config.accountant)

    def on_update(self, update: Update) -> Update:
        if self.steps == 0:
            raise RuntimeError("dp_sgd: no step was taken under DP-SGD; nothing to send")
        meta = {
            f"{META}epsilon": self.spent(),
            f"{META}delta": self.config.delta,
            f"{META}steps": self.steps,
            f"{META}sample_rate": self.sample_rate,
            f"{META}noise_multiplier": self.sigma,
            f"{META}clip": self.config.clip,
            f"{META}accountant": self.config.accountant,  # composing releases uses the same accountant
        }
        if update.kind == "gradient" and self.steps == 1 and self.sigma is not None:
            # a FedSGD gradient: the noise is N(0, (sigma C / B)^2) per entry
            meta[f"{META}{NOISE_STD}"] = self.sigma * self.config.clip / self._batch_of_step
        self.close()
        return Update(update.tensors, update.num_samples, update.kind, {**update.metadata, **meta})

    def close(self) -> None:
        """Remove Opacus' hooks and attributes and this defense's mode hooks (after the update is sent)."""
        if self._gsm is not None:
            self._gsm._close()
            self._gsm = None
        for h in self._handles:
            h.remove()
        self._handles = []
        self._restore()


DEFENSES.register(
    "dp_sgd",
    DPSGD,
    config_cls=DPSGDConfig,
    summary="DP-SGD via Opacus: per-sample clip C, noise sigma*C, epsilon at delta from its accountant",
)
