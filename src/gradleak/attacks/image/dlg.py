"""DLG: Deep Leakage from Gradients (Zhu, Liu & Han, NeurIPS 2019), with iDLG labels (Zhao et al. 2020).

DLG fits a dummy batch X' and dummy soft labels Y' (logits, softmax) jointly so that the dummy gradient
matches the observed one in Euclidean distance (DLG, Eq. 4):

    min_{X', Y'}  || grad_w l(f_w(X'), softmax(Y')) - g* ||^2,

with L-BFGS (lr 1) from X' ~ N(0, 1). ``labels = "idlg"`` fixes Y to the labels recovered from the output
layer's update (iDLG: exact for one image) and optimises X' alone; labels granted by the threat model are
always used as given. DLG is a single-step attack: on a FedAvg delta (paper 001, Eq. 1-2) it matches the
mean gradient ``g_bar = (w_0 - w_T) / (lr T)``, which needs the public recipe (lr, epochs, batch size) since
the Euclidean distance is not scale free.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from gradleak.attacks.checks import require_image_input
from gradleak.attacks.image.labels import recover_label_counts, recover_labels
from gradleak.attacks.image.surrogate import local_steps
from gradleak.device import DEVICE_TYPES, normal
from gradleak.progress import bar
from gradleak.registry import ATTACKS
from gradleak.tasks.losses import criterion
from gradleak.types import AttackInputError, Observation, Reconstruction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DLGConfig:
    """DLG's settings (Zhu et al. 2019, and its official code): L-BFGS at lr 1 for 300 steps of torch's
    default 20 evaluations, soft labels optimised jointly (``labels="idlg"``: iDLG's recovered labels)."""

    max_iterations: int = 300  # L-BFGS steps (DLG: 300)
    lbfgs_max_iter: int = 20  # function evaluations per step (torch's default, as in DLG's code)
    lr: float = 1.0
    history_size: int = 100
    labels: str = "joint"  # "joint" (DLG: optimise soft labels) or "idlg" (recover, then fix)
    num_samples: int | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        if self.max_iterations < 1 or self.lbfgs_max_iter < 1 or self.history_size < 1:
            raise ValueError("max_iterations, lbfgs_max_iter and history_size must be >= 1")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.labels not in ("joint", "idlg"):
            raise ValueError(f"labels must be 'joint' or 'idlg', got {self.labels!r}")
        if self.num_samples is not None and self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")


def gradient_target(obs: Observation, params: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
    """The gradient to match: the FedSGD gradient, or a FedAvg delta's mean gradient (w_0 - w_T)/(lr T)."""
    if obs.update.kind == "gradient":
        scale = 1.0
    else:
        steps = local_steps(obs, "dlg")
        assert obs.training is not None
        scale = -1.0 / (obs.training.lr * steps)
    return [scale * obs.update.tensors[n].detach().to(p.dtype) for n, p in params]


class DLG:
    """Euclidean gradient matching with L-BFGS and joint (or iDLG) labels."""

    def __init__(self, config: DLGConfig | None = None) -> None:
        self.config = config or DLGConfig()

    def _fixed_labels(self, obs: Observation, n: int) -> torch.Tensor | None:
        if obs.labels is not None:
            return obs.labels.clone().to(torch.long)
        if self.config.labels == "joint":
            return None
        if obs.update.kind == "delta" and obs.training is not None and obs.training.protocol == "fedavg":
            return recover_label_counts(obs, n, lr=obs.training.lr, steps=local_steps(obs, "dlg"))
        return recover_labels(obs, n)

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        require_image_input(obs)
        cfg = self.config
        n = cfg.num_samples or (len(obs.labels) if obs.labels is not None else obs.update.num_samples)
        if n < 1:
            raise AttackInputError("cannot tell the batch size: the update reports 0 samples")
        model = obs.client_model()
        params = [(name, p) for name, p in model.named_parameters() if name in obs.update.tensors]
        if not params:
            raise AttackInputError("the update carries none of the model's parameters")
        target = gradient_target(obs, params)
        fixed = self._fixed_labels(obs, n)
        if fixed is not None and len(fixed) != n:
            raise AttackInputError(
                f"the observation grants {len(fixed)} labels but the attack reconstructs {n} images"
            )
        like = target[0]  # draws on the CPU, moved where the model is (gradleak.device)
        x = normal((n, *obs.input_shape), generator, like).requires_grad_(True)
        y = normal((n, obs.num_classes), generator, like).requires_grad_(True)
        fixed = None if fixed is None else fixed.to(like.device)
        variables = [x] if fixed is not None else [x, y]
        opt = torch.optim.LBFGS(
            variables, lr=cfg.lr, max_iter=cfg.lbfgs_max_iter, history_size=cfg.history_size
        )
        plist = [p for _, p in params]

        loss_of = criterion(obs.training)  # the client's loss (the recipe's; cross-entropy by default)

        def objective() -> torch.Tensor:
            out = model(x)
            # DLG's soft labels where none are granted: the loss at the probabilities softmax(y)
            loss = loss_of(out, fixed if fixed is not None else F.softmax(y, dim=-1))
            grads = torch.autograd.grad(loss, plist, create_graph=True)
            return sum(((g - t) ** 2).sum() for g, t in zip(grads, target, strict=True))  # type: ignore[return-value]

        def closure() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            d = objective()
            d.backward()
            return d

        start = time.perf_counter()
        best = (math.inf, x.detach().clone(), y.detach().clone())
        done = 0
        for _ in bar(range(cfg.max_iterations), desc="DLG", force=cfg.progress):
            loss = float(opt.step(closure).detach())
            done += 1
            if not math.isfinite(loss):
                log.warning(
                    "DLG diverged (non-finite loss) after %d L-BFGS steps; keeping the best iterate", done
                )
                break
            if loss < best[0]:
                best = (loss, x.detach().clone(), y.detach().clone())
            if loss == 0.0:
                break
        with torch.no_grad():
            x.copy_(best[1])
            y.copy_(best[2])
        final = float(objective().detach())
        labels = fixed if fixed is not None else best[2].argmax(dim=-1).sort().values
        order = torch.arange(n, device=like.device) if fixed is not None else best[2].argmax(dim=-1).argsort()
        images = best[1][order].clamp(0, 1)
        stats = {
            "iterations": float(done),
            "seconds": time.perf_counter() - start,
            "matching_loss": final,
        }
        return Reconstruction(images=images, labels=labels.clone(), stats=stats)


ATTACKS.register(
    "dlg",
    DLG,
    config_cls=DLGConfig,
    summary="DLG: Euclidean matching, L-BFGS, joint label optimisation (Zhu 2019); labels='idlg' for iDLG",
    modality="image",
    devices=DEVICE_TYPES,
)
