"""SOMP as read here (Li and Li, "SOMP: Scalable gradient inversion for large language models via
subspace-guided orthogonal matching pursuit", 2026; paper 002's [8]). **Our reading, not a reproduction:**
neither SOMP's code nor its method section is offline, only paper 002's description of it: it "extends
DAGER's subspace test to a head-structured pooling stage followed by an Orthogonal Matching Pursuit
reconstruction over an LM-guided beam, scaling token recovery to larger batch sizes" (Sec. II-A), and it
"relies on the Q-weight gradient subspace" (Sec. VI-E). Every choice those words leave open is a parameter.

1. **Tokens: DAGER's subspace test.** Block 1's input-side gradient (Q, K, V) gives the span of the batch's
   layer-1 inputs; the tokens (at each learned position) whose layer-1 input lies in it are the candidates
   (:class:`~gradleak.attacks.text.dager.core.Dager`, steps 1-2, unchanged).
2. **Head-structured pooling.** Block 2's input-side gradient G = sum_t y_t delta_t^T is split into its
   heads' column blocks G_h (Q, K and V, ``head_dim`` columns each), each scaled to unit Frobenius norm.
   Every column of every block is a combination of the same block-2 inputs y_t: a simultaneous sparse
   recovery problem (multiple measurement vectors; Tropp, Gilbert and Strauss, Signal Processing 2006) whose
   atoms are the block-2 inputs of candidate prefixes. An atom's *gain* is the pooled share of the gradient
   it explains beyond the atoms already chosen: with q its unit component orthogonal to them,
   mean_h ||G_h^T q||^2. Each head counts the same, whatever its gradient's scale.
3. **Orthogonal matching pursuit over the beam.** Sequences grow left to right over the whole batch at once,
   as DAGER's decoder search does (under causal attention a prefix's last block-2 input depends on the prefix
   alone). At each length, the extensions of every live prefix by the position's candidates are the
   dictionary; those outside block 2's span (DAGER's L2 test, where the span is not full) or repeating
   their prefix's last input are left out; OMP picks the atom of highest gain, projects it out, and repeats
   while the best gain is at least ``min_gain`` and fewer than B (the update's sample count) prefixes are
   live. A prefix with no picked extension is a finished sequence. Because a picked atom is projected out,
   an extension that only re-explains what the batch's other prefixes already explain gains ~nothing: the
   beam needs no width beyond B.
4. **LM guidance** (``prior``, optional: LAMP's kind of prior, :mod:`~gradleak.attacks.text.lm_prior`): the
   atoms are ranked by log gain - ``prior_weight`` x the prior's mean NLL of the extended prefix; the gain
   alone decides acceptance.

Last tokens (only labels under the next-token loss) come from the LM head as in DAGER. Scope: causal
language models (GPT-2 arch, SmolLM2/Llama), FedSGD; an encoder or a FedAvg delta is refused before work.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from gradleak.attacks.text.dager.core import Dager, DagerConfig
from gradleak.attacks.text.dager.search import L2Search, Scored
from gradleak.attacks.text.family import (
    FamilySpec,
    Span,
    embedding_param,
    family_of,
    update_tensor,
    vocab_size,
)
from gradleak.attacks.text.lm_prior import LMPrior, LMPriorConfig, load_prior, vocabulary_size
from gradleak.attacks.text.rownorm import RowNormConfig, select_rows
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, AttackNeeds, Observation, Reconstruction

log = logging.getLogger(__name__)


def head_dim(model: nn.Module) -> int:
    """The attention heads' width: ``config.head_dim`` where set (Llama), else hidden size / heads."""
    config = getattr(model, "config", None)
    explicit = getattr(config, "head_dim", None)
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0 or hidden % heads:
        raise AttackInputError("SOMP reads the attention heads' width off the model's config; it has none")
    return hidden // heads


class HeadPool:
    """Step 2: the head blocks of an input-side gradient (d, k), each of unit Frobenius norm, and the atoms
    chosen so far (an orthonormal basis of their span)."""

    def __init__(self, grad: torch.Tensor, width: int) -> None:
        if grad.shape[1] % width:
            raise AttackInputError(f"the gradient's {grad.shape[1]} columns are not whole heads of {width}")
        blocks = grad.to(torch.float64).T.reshape(-1, width, grad.shape[0])  # (heads, width, d)
        norms = blocks.flatten(1).norm(dim=1)
        self.blocks = blocks[norms > 0] / norms[norms > 0, None, None]
        self.basis = grad.new_zeros((grad.shape[0], 0), dtype=torch.float64)

    @property
    def heads(self) -> int:
        return int(self.blocks.shape[0])

    def orthogonal(self, z: torch.Tensor) -> torch.Tensor:
        """The components of the rows of ``z`` (n, d) orthogonal to the chosen atoms."""
        z = z.to(torch.float64)
        return z - (z @ self.basis) @ self.basis.T

    def gains(self, z: torch.Tensor, tol: float) -> torch.Tensor:
        """Each atom's pooled gain, mean_h ||G_h^T q||^2 (q: its unit component orthogonal to the chosen
        atoms); 0 where that component is below ``tol`` of the atom's norm (it adds no new direction)."""
        perp = self.orthogonal(z)
        norm = perp.norm(dim=1)
        q = perp / norm.clamp_min(1e-300)[:, None]
        gain = torch.einsum("hwd,nd->nhw", self.blocks, q).pow(2).sum(-1).mean(-1)
        return torch.where(norm > tol * z.to(torch.float64).norm(dim=1), gain, torch.zeros_like(gain))

    def add(self, z: torch.Tensor) -> None:
        perp = self.orthogonal(z.unsqueeze(0))[0]
        self.basis = torch.cat([self.basis, (perp / perp.norm())[:, None]], dim=1)

    def explained(self) -> float:
        """The pooled share of the gradient the chosen atoms explain, in [0, 1]."""
        return float(torch.einsum("hwd,dm->hwm", self.blocks, self.basis).pow(2).sum((1, 2)).mean())


