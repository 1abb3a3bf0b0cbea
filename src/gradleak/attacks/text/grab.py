"""GRAB, as far as its method can be read here: embedding matching that learns the client's dropout masks,
alternating with a discrete search of the token order.

Wang, Bai, Abuadbba, Ma, Feng, Ma and Chegne, "Uncovering Gradient Inversion Risks in Practical Language
Model Training" (Grab, arXiv 2507.21198, CCS). Paper 002 compares AEGIS with it (Figure 2: R-1 0.533 ->
0.463 on WikiText-2 and 0.660 -> 0.283 on Rotten Tomatoes under AEGIS, "the lone partial-degrade case") and
says its code is BSD-3; that code and the paper's method section are not available offline, so this module
follows the two descriptions that are, and every choice they leave open is a parameter. **It is our reading,
not a reproduction.**

- The abstract: "two alternating optimization processes to address the challenges caused by practical
  training settings, including a simultaneous optimization on dropout masks between layers for improved
  token recovery and a discrete optimization for effective token sequencing"; it beats "discrete
  optimization with an auxiliary model" (LAMP with its language-model prior) without one.
- Paper 002: GRAB "recovers tokens by iteratively minimising gradient distance without requiring the SVD
  subspace signal".

Here:

- **Continuous process**: LAMP's embedding matching (:mod:`~gradleak.attacks.text.embedding_match`: the
  mean per-parameter cosine distance, the norm term, the best of many starts, Adam), without a prior. Where
  the client computed its update with dropout on (``Observation.mode == "train"``), the attacker's copy runs
  in eval mode and every dropout module the forward calls (embeddings, attention output, feed-forward
  output, classifier; p > 0) multiplies its output by a mask of the output's shape, learned by the same Adam
  at ``mask_lr`` (``dropout_masks``): the Dropout Inversion Attack's joint optimisation of data and masks
  (Scheliga et al., AAAI 2023), which GRAB takes to language models. A mask is sigmoid(z) / (1 - p), so it
  stays in the client's range [0, 1 / (1 - p)], from z = logit(1 - p): the expectation 1, the eval-mode
  copy. Unbounded masks absorbed the gradient (the distance fell below its value at the truth while the
  masks moved no closer to the client's). On the tested BERT only the classifier's mask (64 entries) is
  identified; the inner ones (B T d entries each) are not, and what beats LAMP there is the eval-mode copy
  itself (docs/attacks-text.md). The attention probabilities' dropout, which the transformers
  attention kernels apply as a function and not through the module, is not modelled: the copy runs it
  off. With dropout off (eval-mode updates) there is nothing to learn and none is installed.
- **Discrete process**: every ``swap_every`` steps after ``swap_burnin``, each sequence's best reordering
  among every single token moved to every other position ((n - 1)^2 distinct moves, adjacent swaps once),
  by the distance: an exhaustive search of one kind of move, where LAMP samples ``swap_tries`` moves of
  four kinds (swaps of any two positions, moved spans and rotations too); ``swap_tries`` is not read.

The two processes alternate as LAMP's optimisation and moves do; the defaults are LAMP's (``lamp_cos.sh``)
with the prior off. Cost per discrete step: (n - 1)^2 + 1 gradient evaluations a sequence. The reported
``matching_loss`` scores the best embeddings under the masks of the last step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradleak.attacks.text.embedding_match import EmbeddingMatch, Inversion, LampConfig
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation, Reconstruction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrabConfig(LampConfig):
    """LAMP's options (:class:`~gradleak.attacks.text.embedding_match.LampConfig`) without its prior, plus
    ``dropout_masks`` (learn the client's dropout masks where it trained with dropout) and ``mask_lr``
    (their Adam learning rate; ours)."""

    prior_weight: float = 0.0
    dropout_masks: bool = True
    mask_lr: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.dropout_masks, bool):
            raise ValueError(f"dropout_masks must be true or false, got {self.dropout_masks!r}")
        if isinstance(self.mask_lr, bool) or not 0 < self.mask_lr < float("inf"):
            raise ValueError(f"mask_lr must be a finite number > 0, got {self.mask_lr!r}")


class DropoutMasks:
    """Forward hooks that multiply the output of each dropout module of ``model`` with p > 0 by a learned
    mask sigmoid(z) / (1 - p) (module docstring), its logits ``z`` made at the module's first call in the
    output's shape at logit(1 - p) (the mask 1), then fixed: a later call in another shape is an error. The
    model runs in eval mode, so the modules themselves pass their input through."""

    def __init__(self, model: nn.Module) -> None:
        self.logits: dict[str, torch.Tensor] = {}
        self.modules = {n: m for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0}
        for name, module in self.modules.items():
            module.register_forward_hook(self._hook(name))

    def mask(self, name: str) -> torch.Tensor:
        """The mask of dropout module ``name`` as the forward applies it."""
        return torch.sigmoid(self.logits[name]) / (1 - self.modules[name].p)

    def _hook(self, name: str) -> Any:
        def apply(_module: nn.Module, _args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            z = self.logits.get(name)
            if z is None:
                start = float(torch.logit(torch.tensor(1 - self.modules[name].p)))
                z = self.logits[name] = torch.full_like(out, start, dtype=torch.float32).requires_grad_(True)
            if z.shape != out.shape:
                raise AttackInputError(
                    f"dropout {name!r}: a mask of shape {tuple(z.shape)} for an output of {tuple(out.shape)}"
                )
            return out * self.mask(name).to(out.dtype)

        return apply

    def set(self, values: dict[str, torch.Tensor], eps: float = 1e-6) -> None:
        """Put the masks ``values`` (by module name, each in [0, 1 / (1 - p)]) into the logits, within
        ``eps`` of the range's ends (the client's own masks, in tests)."""
        with torch.no_grad():
            for name, value in values.items():
                keep = (value * (1 - self.modules[name].p)).clamp(eps, 1 - eps)
                self.logits[name].copy_(torch.logit(keep))


class Grab(EmbeddingMatch):
    """GRAB as read here (module docstring)."""

    def __init__(self, config: GrabConfig | None = None) -> None:
        super().__init__(config or GrabConfig())
        self.masks: DropoutMasks | None = None

    def problem(self, obs: Observation) -> tuple[Inversion, torch.Tensor, torch.Tensor, int, int | None]:
        self.masks = None
        problem, table, vocab, t, read = super().problem(obs)
        c = self.config
        if isinstance(c, GrabConfig) and c.dropout_masks and obs.mode == "train":
            problem.model.eval()
            masks = DropoutMasks(problem.model)
            if masks.modules:
                shape = (obs.update.num_samples, t, table.shape[1])
                with torch.no_grad():  # one forward makes the masks in the batch's shapes
                    problem.loss(problem.model, torch.zeros(shape, dtype=table.dtype, device=table.device))
                problem.variables = [{"params": list(masks.logits.values()), "lr": c.mask_lr}]
                self.masks = masks
        return problem, table, vocab, t, read

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        rec = super().reconstruct(obs, generator=generator)
        rec.stats["dropout_masks"] = float(len(self.masks.logits) if self.masks is not None else 0)
        return rec

    def _moves(self, tokens: int, generator: torch.Generator) -> list[torch.Tensor]:
        """Every single token moved to every other position (the identity first)."""
        seen = {tuple(range(tokens))}
        out = [torch.arange(tokens)]
        for i in range(tokens):
            for j in range(tokens):
                p = list(range(tokens))
                p.insert(j, p.pop(i))
                if tuple(p) not in seen:  # moving i to i + 1 is moving i + 1 to i
                    seen.add(tuple(p))
                    out.append(torch.tensor(p))
        return out


ATTACKS.register(
    "grab",
    Grab,
    config_cls=GrabConfig,
    summary="GRAB as read here: embedding matching with learned dropout masks, exhaustive token moves",
    modality="text",
)
