"""Block 1 of a post-LN BERT encoder evaluated from per-(token, position) tables (DAGER's encoder search).

DAGER's encoder search (Petrov et al., NeurIPS 2024, Sec. 4.3) checks whole candidate sequences: a sequence
is accepted when the block-2 input of each of its positions lies in the span of block 2's attention-weight
gradient. Under BERT's embeddings the layer-1 input of a token at a position, ``LN(E_tok + E_pos +
E_type0)``, depends on that token and position alone, and so do its block-1 query, key and value. The
search only ever places the batch's candidate tokens (a few hundred) at the first few dozen positions, so
:class:`Block1Table` computes those once and evaluates block 1 on any sequence from them: the attention, its
output projection and the feed-forward layer are the only work left per sequence. It is checked against the
model's own forward when built (:meth:`Block1Table.build` returns None where it does not agree), so it is a
faster route to the same block-2 inputs (equal up to float rounding: the build check allows a relative
error of 1e-4), not an approximation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gradleak.attacks.text.family import layer_inputs

log = logging.getLogger(__name__)

MAX_TABLE_BYTES = 512 * 2**20  # tables larger than this are not built (the model's forward is used)
AGREEMENT_TOL = 1e-4  # relative error of the table's block-2 inputs against the model's forward


@dataclass(frozen=True)
class Block1Table:
    """Layer-1 inputs ``z1`` and block-1 queries, keys and values ``q``, ``k``, ``v`` (each ``(V, T, ...)``)
    of V tokens at positions ``0 .. T - 1``, and block 1 (``layer``, a BERT layer: ``attention.self``,
    ``attention.output``, ``intermediate``, ``output``) to finish the pass. ``rows`` maps a token id to its
    row (-1: not tabulated)."""

    layer: Any
    rows: torch.Tensor  # (vocab size,) row of each token id, -1 where not tabulated
    z1: torch.Tensor  # (V, T, d)
    q: torch.Tensor  # (V, T, h, dh)
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    @torch.no_grad()
    def build(
        cls, model: nn.Module, first: nn.Module, module: nn.Module, layer: Any, tokens: list[int], length: int
    ) -> Block1Table | None:
        """The table of ``tokens`` x positions ``0 .. length - 1`` for ``model`` whose block 1 is ``layer``
        (``first`` its query projection, ``module`` block 2's, whose input the search checks), or None when
        it would exceed :data:`MAX_TABLE_BYTES` or its block-2 inputs disagree with the model's forward
        (relative error above :data:`AGREEMENT_TOL` on a few sequences of the table's tokens)."""
        ids = sorted(set(tokens))
        sa = layer.attention.self
        d, size = int(sa.query.weight.shape[1]), int(sa.query.weight.element_size())
        if not ids or length < 1 or 4 * len(ids) * length * d * size > MAX_TABLE_BYTES:
            return None
        grid = torch.tensor(ids).unsqueeze(1).expand(len(ids), length)
        z1 = layer_inputs(model, first, grid)  # (V, T, d): each token at every position, context-free
        h, dh = int(sa.num_attention_heads), int(sa.attention_head_size)
        q, k, v = (f(z1).view(len(ids), length, h, dh) for f in (sa.query, sa.key, sa.value))
        vocab = int(max(ids)) + 1
        rows = torch.full((vocab,), -1, dtype=torch.long)
        rows[torch.tensor(ids)] = torch.arange(len(ids))
        table = cls(layer, rows, z1, q, k, v)
        probe = torch.tensor(ids)[torch.arange(3 * min(length, 8)).remainder(len(ids))].view(3, -1)
        ref = layer_inputs(model, module, probe)
        err = float((table.whole(probe) - ref).norm() / ref.norm().clamp_min(1e-30))
        if not err < AGREEMENT_TOL:
            log.debug("block-1 table disagrees with the model (relative error %.1e): not used", err)
            return None
        return table

    @property
    def length(self) -> int:
        return int(self.z1.shape[1])

    def covers(self, seqs: torch.Tensor | list[list[int]]) -> bool:
        """Whether every token of ``seqs`` (n, L) is tabulated and L is at most the table's length."""
        t = torch.as_tensor(seqs)
        return t.numel() > 0 and t.shape[-1] <= self.length and self.has(t)

    def has(self, tokens: torch.Tensor | list[int] | list[list[int]]) -> bool:
        """Whether every token id in ``tokens`` (any shape) is tabulated."""
        t = torch.as_tensor(tokens, dtype=torch.long)
        inside = bool(((t >= 0) & (t < self.rows.numel())).all())
        return inside and bool((self.rows[t] >= 0).all())

    def index(self, seqs: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Table rows (n, L) of ``seqs`` and the positions (L,) they sit at, from ``start``."""
        t = torch.as_tensor(seqs)
        return self.rows[t], torch.arange(start, start + t.shape[-1])

    def inputs(self, seqs: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Layer-1 inputs (n, L, d) of ``seqs`` placed at positions ``start ..``."""
        r, p = self.index(seqs, start)
        return self.z1[r, p]

    def whole(self, seqs: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """Block-2 inputs (n, L, d) of whole sequences ``seqs`` (n, L) (positions 0 .. L - 1, no padding)."""
        return self._chunked(seqs, chunk, self._whole)

    def feed_forward_inputs(self, seqs: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """Block 1's feed-forward inputs (n, L, d) of whole sequences: :meth:`whole` without its most costly
        part, the feed-forward layer."""
        return self._chunked(seqs, chunk, self._feed_forward_inputs)

    @staticmethod
    def _chunked(seqs: torch.Tensor, chunk: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        t = torch.as_tensor(seqs)
        step = max(1, chunk // max(1, t.shape[1]))
        return torch.cat([fn(part) for part in t.split(step)])

    @torch.no_grad()
    def _whole(self, seqs: torch.Tensor) -> torch.Tensor:
        return feed_forward(self.layer, self._feed_forward_inputs(seqs))

    @torch.no_grad()
    def _feed_forward_inputs(self, seqs: torch.Tensor) -> torch.Tensor:
        r, p = self.index(seqs)
        q, k, v = (x[r, p].transpose(1, 2) for x in (self.q, self.k, self.v))  # (n, h, L, dh)
        n, h, length, dh = q.shape
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, length, h * dh)
        return attention_output(self.layer, out, self.z1[r, p])

    @torch.no_grad()
    def site(
        self, ctx: torch.Tensor, positions: torch.Tensor, cands: torch.Tensor, at: int | torch.Tensor
    ) -> torch.Tensor:
        """(n, c, d): block-2 input of each candidate token ``cands`` (c,) placed at position ``at``,
        attending over itself and each context ``ctx`` (n, m) of tokens at ``positions`` (the context's
        keys and values are its own tokens', as under BERT's post-LN layers). ``positions`` (m,) and
        ``at`` (an int) are shared by the contexts, or given per context ((n, m) and (n,)): one call then
        screens several sites of a sequence."""
        return finish(self.layer, *self.site_heads(ctx, positions, cands, at))

    @torch.no_grad()
    def site_heads(
        self, ctx: torch.Tensor, positions: torch.Tensor, cands: torch.Tensor, at: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`site`'s attention alone (:func:`attend_heads`): the heads' outputs and layer-1 inputs,
        (n, c, ...) each, with ``positions`` and ``at`` as there."""
        r, p = self.rows[torch.as_tensor(ctx)], torch.as_tensor(positions)
        rc, at = self.rows[torch.as_tensor(cands)], torch.as_tensor(at)
        if at.dim() == 1:
            rc, at = rc.unsqueeze(0), at.unsqueeze(1)
        q, k, v, z = (x[rc, at] for x in (self.q, self.k, self.v, self.z1))
        return attend_heads(self.k[r, p], self.v[r, p], q, k, v, z)


@torch.no_grad()
def attend_heads(
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    q_c: torch.Tensor,
    k_c: torch.Tensor,
    v_c: torch.Tensor,
    z_c: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT block 1's attention for each of c candidates (query ``q_c``, key ``k_c``, value ``v_c`` (c, h,
    dh), layer-1 input ``z_c`` (c, d), shared by the contexts, or (n, c, ...), one set per context)
    attending over its own key and each of n contexts' keys and values ``k_ctx``, ``v_ctx`` (n, m, h, dh):
    the heads' concatenated outputs (n, c, h dh) and the candidates' layer-1 inputs (n, c, d), which
    :func:`finish` takes to block 1's output (:func:`attention_output` to its feed-forward input)."""
    n, m, h, dh = k_ctx.shape
    if q_c.dim() == 3:  # shared by the contexts
        q_c, k_c, v_c, z_c = (t.unsqueeze(0) for t in (q_c, k_c, v_c, z_c))
    c = q_c.shape[1]
    scale = dh**-0.5
    s_ctx = torch.einsum("nchd,nthd->ncht", q_c.expand(n, -1, -1, -1), k_ctx) * scale  # (n, c, h, m)
    s_self = (q_c * k_c).sum(-1).mul(scale).expand(n, c, h).unsqueeze(-1)  # (n, c, h, 1)
    w = torch.softmax(torch.cat([s_ctx, s_self], dim=-1), dim=-1)
    out = torch.einsum("ncht,nthd->nchd", w[..., :m], v_ctx) + w[..., m:] * v_c
    return out.reshape(n, c, h * dh), z_c.expand(n, c, -1)


def finish(layer: Any, attended: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
    """Block 1's output (its attention's output projection and LayerNorm, then the feed-forward layer and
    its LayerNorm) from the heads' concatenated outputs ``attended`` and the layer-1 inputs ``z1``."""
    return feed_forward(layer, attention_output(layer, attended, z1))


def attention_output(layer: Any, attended: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
    """Block 1's attention sublayer output (output projection, residual, LayerNorm): its feed-forward
    layer's input, of ``z1``'s shape."""
    shape = z1.shape
    return layer.attention.output(attended.reshape(-1, shape[-1]), z1.reshape(-1, shape[-1])).view(shape)


def feed_forward(layer: Any, a: torch.Tensor) -> torch.Tensor:
    """Block 1's feed-forward sublayer (with its residual and LayerNorm) on its inputs ``a`` (..., d)."""
    flat = a.reshape(-1, a.shape[-1])
    return layer.output(layer.intermediate(flat), flat).view(a.shape)