@dataclass(frozen=True)
class SompConfig(DagerConfig):
    """DAGER's span tests and token candidates (the parent's options), and steps 2-4: ``min_gain`` the
    smallest pooled gain an extension must add (ours: 1e-6, above float64 rounding of a repeated atom,
    below the smallest true token's share measured on GPT-2 small, ~1e-4); ``parallel_tol`` an atom whose
    component off the chosen ones is below this share of its norm adds no direction; ``prior`` /
    ``prior_weight`` the LM guidance (none by default)."""

    min_gain: float = 1e-6
    parallel_tol: float = 1e-6
    prior_weight: float = 0.0
    prior: LMPriorConfig = field(default_factory=LMPriorConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.min_gain < 1:
            raise ValueError(f"min_gain must be in (0, 1), got {self.min_gain}")
        if not 0 < self.parallel_tol < 1:
            raise ValueError(f"parallel_tol must be in (0, 1), got {self.parallel_tol}")
        if not 0 <= self.prior_weight < float("inf"):
            raise ValueError(f"prior_weight must be a finite number >= 0, got {self.prior_weight}")
        if not isinstance(self.prior, LMPriorConfig):
            raise TypeError(f"prior must be an LMPriorConfig, got {type(self.prior).__name__}")
        if (self.prior.tokenizer is None) != (self.prior_weight == 0):
            raise ValueError(
                "prior.tokenizer and prior_weight go together: name the victim's tokenizer and give a weight "
                f"> 0, or neither (got {self.prior.tokenizer!r} and {self.prior_weight})"
            )


@dataclass
class OmpSearch(L2Search):
    """Step 3 (and 4): the decoder search by simultaneous OMP over block 2's head blocks."""

    pool: HeadPool | None = None
    batch: int = 1
    min_gain: float = 1e-6
    parallel_tol: float = 1e-6
    prior: LMPrior | None = None
    prior_weight: float = 0.0

    def extend(self, cands: list[list[int]], search: str, beam_width: int) -> list[Scored]:
        """Grow the batch's prefixes length by length, each length's extensions picked by OMP (step 3).
        ``search`` and ``beam_width`` are DAGER's and unused: at most B prefixes are live."""
        if not cands or self.pool is None:
            return []
        firsts = [[v] for v in cands[0]]
        z = self.block2_inputs(torch.tensor(cands[0]).unsqueeze(1))[:, 0]
        gains: dict[tuple[int, ...], float] = {}
        live = self.pick(firsts, z, self.admissible(z, None), gains)
        done: list[list[int]] = []
        for p in range(1, len(cands)):
            if not live:
                break
            group = max(1, self.chunk // (8 * len(cands[p])))
            parts = [self.extension_inputs(live[i : i + group], cands[p]) for i in range(0, len(live), group)]
            z = torch.cat([zz for zz, _ in parts])
            prev = torch.cat([pp for _, pp in parts])
            seqs = [s + [v] for s in live for v in cands[p]]
            nxt = self.pick(seqs, z, self.admissible(z, prev), gains)
            grown = {tuple(s[:-1]) for s in nxt}
            done += [s for s in live if tuple(s) not in grown]
            live = nxt
        done += live
        return [(s, -sum(gains.get(tuple(s[:i]), 0.0) for i in range(1, len(s) + 1))) for s in done]

    def admissible(self, z: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
        """The atoms OMP may pick: inside block 2's span (unless it is full: no test) and, for extensions,
        not repeating the prefix's last block-2 input (DAGER's ``repeat_tol``)."""
        ok = torch.ones(z.shape[0], dtype=torch.bool)
        if not self.span.full:
            ok &= self.span.residual(z) < self.threshold
        if prev is not None:
            ok &= ~self.repeats(z, prev)
        return ok

    def pick(
        self, seqs: list[list[int]], z: torch.Tensor, ok: torch.Tensor, gains: dict[tuple[int, ...], float]
    ) -> list[list[int]]:
        """OMP over the atoms ``z`` of ``seqs``: the highest-ranked admissible atom is chosen and projected
        out while its gain is >= ``min_gain`` and fewer than B are chosen; their gains go to ``gains``."""
        assert self.pool is not None
        penalty = torch.zeros(len(seqs), dtype=torch.float64)  # a first token: nothing to predict
        if self.prior is not None and len(seqs[0]) > 1 and ok.any():
            penalty = self.prior_weight * self.prior.nll(torch.tensor(seqs)).to(torch.float64)
        chosen: list[int] = []
        while len(chosen) < self.batch and ok.any():
            g = self.pool.gains(z, self.parallel_tol)
            rank = torch.where(ok & (g >= self.min_gain), g.clamp_min(1e-300).log() - penalty, -math.inf)
            j = int(rank.argmax())
            if rank[j] == -math.inf:
                break
            gains[tuple(seqs[j])] = float(g[j])
            self.pool.add(z[j])
            chosen.append(j)
            ok = ok.clone()
            ok[j] = False
        return [seqs[j] for j in chosen]


class Somp(Dager):
    """SOMP as read here (module docstring): DAGER's token candidates, then OMP over block 2's head blocks."""

    needs = AttackNeeds(update_kinds=("gradient",))

    def __init__(self, config: SompConfig | None = None) -> None:
        super().__init__(config or SompConfig())
        self._pool: HeadPool | None = None
        self._rows: list[int] | None = None
        self._batch = 1

    def embedding_rows(self, obs: Observation, model: nn.Module) -> list[int] | None:
        """The tokens the embedding row-norm channel keeps (paper 002's Channel 2), or None where the update
        lacks the embedding gradient or the channel keeps nothing."""
        name = embedding_param(model)
        if name not in obs.update.tensors:
            return None
        tokens, _ = select_rows(update_tensor(obs, name), RowNormConfig())
        return sorted(tokens) or None

    @property
    def somp(self) -> SompConfig:
        assert isinstance(self.config, SompConfig)
        return self.config

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        model = obs.client_model()
        if not family_of(model).causal:
            raise AttackInputError(
                "SOMP's beam grows causal prefixes (a prefix's block-2 input depends on the prefix alone): "
                f"it needs a causal language model, not {type(model).__name__}"
            )
        if obs.update.kind != "gradient":
            raise AttackInputError("SOMP reads one FedSGD gradient; this update is a FedAvg delta")
        self.check_prior(model)
        width = head_dim(model)
        self._batch = max(1, obs.update.num_samples)
        self._pool = HeadPool(self.input_gradient(obs, model, self.spec(model), 1), width)
        self._rows = self.embedding_rows(obs, model)
        out = super().reconstruct(obs, generator=generator)
        stats = {**out.stats, "heads": float(self._pool.heads), "explained_l2": self._pool.explained()}
        return Reconstruction(token_ids=out.token_ids, stats=stats)

    def unreadable(self, span1: Span, span2: Span, grads: list[torch.Tensor]) -> bool:
        """Scaling past DAGER's rank limit: a full block-2 span only drops the span test from step 3 (OMP's
        gains still rank the atoms), and a full block-1 span falls back to the embedding channel's tokens at
        every position (:meth:`position_candidates`); only a full block-1 span without that channel is
        unreadable."""
        return span1.full and self._rows is None

    def position_candidates(
        self, model: nn.Module, spec: FamilySpec, module: nn.Module, span: Span, scan: torch.Tensor
    ) -> list[list[int]]:
        if not span.full:
            return super().position_candidates(model, spec, module, span, scan)
        assert self._rows is not None
        log.info("SOMP: block 1's span is full; %d embedding-row tokens at each position", len(self._rows))
        return [self._rows] * self.config.max_positions

    def check_prior(self, model: nn.Module) -> None:
        """A prior for another vocabulary is refused before any is built."""
        c = self.somp
        if c.prior.tokenizer is not None and vocabulary_size(c.prior.tokenizer) != vocab_size(model):
            raise AttackInputError(
                f"the prior's tokenizer ({c.prior.tokenizer!r}) is not the model's vocabulary: name the "
                "victim's tokenizer in prior.tokenizer"
            )

    def l2_search(
        self, model: nn.Module, m2: nn.Module, span2: Span, threshold: float, m1: nn.Module,
        generator: torch.Generator,
    ) -> L2Search:  # fmt: skip
        c = self.somp
        return OmpSearch(
            model, m2, span2, threshold, c.chunk, c.repeat_tol, m1,
            pool=self._pool, batch=self._batch, min_gain=c.min_gain, parallel_tol=c.parallel_tol,
            prior=load_prior(c.prior) if c.prior.tokenizer is not None else None, prior_weight=c.prior_weight,
        )  # fmt: skip


ATTACKS.register(
    "somp",
    Somp,
    config_cls=SompConfig,
    summary="SOMP as read here: DAGER's token test, then OMP over block 2's head blocks (Li and Li 2026)",
    modality="text",
)
