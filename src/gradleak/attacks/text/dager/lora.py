"""DAGER on LoRA adapter updates: the span test on the adapters' ``A`` gradients.

A LoRA layer computes ``W x + s B A x`` (``s = alpha / r``; :mod:`gradleak.models.adapters`) with ``W``
frozen, so a client's update carries only ``dL/dA`` and ``dL/dB``. For the tokens ``x_t`` entering a block's
attention projection with output gradients ``delta_t``,

    dL/dA = s sum_t (B^T delta_t) x_t^T,        dL/dB = s sum_t delta_t (A x_t)^T,

so the rows of ``dL/dA`` lie in the span of the block's inputs ``x_t`` (side ``"A"``), and the columns of
``(dL/dB)^T`` in the span of their projections ``A x_t`` (side ``"B"``: a candidate input ``z`` is tested as
``A z``, :class:`~gradleak.attacks.text.family.ProjectedSpan`, in ``r`` dimensions; the one side that reads a
fresh adapter, whose ``B`` is zero). On side A, ``(dL/dA)^T`` plays the part of
DAGER's attention weight gradient (Petrov et al., "DAGER: Exact Gradient Inversion for Large Language Models",
NeurIPS 2024, Sec. 4; its LoRA section), and the rest of DAGER (the layer-1 token test, the layer-2 search)
runs unchanged on the frozen model. What it needs, stated as its threat model: an honest-but-curious server
that sees one client's adapter update (FedSGD, or a FedAvg delta read as DAGER's FedAvg variant reads it);

- side A needs ``B != 0``: peft starts ``B`` at zero, so ``dL/dA = 0`` on a fresh adapter's first step;
  ``side = "auto"`` (the default) reads side B then, side A once ``B`` has trained;
- ``r`` at least the batch's distinct (token, position) count, and the ``B^T delta_t`` independent: the
  span of ``dL/dA`` has rank at most ``r`` (DAGER's official LoRA runs use r = 256); below it the span
  is a subspace of the inputs' and the test rejects true tokens (the record's ``rank_l1`` says which);
- the attention projections of blocks 1 and 2 adapted (``target`` includes ``attention``).

**FedAvg.** A client's ``T`` local steps sum ``T`` such gradients, each at the weights of its step. Block 1's
inputs do not move (the embeddings are frozen), so the rows of ``delta A`` still lie in their span exactly;
block 2's inputs move with block 1's adapters, so its span holds each step's version of them (its rank
grows with the steps, and ``r`` caps it) and, as in DAGER's FedAvg variant, candidates are evaluated at the
midpoint weights ``w_0 + delta / 2`` against a relaxed threshold (``dager_lora_fedavg``). Where it stops
(tests/text/test_lora.py; docs/lora.md for SmolLM2): larger steps (lr 5e-2 over two batches on the GPT-2
arch: nothing), more steps than ``r`` has room for, and two or three steps on SmolLM2 (ROUGE-1 0.13-0.18).
One plain SGD step is the gradient times ``-lr`` and is read exactly. Side selection reads the broadcast
model: a ``B`` still zero there (a fresh adapter) means side B even when a FedAvg delta's ``A`` part is
nonzero.

A causal LM's last token is only a label: DAGER reads it off the LM head's gradient, which a LoRA update
does not carry. ``complete_from_adapters`` (off by default: it works on the GPT-2 arch with random weights,
not yet on SmolLM2) reads it off the adapters' gradient instead, for a FedSGD update
(:mod:`~gradleak.attacks.text.dager.lora_completion`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from gradleak.attacks.text.dager.core import Dager, DagerConfig, DecoderSearch
from gradleak.attacks.text.dager.lora_completion import complete_from_adapters
from gradleak.attacks.text.family import (
    FULL_SPAN_FRACTION,
    FamilySpec,
    ProjectedSpan,
    Span,
    estimate_span,
    find_module,
    lora_weights,
    update_tensor,
)
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation, Reconstruction
from gradleak.update import DEFAULT_BATCHING


@dataclass(frozen=True)
class DagerLoRAConfig(DagerConfig):
    """DAGER's options; the decoder's last-token completion and prefix sentences off (they read the LM
    head's gradient, which a LoRA update does not carry)."""

    decoder: DecoderSearch = field(
        default_factory=lambda: DecoderSearch(complete_last_token=False, prefix_sentences=False)
    )
    side: str = "auto"  # "A", "B", or "auto": B when A's gradient is zero (a fresh adapter), else A
    # a causal LM's last tokens from the adapters' gradient (FedSGD): off by default, it reads the GPT-2 arch
    # (random weights) exactly but not SmolLM2 (lora_completion's module docstring)
    complete_from_adapters: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.side not in ("auto", "A", "B"):
            raise ValueError(f"side must be 'auto', 'A' or 'B', got {self.side!r}")


@dataclass(frozen=True)
class DagerLoRAFedAvgConfig(DagerLoRAConfig):
    """DAGER on a LoRA FedAvg delta (module docstring, "FedAvg"): candidates at the midpoint weights, the
    layer-2 threshold relaxed as ``dager_fedavg``'s, and the layer-1 threshold 0.01: the layer-1 inputs do
    not move (the embeddings are frozen), but ``w_T - w_0`` of small steps loses digits to float32
    cancellation. Chosen on the GPT-2 arch (tests/text/test_lora.py): 0.01 recovered every sentence of
    the trained-``B`` cases at lr 1e-2 where the exact 1e-3 missed some."""

    l1_threshold: float | None = 0.01
    l2_threshold: float | None = 0.1
    midpoint_weights: bool = True


class DagerLoRA(Dager):
    """DAGER whose spans come from the adapters' ``A`` gradients (module docstring)."""

    peelable = False  # its spans are the adapters' (peeling is measured on DAGER's own spans only)

    zero_gradient = (
        "the first block's LoRA gradient on this side is zero (side A with B still zero, a fresh adapter: "
        "dL/dA = B^T delta x^T vanishes; read side B, or an update from a later round)"
    )

    config: DagerLoRAConfig

    def complete(
        self, obs: Observation, model: nn.Module, spec: FamilySpec, seqs: list[list[int]], batch: int
    ) -> tuple[list[list[int]], int]:
        """A causal LM's sequences with their last tokens read off the adapters' gradient."""
        if self.config.complete_from_adapters and spec.causal:
            return complete_from_adapters(obs, model, seqs), 0
        return seqs, 0

    def _lora(self, obs: Observation, name: str, which: str) -> str:
        keys = lora_weights(obs.update.tensors, name, which)
        if len(keys) != 1:
            raise AttackInputError(
                f"the update carries no single LoRA {which} of {name!r} ({keys}): is the attention adapted?"
            )
        return keys[0]

    def side(self, obs: Observation, model: nn.Module, spec: FamilySpec) -> str:
        """The side to read (module docstring). B where block 1's ``B`` is zero in the broadcast model (a
        fresh adapter: a FedSGD ``dL/dA`` vanishes; a FedAvg delta's A part comes only from steps after the
        first, through a ``B`` a few small steps old). Otherwise both block-1 ranks are estimated: on an
        exact gradient they agree (each counts the batch's distinct inputs) and A is read, its test running
        in the full input space; where side B's span is usable (not full in its r dimensions) and they
        disagree, A's is the wrong one and B is read: smaller, the delta's A part went through a ``B`` so
        small that it holds few directions (rank 1 against 11 in the tests); larger, float32 cancellation
        noise in ``w_T - w_0`` (SmolLM2, an adapter one round old: 311 over q, k, v against B's 142). Where
        the tokens outnumber r, side B is full and A is read."""
        if self.config.side != "auto":
            return self.config.side
        first, _ = find_module(model, spec.attn_inputs[0].format(i=0))
        last, _ = find_module(model, spec.attn_inputs[-1].format(i=0))  # side B reads the last projection
        fresh = float(obs.model.get_parameter(self._lora(obs, first, "B")).detach().abs().max()) == 0.0
        if fresh or float(update_tensor(obs, self._lora(obs, first, "A")).abs().max()) == 0.0:
            return "B"
        grad_a = self._a_gradient(obs, model, spec, 0)  # what side A reads: (d_in, m r)
        rank_a = estimate_span(grad_a, spec.rank_tol).rank
        grad_b = update_tensor(obs, self._lora(obs, last, "B")).T  # (r, d_out): spans A x_t in r dimensions
        rank_b = estimate_span(grad_b, spec.rank_tol).rank
        usable_b = 0 < rank_b < FULL_SPAN_FRACTION * grad_b.shape[0]
        return "B" if usable_b and rank_b != rank_a else "A"

    def _a_gradient(self, obs: Observation, model: nn.Module, spec: FamilySpec, layer: int) -> torch.Tensor:
        """Side A's matrix of block ``layer``: every attention projection's ``A`` gradient, transposed and
        side by side (d_in, m r); its column space is in the span of the block's inputs."""
        cols = []
        for suffix in spec.attn_inputs:
            name, _ = find_module(model, suffix.format(i=layer))
            cols.append(update_tensor(obs, self._lora(obs, name, "A")).T)
        return torch.cat(cols, dim=1)

    def input_gradient(
        self, obs: Observation, model: nn.Module, spec: FamilySpec, layer: int
    ) -> torch.Tensor:
        if layer == 0:
            self._side, self._projections = self.side(obs, model, spec), {}
        if self._side == "A":
            return self._a_gradient(obs, model, spec, layer)
        # side B: the block's last attention projection (GPT-2's fused c_attn, Llama's v_proj, BERT's value):
        # its B gradient's columns span A x_t in r dimensions. Not the query: under causal attention the
        # first token's query gets no gradient (a softmax over one key), so its span misses tokens.
        name, _ = find_module(model, spec.attn_inputs[-1].format(i=layer))
        weight = dict(model.named_parameters())[self._lora(obs, name, "A")]
        self._projections[layer] = weight.detach().to(torch.float64)
        return update_tensor(obs, self._lora(obs, name, "B")).T  # (r, d_out)

    def spans(
        self, obs: Observation, spec: FamilySpec, grad1: torch.Tensor, grad2: torch.Tensor
    ) -> tuple[Span, Span, FamilySpec, dict[str, float]]:
        span1, span2, spec, stats = super().spans(obs, spec, grad1, grad2)
        if self._side == "B":
            span1 = ProjectedSpan.of(span1, self._projections[0])
            span2 = ProjectedSpan.of(span2, self._projections[1])
        return span1, span2, spec, {**stats, "side_b": float(self._side == "B")}


def one_sgd_step(obs: Observation) -> bool:
    """Whether the public recipe says a FedAvg delta is one plain SGD step: exactly ``-lr`` times the
    gradient at the broadcast weights ``w_0``."""
    tr = obs.training
    return (
        tr is not None
        and (tr.optimizer, tr.momentum, tr.weight_decay, tr.batching) == ("sgd", 0, 0, DEFAULT_BATCHING)
        and tr.steps(obs.update.num_samples) == 1
    )


class DagerLoRAFedAvg(DagerLoRA):
    """DAGER on a LoRA FedAvg delta; a delta the public recipe says is one plain SGD step is exactly
    ``-lr`` times the gradient at ``w_0``, so it is read with exact DAGER's settings (the family's
    thresholds, the broadcast weights; thresholds set in the config are for the multi-step case). SmolLM2
    at r = 256, B = 8, one step at lr 1e-3 gave ROUGE-1 0.14 in 170 s with the FedAvg settings, 1.000 in
    3.5 s with the exact ones (benchmarks/configs/lora_fedavg.toml)."""

    def __init__(self, config: DagerLoRAFedAvgConfig | None = None) -> None:
        super().__init__(config or DagerLoRAFedAvgConfig())

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        if not one_sgd_step(obs):
            return super().reconstruct(obs, generator=generator)
        exact = replace(self.config, l1_threshold=None, l2_threshold=None, midpoint_weights=False)
        rec = DagerLoRA(exact).reconstruct(obs, generator=generator)
        return replace(rec, stats={**rec.stats, "one_step": 1.0})


ATTACKS.register(
    "dager_lora",
    DagerLoRA,
    config_cls=DagerLoRAConfig,
    summary="DAGER on LoRA adapter updates: spans from the adapters' A gradients (needs B != 0, r >= tokens)",
    modality="text",
)
ATTACKS.register(
    "dager_lora_fedavg",
    DagerLoRAFedAvg,
    config_cls=DagerLoRAFedAvgConfig,
    summary="DAGER on a LoRA FedAvg delta: midpoint weights, relaxed thresholds (a few small local steps)",
    modality="text",
)

__all__ = ["DagerLoRA", "DagerLoRAConfig", "DagerLoRAFedAvg", "DagerLoRAFedAvgConfig", "one_sgd_step"]
