"""DAGER on LoRA adapter updates: the span test on the adapters' ``A`` gradients.

A LoRA layer computes ``W x + s B A x`` (``s = alpha / r``; :mod:`gradleak.text.adapters`) with ``W``
frozen, so a client's update carries only ``dL/dA`` and ``dL/dB``. For the tokens ``x_t`` entering a block's
attention projection with output gradients ``delta_t``,

    dL/dA = s sum_t (B^T delta_t) x_t^T,        dL/dB = s sum_t delta_t (A x_t)^T,

so the rows of ``dL/dA`` lie in the span of the block's inputs ``x_t``: ``(dL/dA)^T`` plays the part of
DAGER's attention weight gradient (Petrov et al., "DAGER: Exact Gradient Inversion for Large Language Models",
NeurIPS 2024, Sec. 4; its LoRA section), and the rest of DAGER (the layer-1 token test, the layer-2 search)
runs unchanged on the frozen model. What it needs, stated as its threat model: an honest-but-curious server
that sees one client's adapter update (FedSGD, or a FedAvg delta read as DAGER's FedAvg variant reads it);

- ``B != 0``: peft starts ``B`` at zero, so ``dL/dA = 0`` on a fresh adapter's first step (refused, saying
  so); from the second round on ``B`` has trained;
- ``r`` at least the batch's distinct (token, position) count, and the ``B^T delta_t`` independent: the
  span of ``dL/dA`` has rank at most ``r`` (DAGER's official LoRA runs use r = 256); below it the span
  is a subspace of the inputs' and the test rejects true tokens (the record's ``rank_l1`` says which);
- the attention projections of blocks 1 and 2 adapted (``target`` includes ``attention``).

A causal LM's last token is out of reach: DAGER reads it off the LM head's (embedding's) gradient, which a
LoRA update does not carry, so the decoder's last-token completion is off by default
(:class:`DagerLoRAConfig`); the recovered sequences lack their last token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from gradleak.attacks.text.dager import Dager, DagerConfig, DecoderSearch
from gradleak.attacks.text.family import FamilySpec, find_module, update_tensor
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation


@dataclass(frozen=True)
class DagerLoRAConfig(DagerConfig):
    """DAGER's options; the decoder's last-token completion and prefix sentences off (they read the LM
    head's gradient, which a LoRA update does not carry)."""

    decoder: DecoderSearch = field(
        default_factory=lambda: DecoderSearch(complete_last_token=False, prefix_sentences=False)
    )


class DagerLoRA(Dager):
    """DAGER whose spans come from the adapters' ``A`` gradients (module docstring)."""

    zero_gradient = (
        "the first block's LoRA A gradient is zero: B is still zero (a fresh adapter's first step), so "
        "dL/dA = B^T delta x^T vanishes; attack an update from a later round"
    )

    def input_gradient(
        self, obs: Observation, model: nn.Module, spec: FamilySpec, layer: int
    ) -> torch.Tensor:
        cols = []
        for suffix in spec.attn_inputs:
            name, _ = find_module(model, suffix.format(i=layer))
            keys = [
                k for k in obs.update.tensors if k.startswith(f"{name}.lora_A.") and k.endswith(".weight")
            ]
            if len(keys) != 1:
                raise AttackInputError(
                    f"the update carries no single LoRA A of {name!r} ({keys}): is the attention adapted?"
                )
            cols.append(update_tensor(obs, keys[0]).T)  # (d_in, r): its columns span the block's inputs
        return torch.cat(cols, dim=1)


ATTACKS.register(
    "dager_lora",
    DagerLoRA,
    config_cls=DagerLoRAConfig,
    summary="DAGER on LoRA adapter updates: spans from the adapters' A gradients (needs B != 0, r >= tokens)",
    modality="text",
)

__all__ = ["DagerLoRA", "DagerLoRAConfig"]
