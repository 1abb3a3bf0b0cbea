"""Adaptive MLP-SVD probe (paper 002, Sec. IV-D "Channel 3" and Sec. VI-C).

The first MLP projection of block 1 (GPT-2 ``c_fc``; Llama ``gate_proj``/``up_proj``; BERT
``intermediate.dense``) has gradient sum_t delta_t u_t^T with u_t = LN_2(h_t) the MLP input, so DAGER's SVD
span estimate applies to it unchanged. Unlike the attention input, u_t depends on the context through
block 1's attention; the probe scores each vocabulary token v by the residual of its *context-free* MLP
input (v alone at position p, attending to itself; exact for each sequence's first token in a decoder) at
the first ``positions`` positions (rotary models: position-free), keeps the minimum over positions, and
returns the ``rank``-many lowest-residual tokens (``select="rank"``: the span dimension estimates the
number of distinct inputs) or those below ``threshold``. The result is an unordered token set.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from gradleak.attacks.text.family import (
    FamilySpec,
    Span,
    estimate_span,
    family_of,
    find_module,
    input_side_gradient,
    layer_inputs,
    vocab_size,
)
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation, Reconstruction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MLPSVDConfig:
    """``positions`` scanned per token (4: our choice; paper 002 does not give it, and the context-free input
    is exact only at the first), ``select`` ``"rank"`` (the span dimension estimates the number of distinct
    inputs: no threshold to tune, the default) or ``"threshold"`` (residual below ``threshold``, 0.2: our
    choice), ``rank_tol`` (None: the family's, as DAGER's), ``chunk`` (tokens scored at once: memory)."""

    positions: int = 4
    select: str = "rank"  # "rank" or "threshold"
    threshold: float = 0.2
    rank_tol: float | None = None  # default: the family's
    chunk: int = 2048

    def __post_init__(self) -> None:
        if self.positions < 1 or self.chunk < 1:
            raise ValueError("positions and chunk must be >= 1")
        if self.select not in ("rank", "threshold"):
            raise ValueError(f"select must be 'rank' or 'threshold', got {self.select!r}")
        if not 0 < self.threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")
        if self.rank_tol is not None and not 0 < self.rank_tol < 1:
            raise ValueError(f"rank_tol must be in (0, 1), got {self.rank_tol}")


class MLPSVD:
    """Token set from the span of block 1's MLP-expansion gradient (module docstring)."""

    def __init__(self, config: MLPSVDConfig | None = None) -> None:
        self.config = config or MLPSVDConfig()

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        start = time.perf_counter()
        model = obs.client_model()
        spec = family_of(model)
        grad = input_side_gradient(obs, model, spec.mlp_inputs, 0)
        if float(grad.abs().max()) == 0.0:
            raise AttackInputError("the first block's MLP-expansion gradient is zero (frozen or masked)")
        span, stats = self.span(obs, model, grad)
        stats = {**stats, "rank": float(span.rank)}
        if span.rank == 0 or span.full:
            return Reconstruction(
                token_ids=[[]], stats={**stats, "span_full": float(span.full)}, ordered=False
            )
        tokens = self.tokens(model, spec, span)
        log.info("%s: rank %d, %d tokens", type(self).__name__, span.rank, len(tokens))
        stats.update({"tokens": float(len(tokens)), "seconds": time.perf_counter() - start})
        return Reconstruction(token_ids=[tokens], stats=stats, ordered=False)

    def span(self, obs: Observation, model: nn.Module, grad: torch.Tensor) -> tuple[Span, dict[str, float]]:
        """The span of block 1's MLP inputs from its gradient (d_in, k): exact-arithmetic rank estimate."""
        return estimate_span(grad, self.config.rank_tol or family_of(model).rank_tol), {}

    def tokens(self, model: nn.Module, spec: FamilySpec, span: Span) -> list[int]:
        """The vocabulary tokens whose context-free MLP input lies closest to ``span`` (module docstring):
        the ``rank`` closest, or those below the threshold."""
        cfg = self.config
        module = find_module(model, spec.mlp_inputs[0].format(i=0))[1]
        vocab = torch.arange(vocab_size(model)).unsqueeze(1)
        positions = cfg.positions if spec.positions == "learned" else 1
        best = torch.full((vocab.shape[0],), float("inf"), dtype=torch.float64)
        for p in range(positions):
            z = layer_inputs(model, module, vocab, start_position=p, chunk=cfg.chunk)[:, 0]
            best = torch.minimum(best, span.residual_squared32(z).clamp_min(0).sqrt().to(torch.float64))
        order = best.argsort()
        if cfg.select == "rank":
            return order[: span.rank].tolist()
        return order[: int((best < cfg.threshold).sum())].tolist()


ATTACKS.register(
    "mlp_svd",
    MLPSVD,
    config_cls=MLPSVDConfig,
    summary="adaptive MLP-SVD: span check on block 1's MLP-expansion gradient (paper 002 Channel 3)",
    modality="text",
)
