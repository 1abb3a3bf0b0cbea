"""Row-norm side channels of paper 002: embedding row norms (Channel 2) and the untied LM-head probe.

Channel 2 (paper 002, Sec. III-C, Def. 2): the input-embedding gradient dL/dE has non-zero rows exactly at
the tokens of the batch (the union over its B sequences); with a tied LM head the output projection adds a
dense but much smaller term. The LM-head probe (Sec. VI-C, stress test) reads the rows of an *untied* head,
dL/dW_LM = (1/N) sum_t (p_t - e_{y_t}) h_t^T, whose large rows are the target tokens.

:mod:`embedding_norm` and :mod:`lm_head` register the two attacks. Both rank rows by norm and keep the
top k, k where the sorted norms drop the most (``select="gap"``; a zero row is an infinite drop) or the
rows above ``threshold`` times the largest (``select="threshold"``). The result is an unordered token
set, returned as one sequence in decreasing-norm order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from gradleak.attacks.text.family import update_tensor
from gradleak.types import Observation, Reconstruction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowNormConfig:
    """``select`` ``"gap"`` (the largest ratio between consecutive sorted row norms among the top
    ``max_tokens``: no threshold to tune, the default) or ``"threshold"`` (rows above ``threshold`` times
    the largest; paper 002 states no value, 1e-3 is our choice)."""

    select: str = "gap"  # "gap" or "threshold"
    threshold: float = 1e-3  # relative to the largest row norm (select="threshold")
    max_tokens: int = 4096  # the gap is searched among the top max_tokens rows

    def __post_init__(self) -> None:
        if self.select not in ("gap", "threshold"):
            raise ValueError(f"select must be 'gap' or 'threshold', got {self.select!r}")
        if not 0 < self.threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


def select_rows(grad: torch.Tensor, cfg: RowNormConfig) -> tuple[list[int], torch.Tensor]:
    """Token ids of the selected rows (largest norm first) and all row norms."""
    norms = grad.to(torch.float64).norm(dim=1)
    top = norms.argsort(descending=True)[: cfg.max_tokens + 1]
    vals = norms[top]
    if float(vals[0]) == 0.0:
        return [], norms
    if cfg.select == "threshold":
        k = int((vals > cfg.threshold * vals[0]).sum())
    else:
        ratios = vals[:-1] / vals[1:].clamp_min(1e-300)
        k = int(ratios.argmax()) + 1
    return top[:k].tolist(), norms


class RowNormAttack:
    channel = ""

    def __init__(self, config: RowNormConfig | None = None) -> None:
        self.config = config or RowNormConfig()

    def param(self, obs: Observation) -> str:
        raise NotImplementedError

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        start = time.perf_counter()
        tokens, norms = select_rows(update_tensor(obs, self.param(obs)), self.config)
        log.info("%s: %d tokens selected", self.channel, len(tokens))
        stats = {"tokens": float(len(tokens)), "nonzero_rows": float((norms > 0).sum()),
                 "seconds": time.perf_counter() - start}  # fmt: skip
        return Reconstruction(token_ids=[tokens], stats=stats, ordered=False)
